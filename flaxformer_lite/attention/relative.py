"""Relative position attention of Shaw, Uszkoreit & Vaswani 2018.

Query i (absolute position i + q_offset) and key j are joined by learned
vectors a^K_ij, a^V_ij = table[clip(j - (i + q_offset), -k, k) + k], tables
[2k+1, d] shared across heads (eq. 3-5 of the paper):
  e_ij = (q_i . k_j + q_i . a^K_ij) / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij).

Three forms compute the same numbers (`form=` in attention_kwargs):
  'naive'  gathers the [n, m, d] tables and uses plain einsums;
  'matmul' gathers them and uses the paper's reshape-and-matmul trick (sec. 3.3);
  'skew'   never builds [n, m, d]: queries meet the 2k+1 table once
           ([b, h, n, 2k+1]) and the results are moved onto the diagonals by
           the pad-and-reshape skew of Music Transformer (Huang et al. 2018);
           the values side un-skews the weights and sums them per clipped
           distance. Memory O(b h n m) instead of O(n m d); slices, pads and
           reshapes only, no gather or scatter (except when decoding).
'auto' picks 'matmul' while the [n, m, d] tables are small and 'skew' after.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.dot_product import softmax_weights

FORMS = ('auto', 'naive', 'matmul', 'skew')
# 'auto' switches to 'skew' when a materialised [n, m, d] table would exceed this.
_AUTO_TABLE_ELEMENTS = 2 ** 21


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


def _skew(x, m):
  """x [..., n, W] with W = n + m - 1, column s = offset j - i + (n - 1)
  -> [..., n, m] with out[i, j] = x[i, j - i + n - 1]."""
  *lead, n, w = x.shape
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (0, 1)])  # [..., n, W+1]
  x = x.reshape(*lead, n * (w + 1))[..., n - 1:n - 1 + n * w]  # row i starts i*(W+1)-i later
  return x.reshape(*lead, n, w)[..., :m]


def _unskew(x):
  """The inverse of _skew: x [..., n, m] -> [..., n, W], W = n + m - 1, with
  out[i, j - i + n - 1] = x[i, j] and zeros elsewhere."""
  *lead, n, m = x.shape
  pad = [(0, 0)] * len(lead)
  x = jnp.pad(x, pad + [(0, 0), (n, 0)])  # [..., n, m + n], n zeros first
  x = jnp.pad(x.reshape(*lead, n * (m + n)), pad + [(0, n)])  # row i read i + 1 later:
  return x.reshape(*lead, n, m + n + 1)[..., 1:m + n]  # out[i, s] = x[i, s + i + 1 - n]


def _bucket_runs(n: int, m: int, k: int, q_offset: int):
  """Columns s of the offset layout (offset o = s - (n-1) - q_offset) by
  bucket clip(o, -k, k) + k: (left, r_lo, r_hi, right) = the first `left`
  columns are bucket 0, the next r_hi - r_lo are buckets r_lo..r_hi-1, the
  last `right` are bucket 2k. Static ints; k >= 1."""
  w = n + m - 1
  left = min(max(n - 1 + q_offset - k + 1, 0), w)
  right = min(max(w - (n - 1 + q_offset + k), 0), w - left)
  r_lo = left - (n - 1) - q_offset + k
  return left, r_lo, r_lo + w - left - right, right


def skew_relative_logits(query, table, k_len: int, q_offset=0):
  """q_i . table[clip(j - i - q_offset) + k] without building [n, m, d].

  query [b, n, h, d], table [2k+1, d] -> [b, h, n, m]; unscaled.
  Queries meet the table once ([b, h, n, 2k+1]); each row is laid out by
  offset (column s = j - i + n - 1, the clipped ends repeated) and skewed
  onto the diagonals.
  """
  n = query.shape[1]
  k = (table.shape[0] - 1) // 2
  qa = jnp.einsum('bnhd,rd->bhnr', query, table,
                  preferred_element_type=jnp.float32)  # [b, h, n, 2k+1]
  offsets = jnp.arange(-(n - 1), k_len, dtype=jnp.int32) - q_offset  # [n + m - 1]
  x = jnp.take(qa, jnp.clip(offsets, -k, k) + k, axis=-1)  # [b, h, n, n + m - 1]
  return _skew(x, k_len)


def skew_relative_values(weights, table, q_offset=0):
  """sum_j alpha_ij table[clip(j - i - q_offset) + k] without building [n, m, d].

  The weights are laid out by offset (the inverse skew), so each query's
  weight per clipped distance is a slice or a sum of a slice.
  weights [b, h, n, m], table [2k+1, d] -> [b, n, h, d].
  """
  b, h, n, m = weights.shape
  k = (table.shape[0] - 1) // 2
  weights = weights.astype(jnp.float32)
  if not isinstance(q_offset, int):
    return _gather_relative_values(weights, table, q_offset)
  if k == 0:
    per_bucket = jnp.sum(weights, -1, keepdims=True)  # [b, h, n, 1]
  else:
    left, r_lo, r_hi, right = _bucket_runs(n, m, k, q_offset)
    x = _unskew(weights)  # [b, h, n, W]
    w = x.shape[-1]
    band = jnp.pad(x[..., left:w - right], [(0, 0)] * 3 + [(r_lo - 1, 2 * k - r_hi)])
    per_bucket = jnp.concatenate([jnp.sum(x[..., :left], -1, keepdims=True), band,
                                  jnp.sum(x[..., w - right:], -1, keepdims=True)], -1)
  return jnp.einsum('bhnr,rd->bnhd', per_bucket.astype(table.dtype), table)  # [b, n, h, d]


def _gather_relative_values(weights, table, q_offset):
  """skew_relative_values for a traced q_offset: the keys of query i that
  share a bucket form one interval of j, so their weight is a difference of
  a cumulative sum. weights [b, h, n, m] float32 -> [b, n, h, d]."""
  n, m = weights.shape[-2:]
  k = (table.shape[0] - 1) // 2
  cum = jnp.pad(jnp.cumsum(weights, axis=-1), [(0, 0)] * 3 + [(1, 0)])  # [b, h, n, m+1]
  i = q_offset + jnp.arange(n, dtype=jnp.int32)[:, None]  # [n, 1] absolute query position
  r = jnp.arange(2 * k + 1, dtype=jnp.int32)[None, :]  # [1, 2k+1]
  lo = jnp.clip(jnp.where(r == 0, 0, i + r - k), 0, m)  # first key in bucket r
  hi = jnp.clip(jnp.where(r == 2 * k, m - 1, i + r - k), -1, m - 1)  # last key in bucket r
  take = lambda idx: jnp.take_along_axis(cum, jnp.broadcast_to(idx, cum.shape[:2] + idx.shape), -1)
  per_bucket = jnp.maximum(take(hi + 1) - take(lo), 0.0)  # [b, h, n, 2k+1]
  return jnp.einsum('bhnr,rd->bnhd', per_bucket.astype(table.dtype), table)


def choose_form(form: str, n: int, m: int, d: int) -> str:
  if form not in FORMS:
    raise ValueError(f'shaw form={form!r}; valid: {", ".join(FORMS)}')
  if form != 'auto':
    return form
  return 'matmul' if n * m * d <= _AUTO_TABLE_ELEMENTS else 'skew'


def shaw_attention(query, key, value, rel_key_table=None, rel_value_table=None, *,
                   mask=None, bias=None, q_offset=0, form='auto',
                   dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None):
  """Self-attention with relative position representations (eq. 3-5).

  Args:
    query [b, n, h, d]; key, value [b, m, h, d]; queries sit at absolute
      positions q_offset + 0..n-1, keys at 0..m-1.
    rel_key_table, rel_value_table: [2k+1, d] or None (the paper's keys-only
      or values-only ablations).
    mask: boolean, broadcastable to [b, h, n, m]; bias: added to the scaled logits.
    form: 'auto' | 'naive' | 'matmul' | 'skew' (module docstring).
  Returns:
    [b, n, h, d].
  """
  dtype = dtype or query.dtype
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  b, n, h, d = query.shape
  m = key.shape[1]
  tables = [t for t in (rel_key_table, rel_value_table) if t is not None]
  k = (tables[0].shape[0] - 1) // 2 if tables else 0
  form = choose_form(form, n, m, d)
  if form != 'skew' and tables:
    idx = relative_positions(n, m, k, q_offset)  # [n, m]

  logits = jnp.einsum('bnhd,bmhd->bhnm', query, key, preferred_element_type=jnp.float32)
  if rel_key_table is not None:
    table = rel_key_table.astype(dtype)
    if form == 'skew':
      logits += skew_relative_logits(query, table, m, q_offset)
    elif form == 'matmul':
      logits += shaw_relative_logits(query, table[idx]).astype(jnp.float32)
    else:
      logits += jnp.einsum('bnhd,nmd->bhnm', query, table[idx],
                           preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(d).astype(jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights = softmax_weights(logits, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic, dtype=dtype)  # [b, h, n, m]

  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value)
  if rel_value_table is not None:
    table = rel_value_table.astype(dtype)
    if form == 'skew':
      out += skew_relative_values(weights, table, q_offset).astype(dtype)
    elif form == 'matmul':
      out += shaw_relative_values(weights, table[idx])
    else:
      out += jnp.einsum('bhnm,nmd->bnhd', weights, table[idx])
  return out


def _shaw_params(num_heads, head_dim, kwargs):
  del num_heads  # the tables are shared across heads, as in the paper
  shape = (2 * kwargs['max_distance'] + 1, head_dim)
  init = jax.nn.initializers.normal(stddev=head_dim ** -0.5)  # as tensor2tensor
  names = [n for n, on in (('rel_key_table', kwargs['relative_keys']),
                           ('rel_value_table', kwargs['relative_values'])) if on]
  return {name: (shape, init) for name in names}


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


registry.register(registry.AttentionVariant(
    name='shaw',
    fn=_shaw,
    kwargs={'max_distance': 16, 'relative_keys': True, 'relative_values': True,
            'form': 'auto'},
    params=_shaw_params,
    validate=_validate_shaw,
    uses_positions=True,
    doc='Shaw et al. 2018 relative positions (tables [2k+1, d] for keys and values); '
        "form: naive | matmul (the paper's trick) | skew (no [n, m, d] table)"))
