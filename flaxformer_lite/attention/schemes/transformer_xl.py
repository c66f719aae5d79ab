"""Transformer-XL relative attention (Dai et al. 2019, section 3.3).

For query i at absolute position p_i = q_offset + i and key j, per head:

  A_ij = ((q_i + u) . k_j + (q_i + v) . W_R R_{p_i - j}) / sqrt(d)

the paper's terms (a) + (c) (content, with the global content bias u) and
(b) + (d) (position, with the global position bias v). R_t is the sinusoid
of the distance t, sin and cos halves concatenated as in the paper's code,
of width h*d; W_R [h*d, h, d] projects it onto each head. u and v are [h, d]
(shared by all positions; per layer, as in the paper's PyTorch code when
its biases are untied). Used without absolute positions
(`model.positions=none`) this is the paper's model; nothing here stops
adding them.

The position term is computed once for each of the n + m - 1 distances that
occur ([b, h, n, n + m - 1]) and moved to its keys by `scheme.rel_shift`
(the paper's pad-reshape-slice trick), not gathered. The block terms do the
same per block (`_score`), from one W_R R table for every distance of the
call (`_prepare`).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels.reference import dot_product_attention


def sinusoid(distances, width: int):
  """distances [L] -> float32 [L, width]: [sin(t w_k), cos(t w_k)] with
  w_k = 10000^(-2k / width), k = 0..width/2 - 1 (Vaswani et al. 2017)."""
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, width, 2, dtype=np.float32) / width))
  angles = jnp.asarray(distances, jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1)


def projected_positions(position_kernel, distances):
  """W_R R_t for each distance: position_kernel [h*d, h, d], distances [L]
  -> float32 [L, h, d]."""
  r = sinusoid(distances, position_kernel.shape[0])
  return jnp.einsum('lf,fhd->lhd', r, position_kernel.astype(jnp.float32))


def transformer_xl_attention(query, key, value, position_kernel, content_bias, position_bias,
                             *, mask=None, bias=None, q_offset=0, positions=None,
                             dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None,
                             return_weights=False):
  """Transformer-XL relative attention (module docstring).

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i.
    key, value: [b, m, h, d], key j at position j.
    position_kernel: W_R [h*d, h, d]; content_bias u, position_bias v: [h, d].
    positions: None, or int [n] (n = m): query and key i at positions[i]; the
      position term then takes W_R R_t for each pair ([n, m, h, d]).
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype).
  """
  n, d = query.shape[1], query.shape[-1]
  m = key.shape[1]
  cdt = dtype or query.dtype
  qv = (query + position_bias.astype(query.dtype)).astype(cdt) / jnp.sqrt(d).astype(cdt)
  if positions is None:
    # Column c: key-minus-query offset c - (n - 1), distance p_i - j = q_offset + n - 1 - c.
    r = projected_positions(position_kernel, q_offset + n - 1 - jnp.arange(n + m - 1))
    position = jnp.einsum('bnhd,lhd->bhnl', qv, r.astype(cdt),
                          preferred_element_type=jnp.float32)  # [b, h, n, n + m - 1]
    position = scheme.rel_shift(position)  # [b, h, n, m]
  else:
    p = jnp.asarray(positions)
    r = projected_positions(position_kernel, (p[:, None] - p[None, :]).reshape(-1))
    position = jnp.einsum('bnhd,nmhd->bhnm', qv, r.reshape(n, m, *r.shape[1:]).astype(cdt),
                          preferred_element_type=jnp.float32)
  if bias is not None:
    position = position + bias.astype(jnp.float32)
  return dot_product_attention(
      query + content_bias.astype(query.dtype), key, value, mask=mask, bias=position,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, deterministic=deterministic,
      dtype=dtype, return_weights=return_weights)


def _prepare(params, q_pos, k_pos):
  """The call's tables (Terms.prepare): W_R R for every distance its
  blocks meet, and u and v scaled by 1/sqrt(d) as the kernel scales q. The
  gradients of W_R, u and v flow through them and the blocks."""
  top, distances = scheme.distance_range(q_pos, k_pos)
  scale = 1.0 / np.sqrt(params['content_bias'].shape[-1])
  return {'r': projected_positions(params['position_kernel'], distances),
          'u': params['content_bias'].astype(jnp.float32) * scale,
          'v': params['position_bias'].astype(jnp.float32) * scale, 'top': top}


def _score(s, block):
  """q.k + u.k + (q + v).W_R R for one block, q, u and v scaled: the
  block's bq + bk - 1 rows of W_R R, moved to their keys by rel_shift."""
  q, k, tables = block.q, block.k, block.tables
  content = jnp.einsum('hd,bkhd->bhk', tables['u'], k.astype(jnp.float32))  # [b, h, bk]
  rows = scheme.distance_slice(tables['r'], tables['top'], block.q_pos, block.k_pos)
  position = jnp.einsum('bqhd,lhd->bhql', q + tables['v'].astype(q.dtype), rows.astype(q.dtype),
                        preferred_element_type=jnp.float32)  # [b, h, bq, bq + bk - 1]
  return s + content[:, :, None, :] + scheme.rel_shift(position)


def _terms(num_heads):
  del num_heads  # the parameters carry the heads
  return scheme.Terms(block_score=_score, prepare=_prepare)


def _params(num_heads, head_dim, kwargs):
  del kwargs
  width = num_heads * head_dim
  if width % 2:
    raise ValueError(f'transformer_xl: the sinusoid R has width num_heads * head_dim = {width}; '
                     'it must be even')
  return {'position_kernel': ((width, num_heads, head_dim), nn.initializers.normal(width ** -0.5),
                              ('embed', 'heads', 'kv')),
          'content_bias': ((num_heads, head_dim), nn.initializers.zeros, ('heads', 'kv')),
          'position_bias': ((num_heads, head_dim), nn.initializers.zeros, ('heads', 'kv'))}


registry.register(registry.AttentionVariant(
    name='transformer_xl',
    models=registry.TRANSFORMER_MODELS,
    fn=transformer_xl_attention,
    terms=_terms,
    params=_params,
    doc='(q+u).k + (q+v).W_R R_{i-j}: sinusoidal relative distances projected per '
        'head, global content and position biases (Transformer-XL, Dai et al. 2019)'))
