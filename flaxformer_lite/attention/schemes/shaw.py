"""Relative position attention of Shaw, Uszkoreit & Vaswani 2018.

Query i (absolute position i + q_offset) and key j are joined by learned
vectors a^K_ij, a^V_ij = table[clip(j - (i + q_offset), -k, k) + k], tables
[2k+1, d] shared across heads (eq. 3-5 of the paper):
  e_ij = (q_i . k_j + q_i . a^K_ij) / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij).

Here: the formula by the paper's reshape-and-matmul trick (sec. 3.3) over
gathered [n, m, d] tables (the dense kernel), and its terms (scheme.py) for
the blockwise kernel. Two kernels of its own give the same numbers
(kernels/specialised/): `shaw_banded` never builds [n, m, d] (queries meet
the 2k+1 table rows once, spread onto the keys by clipped distance: memory
O(b h n m)), and `shaw_by_lag` splits causal self-attention by lag (the k
nearest keys as a band, the rest as plain attention with one table row:
O(n k) beyond the plain kernel). select.py picks among them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels import product
from flaxformer_lite.attention.kernels.specialised.relative_banded import (band_indices,
                                                                           bucket_spread,
                                                                           bucket_sum)
from flaxformer_lite.attention.softmax import softmax_weights


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


def shaw_attention(query, key, value, rel_key_table=None, rel_value_table=None, *,
                   mask=None, bias=None, q_offset=0, positions=None,
                   dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None,
                   return_weights=False):
  """Self-attention with relative position representations (eq. 3-5).

  Args:
    query [b, n, h, d]; key, value [b, m, h, d]; queries sit at absolute
      positions q_offset + 0..n-1, keys at 0..m-1.
    rel_key_table, rel_value_table: [2k+1, d] or None (the paper's keys-only
      or values-only ablations).
    mask: boolean, broadcastable to [b, h, n, m]; bias: added to the scaled logits.
    positions: None, or int [n] (n = m): query and key i at positions[i].
  Returns:
    [b, n, h, d]; with return_weights, (that, weights [b, h, n, m]).
  """
  dtype = dtype or query.dtype
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  b, n, h, d = query.shape
  m = key.shape[1]
  tables = [t for t in (rel_key_table, rel_value_table) if t is not None]
  k = (tables[0].shape[0] - 1) // 2 if tables else 0
  # (q.k + q.a) / sqrt(d) with the scale applied once to q ([b, n, h, d], not [b, h, n, m]).
  scaled = query / jnp.sqrt(d).astype(dtype)
  if positions is None:
    idx = relative_positions(n, m, k, q_offset)  # [n, m]
  else:
    p = jnp.asarray(positions, jnp.int32)
    idx = jnp.clip(p[None, :] - p[:, None], -k, k) + k
  logits = jnp.einsum('bnhd,bmhd->bhnm', scaled, key, preferred_element_type=jnp.float32)
  if rel_key_table is not None:
    logits += shaw_relative_logits(scaled, rel_key_table.astype(dtype)[idx]).astype(jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights = softmax_weights(logits, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic, dtype=dtype)  # [b, h, n, m]

  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value)
  if rel_value_table is not None:
    out += shaw_relative_values(weights, rel_value_table.astype(dtype)[idx])
  return (out, weights) if return_weights else out


# ---- block by block (blockwise.attend) -------------------------------------------

def _block_indices(k, q_pos, k_pos):
  """band_indices for one block: its queries sit q_pos[0] - k_pos[0] places
  after its first key."""
  return band_indices(q_pos.shape[0], k_pos.shape[0], k, q_pos[0] - k_pos[0]) if k else None


# A block's table terms, split as row 0 (clipped distance -k) for every pair
# plus (row - row 0) for the pairs nearer than k: row 0 rides on the keys and
# values (k_j + a_0 by transform_k, v_j + a^V_0, an add of [b, bk, h, d]), so a
# block wholly beyond distance k on the left, most blocks of causal attention,
# is dot_product's block; a block the band of 2k - 1 diagonals crosses adds the
# difference through bucket_spread / bucket_sum; a sub-diagonal block (the band
# only in its top-right k x k corner) adds it there only; a block wholly beyond
# k on the right adds one row's difference. (A corner is written back with
# dynamic_update_slice: `.at[].add` would put a scatter in the gradient.)
_FAR_LEFT, _BAND, _CORNER, _FAR_RIGHT = range(4)


def _where(k, q_pos, k_pos):
  """Which part of the table a block meets (the constants above)."""
  bq, bk = q_pos.shape[0], k_pos.shape[0]
  lead = q_pos[0] - k_pos[0]  # query 0 is this many places after key 0
  corner = lead >= bk - 1 if _has_corner(k, bq, bk) else False  # band: rows < k, keys >= bk - k
  return jnp.where(lead >= bk - 1 + k, _FAR_LEFT, jnp.where(
      lead <= -(bq - 1) - k, _FAR_RIGHT, jnp.where(corner, _CORNER, _BAND)))


def _has_corner(k, bq, bk):
  return 0 < k <= min(bq, bk)


def _by_part(k, q_pos, k_pos, x, band, corner, far_right):
  """x through the branch of the part the block meets (`_where`; far left:
  x itself). lax.switch traces every branch, so where a block cannot have a
  k x k corner (k = 0, or a block narrower than k) `band` stands in for it."""
  if not _has_corner(k, q_pos.shape[0], k_pos.shape[0]):
    corner = band
  return jax.lax.switch(_where(k, q_pos, k_pos), [lambda x: x, band, corner, far_right], x)


def _with_row0(key, tables, positions, origin):
  """k_j + a^K_0 (Terms.transform_k): row 0 of the table on every key,
  so that the kernel's product is q.(k + a^K_0) (the split above)."""
  del positions, origin
  table = tables.get('rel_key_table')
  return key if table is None else key + table[0].astype(key.dtype)


def _score(k, s, block):
  """q.(k + a^K) for one block from the kernel's q.(k + a^K_0), q already
  scaled (the split above): the band's queries meet the 2k+1 rows'
  differences once and bucket_spread places them by clipped distance, as
  in the banded form."""
  table = block.tables.get('rel_key_table')
  if table is None:
    return s
  q, q_pos, k_pos = block.q, block.q_pos, block.k_pos
  rest = table - table[:1]
  bk = k_pos.shape[0]

  def meet(q, rows):  # [b, r_q, h, d], [r, d] -> [b, h, r_q, r]
    return jnp.einsum('bqhd,rd->bhqr', q, rows.astype(q.dtype),
                      preferred_element_type=jnp.float32)

  def corner(s):
    spread = bucket_spread(k, meet(q[:, :k], rest), _block_indices(k, q_pos[:k], k_pos[-k:]), k)
    return jax.lax.dynamic_update_slice(s, s[:, :, :k, bk - k:] + spread, (0, 0, 0, bk - k))

  def band(s):
    return s + bucket_spread(k, meet(q, rest), _block_indices(k, q_pos, k_pos), bk)

  return _by_part(k, q_pos, k_pos, s, band, corner, lambda s: s + meet(q, rest[-1:]))


def _block_values(k, p, v, tables, q_pos, k_pos):
  """sum_j p_ij (v_j + a^V_ij) for one block (the split above): the band's
  weights summed per clipped distance (bucket_sum) times the rows'
  differences."""
  table = tables.get('rel_value_table')
  if table is None:
    return product.dot_values(p, v, tables, q_pos, k_pos)
  out = product.dot_values(p, v + table[0].astype(v.dtype), tables, q_pos, k_pos)
  rest = (table - table[:1]).astype(jnp.float32)
  bk = k_pos.shape[0]

  def corner(out):
    sums = bucket_sum(k, p[:, :, :k, bk - k:], _block_indices(k, q_pos[:k], k_pos[-k:]))
    return jax.lax.dynamic_update_slice(out, out[:, :, :k] + sums @ rest, (0, 0, 0, 0))

  def band(out):
    return out + bucket_sum(k, p, _block_indices(k, q_pos, k_pos)) @ rest

  return _by_part(k, q_pos, k_pos, out, band, corner,
                  lambda out: out + jnp.sum(p, -1, keepdims=True) * rest[-1])


def _uniform(k, value, tables, q_pos, k_pos):
  """Uniform weights over all m keys: mean_j v_j + (1/m) sum_r count_r(i) a^V_r,
  count_r(i) the keys at clipped distance r - k from query position q_pos[i],
  counted from the sorted key positions k_pos (any, not only 0..m-1)."""
  out = scheme.mean_values(value, tables, q_pos, k_pos)
  table = tables.get('rel_value_table')
  if table is None:
    return out
  m = k_pos.shape[0]
  p = q_pos[:, None]  # [n, 1]
  if k == 0:
    counts = jnp.full(p.shape, m, jnp.int32)
  else:  # keys at or below each position: the counts are differences of them
    below = lambda x: jnp.searchsorted(jnp.sort(k_pos), x, side='right')  # noqa: E731
    at = p + jnp.arange(1 - k, k)[None, :]  # the key position at each distance -k+1 .. k-1
    counts = jnp.concatenate([below(p - k), below(at) - below(at - 1),
                              m - below(p + k - 1)], axis=1)  # [n, 2k+1]
  rel = (counts.astype(jnp.float32) / m) @ table.astype(jnp.float32)  # [n, d]
  return out + rel[None, :, None, :]


def _shaw_params(num_heads, head_dim, kwargs):
  del num_heads  # the tables are shared across heads, as in the paper
  shape = (2 * kwargs['max_distance'] + 1, head_dim)
  init = jax.nn.initializers.normal(stddev=head_dim ** -0.5)  # as tensor2tensor
  names = [n for n, on in (('rel_key_table', kwargs['relative_keys']),
                           ('rel_value_table', kwargs['relative_values'])) if on]
  return {name: (shape, init, ('relative', 'kv')) for name in names}


@dataclasses.dataclass(frozen=True)
class ShawOptions:
  """Shaw et al.'s options.

  max_distance: k, the clipping distance: offsets beyond +-k share the
    tables' end rows (the paper uses 2..64); >= 0.
  relative_keys: learn the keys' table a^K.
  relative_values: learn the values' table a^V; one of the two at least.
  """
  max_distance: int = 16
  relative_keys: bool = True
  relative_values: bool = True

  def __post_init__(self):
    registry.check_int(self, 'max_distance', why='the clipping distance k')
    if self.max_distance < 0:
      raise ValueError(f'attention_kwargs.max_distance={self.max_distance} must be >= 0 '
                       '(the clipping distance k; the paper uses 2..64)')
    registry.check_bool(self, 'relative_keys')
    registry.check_bool(self, 'relative_values')
    if not (self.relative_keys or self.relative_values):
      raise ValueError('attention_kwargs.relative_keys and relative_values are both False; '
                       'use attention=dot_product for no relative positions')


def _shaw(query, key, value, *, max_distance, relative_keys, relative_values, q_offset=0,
          positions=None, **rest):
  del max_distance, relative_keys, relative_values  # carried by the tables' presence and shape
  return shaw_attention(query, key, value, q_offset=q_offset, positions=positions, **rest)


def _clipped(k, q_pos, k_pos):
  """The table row of each pair: clip(j - i, -k, k) + k (a Lookup's index)."""
  return jnp.clip(k_pos - q_pos, -k, k) + k


def _key_rows(q, key, tables):
  """q . (a^K_r - a^K_0) for every query and row r -> float32 [b, h, n, 2k+1]
  (a per-query Lookup: the kernel's product is q . (k + a^K_0), _with_row0),
  the paper's trick as one product against the 2k+1 rows; q already scaled."""
  del key
  table = tables['rel_key_table']
  return jnp.einsum('bnhd,rd->bhnr', q, (table - table[:1]).astype(q.dtype),
                    preferred_element_type=jnp.float32)


def _shaw_terms(num_heads, *, max_distance, relative_keys, relative_values):
  """The block terms (scheme.py): the blockwise kernel's, and the reference
  for every kernel's; the same as lookups for the fused kernel."""
  del num_heads
  k = max_distance
  index = functools.partial(_clipped, k)
  return scheme.Terms(
      block_score=functools.partial(_score, k) if relative_keys else None,
      transform_k=_with_row0,
      values=functools.partial(_block_values, k) if relative_values else None,
      uniform=functools.partial(_uniform, k),
      lookups=(scheme.Lookup('query', _key_rows, index),) if relative_keys else (),
      value_lookup=scheme.ValueLookup('rel_value_table', index) if relative_values else None)


registry.register(registry.AttentionVariant(
    name='shaw',
    models=registry.TRANSFORMER_MODELS,
    fn=_shaw,
    terms=_shaw_terms,
    options=ShawOptions,
    params=_shaw_params,
    doc='Shaw et al. 2018 relative positions (tables [2k+1, d] for keys and values), '
        "the paper's reshape-and-matmul trick"))
