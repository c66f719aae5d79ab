"""KERPLE: kernelized relative positional embedding (Chi et al. 2022, eq. 8-9).

Each head adds a conditionally positive definite kernel of the distance
|i - j| to its logits, with two learned positive numbers r1, r2 per head:
  log:   -r1 * log(1 + r2 * |i - j|)
  power: -r1 * |i - j| ** r2,  0 < r2 <= 2.
As in the authors' code, r1 and r2 are clamped to at least 1e-2 (r2 of the
power form to at most 2) and drawn uniform at initialisation (log: r1 in
[0, 2), r2 in [0, 1); power: r1 in [0, 1), r2 in [0, 2)). The distance is
|i - j| so that one bias serves bidirectional attention too (the paper's
models are causal: there it is i - j).

Written once as block terms (scheme.py): the dense path, the chunked
kernel, the fused one and decoding come from `_score`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry, scheme

FORMS = ('log', 'power')
EPS = 1e-2


def kerple_bias(r1, r2, distance, form: str):
  """r1, r2 and distance float, broadcasting ([h, 1, 1] and [bq, bk]; one
  head's scalars and a block) -> the paper's kernel."""
  r1 = jnp.maximum(r1.astype(jnp.float32), EPS)
  r2 = jnp.maximum(r2.astype(jnp.float32), EPS)
  if form == 'log':
    return -r1 * jnp.log1p(r2 * distance)
  # |i - j| ** r2 as exp(r2 log |i - j|) where |i - j| >= 1: at 0 the power's
  # gradient in r2 (0 ** r2 * log 0) would be NaN.
  far = distance >= 1
  power = jnp.where(far, jnp.exp(jnp.minimum(r2, 2.0) * jnp.log(jnp.where(far, distance, 1.0))),
                    0.0)
  return -r1 * power


def _score(form, s, b, head, q_pos, k_pos, tables):
  """s + the kernel of |i - j| (scheme.Terms.score)."""
  distance = jnp.abs(q_pos - k_pos).astype(jnp.float32)
  return s + kerple_bias(tables['kerple_r1'][head], tables['kerple_r2'][head], distance, form)


def _terms(num_heads, *, kerple_form):
  del num_heads  # the parameters carry the heads
  return scheme.Terms(score=functools.partial(_score, kerple_form), additive=True)


def _params(num_heads, head_dim, kwargs):
  del head_dim
  r1_top, r2_top = (2.0, 1.0) if kwargs['kerple_form'] == 'log' else (1.0, 2.0)
  uniform = jax.nn.initializers.uniform  # [0, scale)
  return {'kerple_r1': ((num_heads,), uniform(r1_top), ('heads',)),
          'kerple_r2': ((num_heads,), uniform(r2_top), ('heads',))}


@dataclasses.dataclass(frozen=True)
class KerpleOptions:
  """KERPLE's option.

  kerple_form: the kernel of |i - j|: 'log', -r1 log(1 + r2 |i - j|), or
    'power', -r1 |i - j|^r2 (FORMS).
  """
  kerple_form: str = 'log'

  def __post_init__(self):
    registry.check_choice(self, 'kerple_form', FORMS)


registry.register(registry.AttentionVariant(
    name='kerple',
    models=registry.TRANSFORMER_MODELS,
    terms=_terms,
    options=KerpleOptions,
    params=_params,
    doc='learned per-head kernel of |i - j| added to the logits (KERPLE, Chi et al. 2022): '
        'kerple_form log: -r1 log(1 + r2 |i-j|) | power: -r1 |i-j|^r2; use with positions=none'))
