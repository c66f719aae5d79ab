"""FIRE: functional interpolation for relative positions (Li et al. 2023, eq. 4-5).

Each layer learns a small MLP f: R -> R^H and adds, for query i and key j,
  b(i, j) = f(psi(i - j) / psi(max(L, i))),  psi(x) = log(c x + 1),
to head h's logits, with c > 0 and the threshold L learned too. Dividing by
psi(i) maps every distance into [0, 1] whatever the sequence length (the
"progressive interpolation"); L keeps short contexts from being stretched.
f has one hidden layer of `fire_width` ReLU units (the paper: 32).
Initialisation: c = 1, L = `fire_threshold_init`; the MLP as a Dense layer's
(lecun normal weights, zero biases). The distance is |i - j|, so that one
bias serves bidirectional attention too (the paper's models are causal).

Written once as block terms (scheme.py). The MLP runs on every (i, j)
pair of a block, TILE_ROWS rows at a time.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry, scheme

TILE_ROWS = 128  # the MLP's rows at a time in a block of more (fire_bias)


def fire_bias(params, q_pos, k_pos):
  """params {fire_c [], fire_threshold [], fire_w1 [w], fire_b1 [w],
  fire_w2 [w, h], fire_b2 [h]}, positions [bq], [bk] -> float32 [h, bq, bk]."""
  p = {k: v.astype(jnp.float32) for k, v in params.items()}
  c, threshold = jnp.abs(p['fire_c']), jnp.abs(p['fire_threshold'])
  psi = lambda x: jnp.log1p(c * x)
  i = q_pos.astype(jnp.float32)
  distance = jnp.abs(i[:, None] - k_pos.astype(jnp.float32)[None, :])  # [bq, bk]
  # psi(max(L, i)) >= psi(L) > 0 for L > 0; the floor guards L -> 0.
  x = psi(distance) / jnp.maximum(psi(jnp.maximum(threshold, i)), 1e-6)[:, None]

  def mlp(x):  # [r, bk] -> [h, r, bk]
    hidden = jax.nn.relu(x[..., None] * p['fire_w1'] + p['fire_b1'])  # [r, bk, w]
    return jnp.einsum('qkw,wh->hqk', hidden, p['fire_w2'])

  bq = x.shape[0]
  if bq % TILE_ROWS or bq == TILE_ROWS:
    out = mlp(x)
  else:
    # Row tiles, each recomputed in the backward pass: the hidden units of a
    # whole block ([bq, bk, w]) and their gradient are never held at once.
    tiles = jax.lax.map(jax.checkpoint(mlp), x.reshape(bq // TILE_ROWS, TILE_ROWS, -1))
    out = jnp.moveaxis(tiles, 0, 1).reshape(tiles.shape[1], bq, -1)  # [h, bq, bk]
  return out + p['fire_b2'][:, None, None]


def _score(s, b, head, q_pos, k_pos, tables):
  """s + the MLP of the normalised log distance, head h's output
  (scheme.Terms.score; per-head tables from _per_head)."""
  t = {name: tables[f'{name}_rows'][head] for name in FIRE_PARAMS}
  c, threshold = jnp.abs(t['fire_c']), jnp.abs(t['fire_threshold'])
  i = q_pos.astype(jnp.float32)
  distance = jnp.abs(i - k_pos.astype(jnp.float32))
  x = jnp.log1p(c * distance) / jnp.maximum(jnp.log1p(c * jnp.maximum(threshold, i)), 1e-6)
  hidden = jax.nn.relu(x[..., None] * t['fire_w1'] + t['fire_b1'])  # [.., w]
  return s + jnp.sum(hidden * t['fire_w2'], -1) + t['fire_b2']


def _block_score(s, block):
  """_score for a whole block, the MLP a row tile at a time (block_score)."""
  rows = block.tables
  params = {name: rows[f'{name}_rows'][0] for name in FIRE_PARAMS[:4]}
  params.update(fire_w2=rows['fire_w2_rows'].T, fire_b2=rows['fire_b2_rows'])
  return block.add(s, fire_bias(params, block.q_pos, block.k_pos))


FIRE_PARAMS = ('fire_c', 'fire_threshold', 'fire_w1', 'fire_b1', 'fire_w2', 'fire_b2')


def _per_head(num_heads, params, q_pos, k_pos):
  """The parameters as rows per head ('<name>_rows' [h, ...]), what a
  fused kernel reads: fire_w2 [w, h] transposed, the shared ones repeated."""
  del q_pos, k_pos
  rows = {'fire_w2_rows': params['fire_w2'].T, 'fire_b2_rows': params['fire_b2']}
  for name in ('fire_c', 'fire_threshold', 'fire_w1', 'fire_b1'):
    x = params[name]
    rows[f'{name}_rows'] = jnp.broadcast_to(x, (num_heads,) + x.shape)
  return rows


def _terms(num_heads, *, fire_width, fire_threshold_init):
  del fire_width, fire_threshold_init  # carried by the parameters
  return scheme.Terms(score=_score, block_score=_block_score,
                            prepare=functools.partial(_per_head, num_heads))


def _params(num_heads, head_dim, kwargs):
  del head_dim
  w, threshold = kwargs['fire_width'], float(kwargs['fire_threshold_init'])
  init = jax.nn.initializers
  return {'fire_c': ((), init.constant(1.0), ()),
          'fire_threshold': ((), init.constant(threshold), ()),
          'fire_w1': ((w,), init.normal(1.0), (None,)),  # lecun normal for one input
          'fire_b1': ((w,), init.zeros, (None,)),
          'fire_w2': ((w, num_heads), init.lecun_normal(), (None, 'heads')),
          'fire_b2': ((num_heads,), init.zeros, ('heads',))}


@dataclasses.dataclass(frozen=True)
class FireOptions:
  """FIRE's options.

  fire_width: the hidden ReLU units of the MLP f (the paper: 32); >= 1.
  fire_threshold_init: the threshold L's initial value, a number > 0.
  """
  fire_width: int = 32
  fire_threshold_init: float = 512.0

  def __post_init__(self):
    registry.check_int(self, 'fire_width', 1, "the MLP's hidden units")
    registry.check_positive(self, 'fire_threshold_init')


registry.register(registry.AttentionVariant(
    name='fire',
    models=registry.TRANSFORMER_MODELS,
    terms=_terms,
    options=FireOptions,
    params=_params,
    doc='learned per-layer MLP of the log distance normalised by the log query position '
        '(FIRE, Li et al. 2023): f(psi(|i-j|) / psi(max(L, i))), psi(x) = log(cx + 1), '
        'c and L learned; use with positions=none'))
