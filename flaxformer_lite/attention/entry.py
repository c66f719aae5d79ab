"""The one entry point: attention of projected queries, keys and values
under a named scheme or an inline score, and a mask, on the kernel `auto`
picks.

  out = attend(q, k, v, scheme='alibi', mask=masks.causal())
  out = attend(q, k, v, score=lambda s, b, h, q, k, t: 30 * jnp.tanh(s / 30))

Everything a variant needs besides q, k and v (its options and parameters,
positions, a decoding offset, dropout, the RNN decoders' alignment) is an
argument here; which of them a variant reads, and which kernel runs it, is
decided here from its registry entry and select.py's policy, so that the
layers hold projections and caches only.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Mapping, NamedTuple

import jax.numpy as jnp

from flaxformer_lite.attention import masks, registry, select
from flaxformer_lite.attention.kernels import table as kernels


def attend(query, key, value, *, scheme: str = 'dot_product', score=None, tables=None,
           mask=None, kernel: str | None = None, scale: float | None = None,
           options: Mapping[str, Any] | None = None, params: Mapping[str, Any] | None = None,
           q_offset=0, positions=None, bias=None, dropout_rate: float = 0.0, dropout_rng=None,
           rng=None, prev_alignment=None, decoding: bool = False, dtype=None,
           return_weights: bool = False):
  """Attention under `scheme` (a registry name) or an inline `score`.

  Args:
    query: [b, n, h, d], query i at position q_offset + i (or positions[i]);
      key, value: [b, m, g, d], g dividing h (grouped-query attention).
    scheme: the variant's registry name (`--list_attention`).
    score, tables: in place of `scheme`, a score(s, b, h, q_pos, k_pos,
      tables) -> s run unregistered (scheme.py), with its tables by name.
    mask: None, a masks.Mask, or a boolean array broadcastable to
      [b, h, n, m] (True = may attend; its row i is query q_offset + i).
    kernel: 'auto' (select.py), 'dense', 'chunked' or one of the variant's
      own (dot_product: 'xla', 'cudnn'); None: options' `kernel`.
    scale: what q.k is multiplied by before the score (default 1/sqrt(d)).
    options: the variant's options and the kernel options
      (config.model.attention_kwargs; unset ones may be None).
    params: the variant's parameters by name (AttentionVariant.params).
    q_offset: the first query's position (int, may be traced: decoding).
    positions: int [n] (self-attention, n = m): the positions of the queries
      and keys in place of q_offset + i and j (randomized positions).
    bias: broadcastable to [b, h, n, m], added to the scaled scores (the
      dense kernel only).
    dropout_rate, dropout_rng: attention dropout, on when dropout_rng is set.
    rng: a PRNG key for a stochastic variant (hard attention), or None.
    prev_alignment: [b, h, n, m], the RNN decoder's summed earlier weights
      (location-sensitive attention); zeros when None.
    decoding: the call is one step of cached decoding (select.py weighs it).
    dtype: the computation's dtype (default: query's).
    return_weights: also return the weights [b, h, n, m] (dense kernel).
  Returns:
    [b, n, h, dv]; with return_weights, (that, weights).
  """
  call, requested, dense_max_mib = describe_call(
      query, key, scheme=scheme, score=score, tables=tables, mask=mask, kernel=kernel,
      options=options, params=params, q_offset=q_offset, positions=positions, bias=bias,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, rng=rng,
      prev_alignment=prev_alignment, decoding=decoding, dtype=dtype,
      return_weights=return_weights)
  choice = select.choose(call, requested, dense_max_mib)
  seen = _SEEN.get()
  if seen is not None:
    seen.append(Chosen(call.variant.name, choice.kernel.name, choice.why, call.query_shape,
                       call.key_shape))
  return choice.kernel.run(call, _scaled(call.variant, query, scale), key, value)


class Chosen(NamedTuple):
  """One attend call as `recording` notes it."""
  scheme: str
  kernel: str
  why: str
  query_shape: tuple[int, ...]  # [b, n, h, d]
  key_shape: tuple[int, ...]  # [b, m, g, d]


_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar('seen', default=None)


@contextlib.contextmanager
def recording():
  """Inside it, every attend call (traced or run) appends a Chosen to the
  list it yields: which kernel each attention call of a program runs, and
  why, for a run's log."""
  seen = []
  token = _SEEN.set(seen)
  try:
    yield seen
  finally:
    _SEEN.reset(token)


def describe_call(query, key, *, scheme='dot_product', score=None, tables=None, mask=None,
                  kernel=None, options=None, params=None, q_offset=0, positions=None,
                  bias=None, dropout_rate=0.0, dropout_rng=None, rng=None,
                  prev_alignment=None, decoding=False, dtype=None, return_weights=False):
  """(kernels.Call, the kernel asked for, dense_max_mib) of `attend`'s call
  (its arguments; query and key may be jax.ShapeDtypeStructs): what
  select.choose reads, checked. `plan` is its choice."""
  variant, params = _scheme_and_params(scheme, score, tables, params)
  given = dict(options or {})
  if kernel is not None:
    given['kernel'] = kernel
  kwargs = registry.resolve_kwargs(variant, given)
  kernel_options = registry.resolve_kernel(variant, given)
  h = query.shape[2]
  _check_params(variant, params, h, query.shape[3], kwargs)
  reads_positions = positions is not None and variant.uses_positions
  if reads_positions and not variant.position_arrays:
    raise ValueError(f'attention={variant.name!r} reads positions as q_offset + 0..n-1 only; '
                     f'randomized positions need one of {registry.position_array_names()}')
  dropout = dropout_rng is not None and dropout_rate > 0.0
  mask = _as_mask(mask, query.shape, key.shape, q_offset)
  terms = variant.terms(h, **kwargs) if variant.terms is not None else None
  call = kernels.Call(
      variant=variant, terms=terms,
      kwargs=kwargs, params=params, query_shape=tuple(query.shape),
      key_shape=tuple(key.shape), dtype=dtype or query.dtype, mask=mask,
      mask_kind=select.mask_kind(mask, q_offset) if bias is None else None, q_offset=q_offset,
      positions=positions if reads_positions else None, bias=bias,
      dropout_rate=dropout_rate if dropout else 0.0, dropout_rng=dropout_rng if dropout else None,
      rng=rng, prev_alignment=prev_alignment, decoding=decoding,
      return_weights=return_weights, chunk_size=select.chunk_size(kernel_options.chunk_size),
      platform=select.platform(),
      tiles=select.pallas_tiles(query.shape[3], max(query.shape[1], key.shape[1]), terms))
  return call, kernel_options.kernel, kernel_options.dense_max_mib


def plan(query, key, **arguments) -> select.Choice:
  """The kernel `attend(query, key, value, **arguments)` runs, and why,
  without running it (query, key: arrays or jax.ShapeDtypeStructs)."""
  call, requested, dense_max_mib = describe_call(query, key, **arguments)
  return select.choose(call, requested, dense_max_mib)


def _scheme_and_params(scheme: str, score, tables, params):
  """(the registry entry, its parameters) for attend's `scheme`, or an
  unregistered one for an inline `score` with its `tables`."""
  if score is None:
    if tables is not None:
      raise ValueError(f'attend(tables=...) goes with an inline score=; attention={scheme!r} '
                       'takes its parameters as params=')
    return registry.get(scheme), dict(params or {})
  if scheme != 'dot_product':
    raise ValueError(f'attend(scheme={scheme!r}, score=...): give a registered scheme or an '
                     'inline score, not both')
  if params is not None:
    raise ValueError('attend(score=...) reads its arrays from tables=, not params=')
  return registry.inline(score), dict(tables or {})


def _as_mask(mask, query_shape, key_shape, q_offset):
  """attend's mask as a masks.Mask or None (masks.as_mask), a boolean
  array's shape checked against [b, h, n, m] first."""
  if mask is not None and not isinstance(mask, masks.Mask) and hasattr(mask, 'shape'):
    want = (query_shape[0], query_shape[2], query_shape[1], key_shape[1])
    try:
      fits = jnp.broadcast_shapes(mask.shape, want) == want
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(f'mask of shape {tuple(mask.shape)} does not broadcast to [b, h, n, m] = '
                       f'{list(want)}')
  return masks.as_mask(mask, q_offset)


def _scaled(variant, query, scale):
  """query [b, n, h, d] so that the kernels' 1/sqrt(d) scales q.k by `scale`
  (None: query itself)."""
  if scale is None:
    return query
  if variant.terms is None:
    raise ValueError(f'attend(scale={scale!r}): attention={variant.name!r} does not score by '
                     'q.k; scale= applies to the dot-product schemes')
  ratio = scale * query.shape[3] ** 0.5
  return (query.astype(jnp.promote_types(query.dtype, jnp.float32)) * ratio).astype(query.dtype)


def _check_params(variant, params, heads: int, head_dim: int, kwargs) -> None:
  """Raises ValueError naming the parameters `variant` declares that
  `params` lacks."""
  if variant.params is None:
    return
  missing = sorted(set(variant.params(heads, head_dim, kwargs)) - set(params))
  if missing:
    raise ValueError(f'attention={variant.name!r} reads the parameters {missing} '
                     f'(AttentionVariant.params), and params= holds {sorted(params) or "none"}')
