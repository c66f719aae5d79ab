"""Relative position attention of Shaw, Uszkoreit & Vaswani 2018.

Query i (absolute position i + q_offset) and key j are joined by learned
vectors a^K_ij, a^V_ij = table[clip(j - (i + q_offset), -k, k) + k], tables
[2k+1, d] shared across heads (eq. 3-5 of the paper):
  e_ij = (q_i . k_j + q_i . a^K_ij) / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij).

Three forms compute the same numbers (`form=` in attention_kwargs):
  'naive'  gathers the [n, m, d] tables and uses plain einsums;
  'matmul' gathers them and uses the paper's reshape-and-matmul trick (sec. 3.3);
  'banded' never builds [n, m, d]: queries meet the 2k+1 table once
           ([b, h, n, 2k+1]) and each result is spread over the keys at its
           clipped distance (a band of 2k-1 diagonals plus two constant
           sides, as in Music Transformer's relative attention); the values
           side sums each query's weights per clipped distance. The two
           operations are each other's transpose, which gives the gradients
           without scatters. Memory O(b h n m) instead of O(n m d).
'auto' picks 'matmul' while the [n, m, d] tables are small and 'banded' after.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.dot_product import softmax_weights

FORMS = ('auto', 'naive', 'matmul', 'banded')
# 'auto' switches to 'banded' when a materialised [n, m, d] table would exceed
# this: on CPU the two forms tie at n = m = 64, d = 64 inside MultiHeadAttention
# and banded wins from there on (benchmarks/relative_attention.py).
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


def _offsets(n: int, m: int, q_offset):
  """int32 [n, m]: j - (i + q_offset), the unclipped distance."""
  return (jnp.arange(m, dtype=jnp.int32)[None, :]
          - (q_offset + jnp.arange(n, dtype=jnp.int32)[:, None]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bucket_spread(k, x, offsets):
  """x [b, h, n, 2k+1] -> [b, h, n, m]: out[i, j] = x[i, clip(offsets[i, j], -k, k) + k].

  Linear in x; its transpose is bucket_sum (the custom VJP), so no scatter
  is ever built.
  """
  idx = jnp.clip(offsets, -k, k) + k  # [n, m], in [0, 2k] by construction
  rows = jnp.arange(idx.shape[0])[:, None]  # [n, 1]
  # Indexing (not take_along_axis) keeps the gather's indices [n, m]: shared
  # by every batch and head instead of built per element.
  return x.at[:, :, rows, idx].get(mode='promise_in_bounds')


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bucket_sum(k, y, offsets):
  """y [b, h, n, m] -> [b, h, n, 2k+1]: out[i, r] = sum of y[i, j] over the j
  whose clipped distance clip(offsets[i, j], -k, k) + k is r.

  Each middle bucket holds one key, j = i + q_offset + r - k, read by a
  small gather; bucket 0 (all keys at or left of distance -k) is one masked
  row sum, and bucket 2k is what remains of the row total. (One masked sum
  instead of two: each costs a pass over [b, h, n, m].)
  """
  if k == 0:
    return jnp.sum(y, -1, keepdims=True)
  n, m = offsets.shape
  left = jnp.sum(jnp.where(offsets <= -k, y, 0), -1, keepdims=True)  # [b, h, n, 1]
  # offsets[i, 0] = -(i + q_offset): key j = r - k - offsets[i, 0] is at distance r - k.
  j = jnp.arange(1 - k, k, dtype=jnp.int32)[None, :] - offsets[:, :1]  # [n, 2k-1]
  valid = (j >= 0) & (j < m)
  rows = jnp.arange(n)[:, None]  # [n, 1]
  band = jnp.where(valid, y.at[:, :, rows, jnp.clip(j, 0, m - 1)].get(mode='promise_in_bounds'), 0)
  right = jnp.sum(y, -1, keepdims=True) - left - jnp.sum(band, -1, keepdims=True)
  return jnp.concatenate([left, band, right], -1)


def _spread_fwd(k, x, offsets):
  return bucket_spread(k, x, offsets), offsets


def _spread_bwd(k, offsets, g):
  return bucket_sum(k, g, offsets), None


def _sum_fwd(k, y, offsets):
  return bucket_sum(k, y, offsets), offsets


def _sum_bwd(k, offsets, g):
  return bucket_spread(k, g, offsets), None


bucket_spread.defvjp(_spread_fwd, _spread_bwd)
bucket_sum.defvjp(_sum_fwd, _sum_bwd)


def banded_relative_logits(query, table, k_len: int, q_offset=0):
  """q_i . table[clip(j - i - q_offset) + k] without building [n, m, d].

  query [b, n, h, d], table [2k+1, d] -> [b, h, n, m]; unscaled.
  """
  k = (table.shape[0] - 1) // 2
  qa = jnp.einsum('bnhd,rd->bhnr', query, table,
                  preferred_element_type=jnp.float32)  # [b, h, n, 2k+1]
  return bucket_spread(k, qa, _offsets(query.shape[1], k_len, q_offset))


def banded_relative_values(weights, table, q_offset=0):
  """sum_j alpha_ij table[clip(j - i - q_offset) + k] without building [n, m, d].

  weights [b, h, n, m], table [2k+1, d] -> [b, n, h, d].
  """
  n, m = weights.shape[-2:]
  k = (table.shape[0] - 1) // 2
  per_bucket = bucket_sum(k, weights.astype(jnp.float32), _offsets(n, m, q_offset))
  return jnp.einsum('bhnr,rd->bnhd', per_bucket.astype(table.dtype), table)  # [b, n, h, d]


def choose_form(form: str, n: int, m: int, d: int) -> str:
  if form not in FORMS:
    raise ValueError(f'shaw form={form!r}; valid: {", ".join(FORMS)}')
  if form != 'auto':
    return form
  return 'matmul' if n * m * d <= _AUTO_TABLE_ELEMENTS else 'banded'


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
  if form != 'banded' and tables:
    idx = relative_positions(n, m, k, q_offset)  # [n, m]

  # (q.k + q.a) / sqrt(d) with the scale applied once to q ([b, n, h, d], not [b, h, n, m]).
  scaled = query / jnp.sqrt(d).astype(dtype)
  logits = jnp.einsum('bnhd,bmhd->bhnm', scaled, key, preferred_element_type=jnp.float32)
  if rel_key_table is not None:
    table = rel_key_table.astype(dtype)
    if form == 'banded':
      logits += banded_relative_logits(scaled, table, m, q_offset)
    elif form == 'matmul':
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
    if form == 'banded':
      out += banded_relative_values(weights, table, q_offset).astype(dtype)
    elif form == 'matmul':
      out += shaw_relative_values(weights, table[idx])
    else:
      out += jnp.einsum('bhnm,nmd->bnhd', weights, table[idx])
  return (out, weights) if return_weights else out


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
    models=registry.TRANSFORMER_MODELS,
    fn=_shaw,
    kwargs={'max_distance': 16, 'relative_keys': True, 'relative_values': True,
            'form': 'auto'},
    params=_shaw_params,
    validate=_validate_shaw,
    uses_positions=True,
    doc='Shaw et al. 2018 relative positions (tables [2k+1, d] for keys and values); '
        "form: naive | matmul (the paper's trick) | banded (no [n, m, d] table)"))
