"""Relative position attention of Shaw, Uszkoreit & Vaswani 2018.

Query i (absolute position i + q_offset) and key j are joined by learned
vectors a^K_ij, a^V_ij = table[clip(j - (i + q_offset), -k, k) + k], tables
[2k+1, d] shared across heads (eq. 3-5 of the paper):
  e_ij = (q_i . k_j + q_i . a^K_ij) / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij).

Three forms compute the same numbers (`form=` in attention_kwargs):
  'naive'  gathers the [n, m, d] tables and uses plain einsums;
  'matmul' gathers them and uses the paper's reshape-and-matmul trick (sec. 3.3);
  'banded' never builds [n, m, d]. Queries meet the 2k+1 table rows once
           (qa [b, h, n, 2k+1]); bucket_spread places each query's 2k+1
           numbers on its keys by clipped distance (a band of 2k-1 diagonals
           plus two constant sides, as in Music Transformer's relative
           attention); bucket_sum is its transpose, the weights summed per
           clipped distance, for the values side and for qa's gradient. Each
           is the other's derivative, so no scatter is built. Memory
           O(b h n m) instead of O(n m d).
'auto' picks 'matmul' while the [n, m, d] tables are small and 'banded' after.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import chunked, registry
from flaxformer_lite.attention.dot_product import (dot_product_chunked, masked_logits,
                                                   softmax_weights)

FORMS = ('auto', 'naive', 'matmul', 'banded')
# 'auto' picks 'banded' once a materialised [n, m, d] table would have this many
# elements (n = m = 64 at d = 64): below it the matmul form is the faster,
# above it the banded one (benchmarks/relative_attention.py --lengths 32 64 128
# --variants shaw/matmul shaw/banded).
_AUTO_TABLE_ELEMENTS = 2 ** 18


def relative_positions(q_len: int, k_len: int, max_distance: int, q_offset=0):
  """int32 [q_len, k_len]: clip(j - (i + q_offset), -k, k) + k, in [0, 2k]."""
  i = q_offset + jnp.arange(q_len, dtype=jnp.int32)[:, None]
  j = jnp.arange(k_len, dtype=jnp.int32)[None, :]
  return jnp.clip(j - i, -max_distance, max_distance) + max_distance


def shaw_relative_logits(query, rel_key):
  """q_i . a^K_ij by the paper's trick; unscaled.

  query [b, n, h, d], rel_key [n, m, d] -> [b, h, n, m].
  """
  b, n, h, d = query.shape
  m = rel_key.shape[1]
  q = query.transpose(1, 0, 2, 3).reshape(n, b * h, d)  # [n, b*h, d]
  out = jnp.matmul(q, rel_key.transpose(0, 2, 1))  # [n, b*h, d] @ [n, d, m] -> [n, b*h, m]
  return out.reshape(n, b, h, m).transpose(1, 2, 0, 3)  # [b, h, n, m]


def shaw_relative_values(weights, rel_value):
  """sum_j alpha_ij a^V_ij by the paper's trick.

  weights [b, h, n, m], rel_value [n, m, d] -> [b, n, h, d].
  """
  b, h, n, m = weights.shape
  d = rel_value.shape[-1]
  w = weights.transpose(2, 0, 1, 3).reshape(n, b * h, m)  # [n, b*h, m]
  out = jnp.matmul(w, rel_value)  # [n, b*h, m] @ [n, m, d] -> [n, b*h, d]
  return out.reshape(n, b, h, d).transpose(1, 0, 2, 3)  # [b, n, h, d]


# ---- the banded form ---------------------------------------------------------

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
  xp = np if isinstance(q_offset, int) else jnp
  i = q_offset + xp.arange(n, dtype=np.int32)[:, None]  # [n, 1] absolute query positions
  rows = xp.arange(n, dtype=np.int32)[:, None] * m  # [n, 1] row starts in [n, m]
  offsets = xp.arange(m, dtype=np.int32)[None, :] - i  # [n, m]
  spread = xp.arange(n, dtype=np.int32)[:, None] * (2 * k + 1) + xp.clip(offsets, -k, k) + k
  band = xp.arange(1 - k, k, dtype=np.int32)[None, :] + i  # [n, 2k-1] keys
  last_left = i - k  # [n, 1]
  whole = xp.clip((last_left + 1) // _BLOCK, 0, m // _BLOCK)  # [n, 1] whole blocks in the bucket
  part = whole * _BLOCK + xp.arange(_BLOCK, dtype=np.int32)[None, :]  # [n, B] keys
  nb = -(-m // _BLOCK)
  return {
      'spread': spread.reshape(-1),
      'band': (rows + xp.clip(band, 0, m - 1)).reshape(-1),
      'band_ok': (band >= 0) & (band < m),
      'blocks': (np.arange(m)[:, None] // _BLOCK == np.arange(nb)[None, :]).astype(np.float32),
      'left_blocks': xp.arange(nb, dtype=np.int32)[None, :] < whole,
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
  # materialises the gather beside it; with it, one elementwise pass and a
  # third less temp memory (benchmarks/relative_attention.py).
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


def _banded_attention(query, key, value, rel_key_table, rel_value_table, *, mask, bias,
                      q_offset, dropout_rate, dropout_rng, deterministic, dtype):
  """shaw_attention's banded form on scaled queries: -> (out [b, n, h, d], weights)."""
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


def choose_form(form: str, n: int, m: int, d: int) -> str:
  if form not in FORMS:
    raise ValueError(f'shaw form={form!r}; valid: {", ".join(FORMS)}')
  if form != 'auto':
    return form
  return 'matmul' if n * m * d < _AUTO_TABLE_ELEMENTS else 'banded'


def shaw_attention(query, key, value, rel_key_table=None, rel_value_table=None, *,
                   mask=None, bias=None, q_offset=0, form='auto',
                   dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None,
                   return_weights=False):
  """Self-attention with relative position representations (eq. 3-5).

  Args:
    query [b, n, h, d]; key, value [b, m, h, d]; queries sit at absolute
      positions q_offset + 0..n-1, keys at 0..m-1.
    rel_key_table, rel_value_table: [2k+1, d] or None (the paper's keys-only
      or values-only ablations).
    mask: boolean, broadcastable to [b, h, n, m]; bias: added to the scaled logits.
    form: 'auto' | 'naive' | 'matmul' | 'banded' (module docstring).
  Returns:
    [b, n, h, d]; with return_weights, (that, weights [b, h, n, m]).
  """
  dtype = dtype or query.dtype
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  b, n, h, d = query.shape
  m = key.shape[1]
  tables = [t for t in (rel_key_table, rel_value_table) if t is not None]
  k = (tables[0].shape[0] - 1) // 2 if tables else 0
  form = choose_form(form, n, m, d)
  # (q.k + q.a) / sqrt(d) with the scale applied once to q ([b, n, h, d], not [b, h, n, m]).
  scaled = query / jnp.sqrt(d).astype(dtype)
  if form == 'banded' and tables:
    out, weights = _banded_attention(
        scaled, key, value, rel_key_table, rel_value_table, mask=mask, bias=bias,
        q_offset=q_offset, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic=deterministic, dtype=dtype)
    return (out, weights) if return_weights else out

  idx = relative_positions(n, m, k, q_offset)  # [n, m]
  logits = jnp.einsum('bnhd,bmhd->bhnm', scaled, key, preferred_element_type=jnp.float32)
  if rel_key_table is not None:
    table = rel_key_table.astype(dtype)
    if form == 'matmul':
      logits += shaw_relative_logits(scaled, table[idx]).astype(jnp.float32)
    else:
      logits += jnp.einsum('bnhd,nmd->bhnm', scaled, table[idx],
                           preferred_element_type=jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights = softmax_weights(logits, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic, dtype=dtype)  # [b, h, n, m]

  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value)
  if rel_value_table is not None:
    table = rel_value_table.astype(dtype)
    if form == 'matmul':
      out += shaw_relative_values(weights, table[idx])
    else:
      out += jnp.einsum('bhnm,nmd->bnhd', weights, table[idx])
  return (out, weights) if return_weights else out


# ---- block by block (chunked.attend) -------------------------------------------

def _block_indices(k, q_pos, k_pos):
  """band_indices for one block: its queries sit q_pos[0] - k_pos[0] places
  after its first key."""
  return band_indices(q_pos.shape[0], k_pos.shape[0], k, q_pos[0] - k_pos[0]) if k else None


def _side(k, q_pos, k_pos):
  """0 if every key of the block is at least k before every query (one bucket,
  the far-left one), 2 if at least k after, else 1 (the band crosses it)."""
  before = k_pos[-1] - q_pos[0] <= -k
  after = k_pos[0] - q_pos[-1] >= k
  return jnp.where(before, 0, jnp.where(after, 2, 1))


def _block_logits(k, q, key, params, q_pos, k_pos):
  """(q.k + q.a^K) for one block, q already scaled: the block's queries meet
  the 2k+1 table rows once and bucket_spread places the result by clipped
  distance, as in the banded form; a block wholly beyond distance k meets
  one row (its bucket) and adds one column."""
  s = chunked.dot_logits(q, key, params, q_pos, k_pos)
  table = params.get('rel_key_table')
  if table is None:
    return s

  def meet(rows):  # [r, d] -> [b, h, bq, r]
    return jnp.einsum('bqhd,rd->bhqr', q, rows.astype(q.dtype),
                      preferred_element_type=jnp.float32)

  bk = k_pos.shape[0]
  return jax.lax.switch(_side(k, q_pos, k_pos), [
      lambda s: s + meet(table[:1]),
      lambda s: s + bucket_spread(k, meet(table), _block_indices(k, q_pos, k_pos), bk),
      lambda s: s + meet(table[-1:])], s)


def _block_values(k, p, v, params, q_pos, k_pos):
  """sum_j p_ij (v_j + a^V_ij) for one block: the weights summed per clipped
  distance (bucket_sum) times the table; a block wholly beyond distance k
  has one bucket, its row sum."""
  out = chunked.dot_values(p, v, params, q_pos, k_pos)
  table = params.get('rel_value_table')
  if table is None:
    return out
  table = table.astype(jnp.float32)

  def one_row(p, row):  # [b, h, bq, bk], [d] -> [b, h, bq, d]
    return jnp.sum(p, -1, keepdims=True) * row

  return out + jax.lax.switch(_side(k, q_pos, k_pos), [
      lambda p: one_row(p, table[0]),
      lambda p: jnp.einsum('bhqr,rd->bhqd', bucket_sum(k, p, _block_indices(k, q_pos, k_pos)),
                           table),
      lambda p: one_row(p, table[-1])], p)


def _uniform(k, value, params, q_pos, m):
  """Uniform weights over all m keys: mean_j v_j + (1/m) sum_r count_r(i) a^V_r,
  count_r(i) the keys at clipped distance r - k from query position q_pos[i]."""
  out = chunked.mean_values(value, params, q_pos, m)
  table = params.get('rel_value_table')
  if table is None:
    return out
  p = q_pos[:, None]  # [n, 1]
  if k == 0:
    counts = jnp.full(p.shape, m, jnp.int32)
  else:
    middle = p + jnp.arange(1 - k, k)[None, :]  # the key at each distance -k+1 .. k-1
    counts = jnp.concatenate([jnp.clip(p - k + 1, 0, m), (middle >= 0) & (middle < m),
                              jnp.clip(m - p - k, 0, m)], axis=1)  # [n, 2k+1]
  rel = (counts.astype(jnp.float32) / m) @ table.astype(jnp.float32)  # [n, d]
  return out + rel[None, :, None, :]


def shaw_chunked(query, key, value, rel_key_table=None, rel_value_table=None, *,
                 mask=None, q_offset=0, chunk_size=None, dtype=None):
  """shaw_attention block by block (chunked.attend), keys and values terms
  both: per block, q meets the 2k+1 key-table rows and the weights are summed
  per clipped distance, so no [n, m] or [n, m, d] array exists; both tables'
  gradients are summed over the blocks."""
  tables = {name: t for name, t in (('rel_key_table', rel_key_table),
                                    ('rel_value_table', rel_value_table)) if t is not None}
  k = (next(iter(tables.values())).shape[0] - 1) // 2
  terms = chunked.BlockTerms(logits=functools.partial(_block_logits, k),
                             values=functools.partial(_block_values, k),
                             uniform=functools.partial(_uniform, k))
  return dot_product_chunked(query, key, value, terms, tables, mask=mask, q_offset=q_offset,
                             chunk_size=chunk_size, dtype=dtype)


def _shaw_params(num_heads, head_dim, kwargs):
  del num_heads  # the tables are shared across heads, as in the paper
  shape = (2 * kwargs['max_distance'] + 1, head_dim)
  init = jax.nn.initializers.normal(stddev=head_dim ** -0.5)  # as tensor2tensor
  names = [n for n, on in (('rel_key_table', kwargs['relative_keys']),
                           ('rel_value_table', kwargs['relative_values'])) if on]
  return {name: (shape, init, ('relative', 'kv')) for name in names}


def _validate_shaw(kwargs):
  if kwargs['max_distance'] < 0:
    raise ValueError(f"attention_kwargs.max_distance={kwargs['max_distance']} must be >= 0 "
                     '(the clipping distance k; the paper uses 2..64)')
  if not (kwargs['relative_keys'] or kwargs['relative_values']):
    raise ValueError('attention_kwargs.relative_keys and relative_values are both False; '
                     'use attention=dot_product for no relative positions')
  if kwargs['form'] not in FORMS:
    raise ValueError(f"attention_kwargs.form={kwargs['form']!r}; valid: {', '.join(FORMS)}")


def _shaw(query, key, value, *, max_distance, relative_keys, relative_values, **rest):
  del max_distance, relative_keys, relative_values  # carried by the tables' presence and shape
  return shaw_attention(query, key, value, **rest)


def _shaw_chunked(query, key, value, *, max_distance, relative_keys, relative_values, form,
                  **rest):
  del max_distance, relative_keys, relative_values, form  # form: the dense path's choice
  return shaw_chunked(query, key, value, **rest)


registry.register(registry.AttentionVariant(
    name='shaw',
    models=registry.TRANSFORMER_MODELS,
    fn=_shaw,
    chunked=_shaw_chunked,
    kwargs={'max_distance': 16, 'relative_keys': True, 'relative_values': True,
            'form': 'auto'},
    params=_shaw_params,
    validate=_validate_shaw,
    uses_positions=True,
    doc='Shaw et al. 2018 relative positions (tables [2k+1, d] for keys and values); '
        "form: naive | matmul (the paper's trick) | banded (no [n, m, d] table)"))
