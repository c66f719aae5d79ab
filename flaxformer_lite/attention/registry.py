"""Named attention variants: the one swap point (`config.model.attention`).

A variant is a pure function plus an entry here. `MultiHeadAttention` calls
  fn(query [b,n,h,d], key [b,m,h,d], value [b,m,h,d], *, mask, bias,
     dropout_rate, dropout_rng, deterministic, dtype, return_weights,
     **params, **kwargs)
  -> [b, n, h, d], or (that, weights [b, h, n, m]) when return_weights
where `params` are arrays the layer creates from `AttentionVariant.params`
(learned tables, per-head matrices) and `kwargs` are the variant's options
from `config.model.attention_kwargs`. Some variants receive more:
  uses_positions: `q_offset`, the absolute position of the first query
    (non-zero when decoding with a cache, or for an RNN decoder's step t).
  stochastic: `rng`, a PRNG key when deterministic=False, else None.
  uses_alignment: `prev_alignment` [b, h, n, m], the sum of the weights of
    all earlier decoder steps (zeros at the first); only a step-by-step
    decoder (the RNN) can supply it, so such variants list rnn_seq2seq only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from flaxformer_lite.attention.dot_product import dot_product_attention

TRANSFORMER_MODELS = ('encoder_decoder', 'decoder_only', 'encoder_only')
ALL_MODELS = TRANSFORMER_MODELS + ('rnn_seq2seq',)


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
  """One registry entry.

  name: the config value.
  fn: the pure attention function (signature above).
  kwargs: option name -> default; the types of the defaults are the types
    accepted from the command line.
  params: (num_heads, head_dim, kwargs) -> {name: (shape, initializer)}; the
    layer creates these parameters and passes them to `fn` by name.
  models: model types that can use the variant.
  validate: kwargs -> None, raising ValueError with a reason.
  uses_positions: fn takes `q_offset`.
  stochastic: fn takes `rng`.
  uses_alignment: fn takes `prev_alignment`.
  doc: one line for `--list_attention`.
  """
  name: str
  fn: Callable[..., Any]
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  params: Callable[..., Mapping[str, Any]] | None = None
  models: tuple[str, ...] = ALL_MODELS
  validate: Callable[[Mapping[str, Any]], None] | None = None
  uses_positions: bool = False
  stochastic: bool = False
  uses_alignment: bool = False
  doc: str = ''


_REGISTRY: dict[str, AttentionVariant] = {}

# The option names that several variants take, each with its one meaning. A
# value in `config.model.attention_kwargs` carries over when the user swaps the
# variant, so any other name belongs to one variant only (`register` checks).
SHARED_OPTIONS: dict[str, str] = {
    'half_window': "Luong's D: query i sees the keys |j - p_i| <= D around its "
                   'window position p_i',
}


def _check_options(variant: AttentionVariant) -> None:
  """Raises unless each option of `variant` is new, or shared (SHARED_OPTIONS)
  with the same default as every variant that already takes it."""
  for name, default in variant.kwargs.items():
    for other in _REGISTRY.values():
      if name not in other.kwargs:
        continue
      theirs = other.kwargs[name]
      if name not in SHARED_OPTIONS:
        raise ValueError(
            f'attention option {name!r} of variant {variant.name!r} is already an option '
            f'of {other.name!r}: a value set for one would carry over to the other. Give '
            f'it a name of its own, or, if it means the same thing in both, declare it in '
            f'registry.SHARED_OPTIONS with that meaning and use the same default')
      if type(default) is not type(theirs) or default != theirs:
        raise ValueError(
            f'attention option {name!r} is shared (registry.SHARED_OPTIONS) but defaults '
            f'to {default!r} in {variant.name!r} and to {theirs!r} in {other.name!r}; a '
            'shared option has one default: use the same one, or a name of its own')


def register(variant: AttentionVariant) -> AttentionVariant:
  if variant.name in _REGISTRY:
    raise ValueError(f'attention variant {variant.name!r} is registered twice')
  _check_options(variant)
  _REGISTRY[variant.name] = variant
  return variant


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> AttentionVariant:
  if name not in _REGISTRY:
    raise ValueError(f'unknown attention variant {name!r}; valid: {", ".join(names())}')
  return _REGISTRY[name]


def all_kwargs() -> dict[str, Any]:
  """Every option any variant accepts -> its default (one per name: `register`
  admits a name twice only when it is shared with the same default)."""
  return {k: default for v in _REGISTRY.values() for k, default in v.kwargs.items()}


def resolve_kwargs(name: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
  """The variant's options: its defaults overridden by `given`.

  `given` may hold None for options left unset (the config declares every
  option of every variant as an unset placeholder). An option set for a
  variant that does not take it is an error naming the variant's options.
  """
  variant = get(name)
  given = {k: v for k, v in dict(given or {}).items() if v is not None}
  unknown = sorted(set(given) - set(variant.kwargs))
  if unknown:
    valid = ', '.join(f'{k}={v!r}' for k, v in variant.kwargs.items()) or 'none'
    raise ValueError(f'attention_kwargs {unknown} do not apply to attention='
                     f'{name!r}; its options are: {valid}')
  kwargs = {**variant.kwargs, **given}
  if variant.validate is not None:
    variant.validate(kwargs)
  return kwargs


def describe(variant: AttentionVariant) -> str:
  """One line: name, models, options with defaults, doc."""
  opts = ' '.join(f'{k}={v!r}' for k, v in variant.kwargs.items()) or '-'
  return (f'{variant.name}\tmodels={",".join(variant.models)}\t'
          f'kwargs: {opts}\t{variant.doc}')


def _validate_dot_product(kwargs):
  if kwargs['implementation'] not in ('auto', 'reference', 'xla', 'cudnn'):
    raise ValueError(f"attention_kwargs.implementation={kwargs['implementation']!r}; "
                     "valid: 'auto', 'reference', 'xla', 'cudnn'")
  if kwargs['implementation'] == 'cudnn' and jax.default_backend() != 'gpu':
    raise ValueError(
        "attention_kwargs.implementation='cudnn' needs an NVIDIA GPU, and this machine's "
        f"JAX backend is {jax.default_backend()!r}; use 'auto' (picks cuDNN where it can "
        "run) or 'reference'/'xla'")


def cudnn_fits(query, key, *, dropout_rate=0.0, deterministic=True, return_weights=False,
               dtype=None) -> bool:
  """Whether 'auto' takes cuDNN's fused kernel: a GPU backend, 16-bit compute,
  head size a multiple of 8 up to 128, no attention dropout, no weights asked
  for, and more than one query (not a cached decoding step)."""
  dtype = jnp.dtype(dtype or query.dtype)
  d = query.shape[-1]
  return (jax.default_backend() == 'gpu' and dtype in (jnp.bfloat16, jnp.float16)
          and d % 8 == 0 and d <= 128 and (deterministic or dropout_rate == 0.0)
          and not return_weights and query.shape[1] > 1 and key.shape[1] > 1)


def _dot_product(query, key, value, *, implementation='auto', **common):
  if implementation == 'auto':  # the explicit path, unless cuDNN's kernel fits
    fits = cudnn_fits(query, key, **{k: common[k] for k in (
        'dropout_rate', 'deterministic', 'return_weights', 'dtype') if k in common})
    implementation = 'cudnn' if fits else None
  return dot_product_attention(query, key, value, implementation=implementation, **common)


register(AttentionVariant(
    name='dot_product',
    fn=_dot_product,
    kwargs={'implementation': 'auto'},
    validate=_validate_dot_product,
    doc='softmax(q.k/sqrt(d)) v (Vaswani et al. 2017); implementation=xla|cudnn '
        'for jax.nn.dot_product_attention'))
