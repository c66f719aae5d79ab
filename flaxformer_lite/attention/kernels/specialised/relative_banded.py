"""Shaw et al. 2018's relative attention without [n, m, d] tables: the banded form.

Queries meet the 2k+1 table rows once (qa [b, h, n, 2k+1]); bucket_spread
places each query's 2k+1 numbers on its keys by clipped distance (a band of
2k-1 diagonals plus two constant sides, as in Music Transformer's relative
attention); bucket_sum is its transpose, the weights summed per clipped
distance, for the values side and for qa's gradient. Each is the other's
derivative, so no scatter is built. Memory O(b h n m) instead of O(n m d).
The formula and its dense form are in schemes/shaw.py; this is the kernel
`shaw_banded` (kernels/table.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention.softmax import masked_logits, softmax_weights

# bucket_sum's far-left bucket is summed per block of this many keys (a small
# matmul, [b*h*n, m] @ [m, m/B]) plus one partial block read by a gather: a
# masked row sum would cost a full select pass over [b, h, n, m].
_BLOCK = 32


def band_indices(n: int, m: int, k: int, q_offset=0) -> dict:
  """Index arrays for bucket_spread / bucket_sum: n queries at absolute
  positions q_offset + 0..n-1, m keys, clipping distance k >= 1.

  numpy arrays (constants to XLA) when q_offset is a Python int, jnp arrays
  when it is traced (decoding). Flat indices address [n, 2k+1] or [n, m]
  row-major; c_i = i + q_offset - k is the last key of query i's far-left
  bucket (clipped distance -k).
    spread [n*m]: into [n, 2k+1], clip(j - i - q_offset, -k, k) + k;
    band [n*(2k-1)], band_ok [n, 2k-1]: into [n, m], the key at distance
        -k+1..k-1 (False where that key is outside 0..m-1);
    blocks [m, nb] float: one-hot of key j's block j // _BLOCK;
    left_blocks [n, nb] bool: blocks wholly at or left of c_i;
    part [n*_BLOCK], part_ok [n, _BLOCK]: into [n, m], the keys <= c_i of
        the block after those.
  """
  # What does not depend on q_offset stays numpy: a jnp constant inside a
  # trace would run (and compile) op by op.
  xp = np if isinstance(q_offset, int) else jnp
  arange = lambda *a: np.arange(*a, dtype=np.int32)  # noqa: E731
  i = q_offset + arange(n)[:, None]  # [n, 1] absolute query positions
  rows = arange(n)[:, None] * m  # [n, 1] row starts in [n, m]
  offsets = arange(m)[None, :] - i  # [n, m]
  spread = arange(n)[:, None] * (2 * k + 1) + xp.clip(offsets, -k, k) + k
  band = arange(1 - k, k)[None, :] + i  # [n, 2k-1] keys
  last_left = i - k  # [n, 1]
  whole = xp.clip((last_left + 1) // _BLOCK, 0, m // _BLOCK)  # [n, 1] whole blocks in the bucket
  part = whole * _BLOCK + arange(_BLOCK)[None, :]  # [n, B] keys
  nb = -(-m // _BLOCK)
  return {
      'spread': spread.reshape(-1),
      'band': (rows + xp.clip(band, 0, m - 1)).reshape(-1),
      'band_ok': (band >= 0) & (band < m),
      'blocks': (np.arange(m)[:, None] // _BLOCK == np.arange(nb)[None, :]).astype(np.float32),
      'left_blocks': arange(nb)[None, :] < whole,
      'part': (rows + xp.clip(part, 0, m - 1)).reshape(-1),
      'part_ok': (part <= last_left) & (part < m),
  }


def _take(y, flat, width):
  """y [b, h, n, c] -> [b, h, n, width]; flat indices into [n, c], row-major."""
  b, h, n, c = y.shape
  return jnp.take(y.reshape(b, h, n * c), flat, axis=-1, mode='clip').reshape(b, h, n, width)


def _spread(k, x, ix, m):
  if k == 0:
    return jnp.broadcast_to(x, x.shape[:3] + (m,))
  return _take(x, ix['spread'], m)


def _bucket_sums(k, y, ix):
  if k == 0:
    return jnp.sum(y.astype(jnp.float32), -1, keepdims=True)
  b, h, n, m = y.shape
  per_block = jnp.matmul(y.reshape(-1, m), ix['blocks'].astype(y.dtype),
                         preferred_element_type=jnp.float32).reshape(b, h, n, -1)
  part = _take(y, ix['part'], _BLOCK).astype(jnp.float32)
  left = (jnp.sum(jnp.where(ix['left_blocks'], per_block, 0), -1, keepdims=True)
          + jnp.sum(jnp.where(ix['part_ok'], part, 0), -1, keepdims=True))
  band = jnp.where(ix['band_ok'], _take(y, ix['band'], 2 * k - 1).astype(jnp.float32), 0)
  right = jnp.sum(per_block, -1, keepdims=True) - left - jnp.sum(band, -1, keepdims=True)
  return jnp.concatenate([left, band, right], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def bucket_spread(k, x, ix, m: int):
  """x [b, h, n, 2k+1] -> [b, h, n, m]: out[i, j] = x[i, clip(j - i - q_offset, -k, k) + k].

  ix: band_indices(n, m, k, q_offset) (None for k = 0). Linear in x; its
  transpose is bucket_sum (the custom VJP), so no scatter is built.
  """
  return _spread(k, x, ix, m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bucket_sum(k, y, ix):
  """y [b, h, n, m] -> float32 [b, h, n, 2k+1]: out[i, r] = the sum of y[i, j]
  over the keys j at clipped distance r - k. ix: band_indices(n, m, k, q_offset).

  Middle buckets hold one key each (a gather); the far-left bucket is whole
  key blocks (a small matmul) plus one partial block (a gather); the
  far-right bucket is what remains of the row total.
  """
  return _bucket_sums(k, y, ix)


def _spread_fwd(k, x, ix, m):
  return _spread(k, x, ix, m), (ix, jnp.zeros((0,), x.dtype))


def _spread_bwd(k, m, res, g):
  ix, like = res  # like: x's dtype
  return bucket_sum(k, g, ix).astype(like.dtype), None


def _sum_fwd(k, y, ix):
  return _bucket_sums(k, y, ix), (ix, jnp.zeros((0, y.shape[-1]), y.dtype))


def _sum_bwd(k, res, g):
  ix, like = res  # like: y's dtype and key count
  return bucket_spread(k, g, ix, like.shape[1]).astype(like.dtype), None


bucket_spread.defvjp(_spread_fwd, _spread_bwd)
bucket_sum.defvjp(_sum_fwd, _sum_bwd)


def _relative_softmax_fwd(k, logits, qa, mask, ix):
  z = masked_logits(logits + _spread(k, qa, ix, logits.shape[-1]), mask)
  weights = jnp.exp(z - jnp.max(z, -1, keepdims=True))
  weights = weights / jnp.sum(weights, -1, keepdims=True)
  buckets = _bucket_sums(k, weights, ix)
  # Masked keys get weight exactly 0, hence gradient 0, except in a row with
  # no visible key (uniform weights, constant logits): its gradient is zeroed
  # per row, cheaper than a select over [b, h, n, m].
  visible = None if mask is None else jnp.any(mask, -1, keepdims=True).astype(jnp.float32)
  return (weights, buckets), (weights, buckets, visible, ix)


def _relative_softmax_bwd(k, res, g):
  weights, buckets, visible, ix = res
  g_weights, g_buckets = g
  # softmax: dz = w * (dw - sum_j w_j dw_j) with dw = g_weights +
  # bucket_spread(g_buckets); sum_j w_j spread(g)_j = sum_r buckets_r g_r,
  # so the spread is never summed over [b, h, n, m].
  delta = (jnp.sum(weights * g_weights, -1, keepdims=True)
           + jnp.sum(buckets * g_buckets, -1, keepdims=True))
  if visible is not None:
    weights = weights * visible
  # Without the barrier XLA folds the next line into delta's reduction and
  # materialises the gather beside it; with it, one elementwise pass.
  weights, g_weights, delta = jax.lax.optimization_barrier((weights, g_weights, delta))
  dz = weights * (g_weights + _spread(k, g_buckets, ix, weights.shape[-1]) - delta)
  return dz, _bucket_sums(k, dz, ix), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _relative_softmax(k, logits, qa, mask, ix):
  """The banded form's keys and values sides in one float32 op (no dropout):
  weights = softmax(masked(logits + bucket_spread(qa))), buckets =
  bucket_sum(weights).

  logits [b, h, n, m], qa [b, h, n, 2k+1], mask bool or None -> (weights
  [b, h, n, m], buckets [b, h, n, 2k+1]). The VJP is written out: besides
  the softmax's own reduction the backward pass is one elementwise pass over
  [b, h, n, m] and one bucket_sum.
  """
  return _relative_softmax_fwd(k, logits, qa, mask, ix)[0]


_relative_softmax.defvjp(_relative_softmax_fwd, _relative_softmax_bwd)


def _per_head(table, b, h, dtype):
  """[2k+1, d] -> [b, 2k+1, h, d], a broadcast (no copy). The table products
  then take the same batched-matmul form and operand layouts as q.k and w.v, so
  XLA shares the transposed query and weights with those instead of making
  [b*n*h, d]-shaped copies, one of which would live from the forward pass to
  the end of the backward (benchmarks/relative_attention.py)."""
  return jnp.broadcast_to(table.astype(dtype)[None, :, None, :], (b, table.shape[0], h, table.shape[1]))


def banded_attention(query, key, value, rel_key_table, rel_value_table, *, mask, bias,
                     q_offset, dropout_rate, dropout_rng, deterministic, dtype):
  """shaw_attention (schemes/shaw.py) without [n, m, d] tables: query
  [b, n, h, d] already scaled by 1/sqrt(d), key and value [b, m, h, d],
  tables [2k+1, d] or None, mask a boolean array or None -> (out
  [b, n, h, d], weights [b, h, n, m])."""
  b, n, h, d = query.shape
  m = key.shape[1]
  k = ((rel_key_table if rel_key_table is not None else rel_value_table).shape[0] - 1) // 2
  ix = band_indices(n, m, k, q_offset) if k else None
  logits = jnp.einsum('bnhd,bmhd->bhnm', query, key, preferred_element_type=jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  qa = None
  if rel_key_table is not None:  # q . a^K for the 2k+1 rows: [b, h, n, 2k+1]
    qa = jnp.einsum('bnhd,brhd->bhnr', query, _per_head(rel_key_table, b, h, dtype),
                    preferred_element_type=jnp.float32)
  dropout = not deterministic and dropout_rate > 0.0
  buckets = None
  if qa is not None and rel_value_table is not None and not dropout:
    mask = None if mask is None else mask.astype(bool)
    weights, buckets = _relative_softmax(k, logits, qa, mask, ix)
    weights = weights.astype(dtype)
  else:
    if qa is not None:
      logits = logits + bucket_spread(k, qa, ix, m)
    weights = softmax_weights(logits, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                              deterministic=deterministic, dtype=dtype)
    if rel_value_table is not None:
      buckets = bucket_sum(k, weights, ix)
  # Values into [b, h, n, d], then one transpose: the values matmul's
  # backward is faster on CPU in this layout than with [b, n, h, d] output.
  out = jnp.einsum('bhnm,bmhd->bhnd', weights, value)
  if buckets is not None:
    out += jnp.einsum('bhnr,brhd->bhnd', buckets.astype(dtype),
                      _per_head(rel_value_table, b, h, dtype))
  return out.transpose(0, 2, 1, 3), weights
