"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", eq. 34).

Queries and keys are rotated by an angle proportional to their position, pair
of features by pair of features, so that q_rot(i) . k_rot(j) depends on the
positions only through j - i.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from flaxformer_lite.attention import chunked, registry
from flaxformer_lite.attention.dot_product import dot_product_attention, dot_product_chunked


def apply_rotary(x, positions, *, max_wavelength=10000.0):
  """Rotates each feature pair (x[2i], x[2i+1]) by positions * theta_i.

  theta_i = max_wavelength^(-2i/d), i = 0 .. d/2-1: the paper's interleaved
  layout (not the "rotate halves" layout of GPT-NeoX and others).

  Args:
    x: [b, n, h, d], d even.
    positions: [n] int (may be traced), the absolute position of each row.
  Returns:
    [b, n, h, d] in x's dtype; angles and rotation in float32.
  """
  b, n, h, d = x.shape
  if d % 2:
    raise ValueError(f'rotary attention needs an even head_dim, got d={d}')
  theta = max_wavelength ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [d/2]
  angle = jnp.asarray(positions, jnp.float32)[:, None] * theta[None, :]  # [n, d/2]
  cos = jnp.cos(angle)[None, :, None, :]  # [1, n, 1, d/2]
  sin = jnp.sin(angle)[None, :, None, :]
  pairs = x.astype(jnp.float32).reshape(b, n, h, d // 2, 2)  # [b, n, h, d/2, 2]
  x0, x1 = pairs[..., 0], pairs[..., 1]  # [b, n, h, d/2] each
  rotated = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  return rotated.reshape(b, n, h, d).astype(x.dtype)  # [b, n, h, d]


def rotary_attention(query, key, value, *, q_offset=0, max_wavelength=10000.0, **common):
  """Dot-product attention over rotated queries and keys; values unrotated.

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i.
    key, value: [b, m, h, d], key j at position j.
    common: dot_product_attention's mask, bias, dropout, dtype and return_weights.
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype).
  """
  query = apply_rotary(query, q_offset + jnp.arange(query.shape[1]),
                       max_wavelength=max_wavelength)
  key = apply_rotary(key, jnp.arange(key.shape[1]), max_wavelength=max_wavelength)
  return dot_product_attention(query, key, value, **common)


def _block_logits(max_wavelength, q, k, params, q_pos, k_pos):
  """q_rot . k_rot for one block, each rotated by its absolute positions."""
  q = apply_rotary(q, q_pos, max_wavelength=max_wavelength)
  k = apply_rotary(k, k_pos, max_wavelength=max_wavelength)
  return chunked.dot_logits(q, k, params, q_pos, k_pos)


def rotary_chunked(query, key, value, *, mask=None, q_offset=0, max_wavelength=10000.0,
                   chunk_size=None, dtype=None, **dropout):
  """rotary_attention block by block. The rotation is applied to each block
  as it is read (O(block * d) beside the block's O(block^2 * d) dot): rotated
  copies of q and k would be two more [b, n, h, d] arrays in the forward
  pass and two more, their gradients, in the backward."""
  terms = chunked.BlockTerms(logits=functools.partial(_block_logits, max_wavelength))
  return dot_product_chunked(query, key, value, terms, mask=mask, q_offset=q_offset,
                             chunk_size=chunk_size, dtype=dtype, **dropout)


def _check_head_dim(head_dim):
  if head_dim % 2:
    raise ValueError(f'rotary rotates pairs of features: the head size {head_dim} must be even')


registry.register(registry.AttentionVariant(
    name='rotary',
    models=registry.TRANSFORMER_MODELS,
    fn=rotary_attention,
    chunked=rotary_chunked,
    kwargs={'max_wavelength': 10000.0},
    validate=registry.positive_number('max_wavelength'),
    check_head_dim=_check_head_dim,
    uses_positions=True,
    doc='rotate q and k feature pairs by position-proportional angles (RoPE, '
        'Su et al. 2021); head_dim must be even'))
