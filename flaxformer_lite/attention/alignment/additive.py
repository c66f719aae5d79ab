"""Additive attention: Bahdanau et al. 2015 and Luong et al. 2015's "concat".

  bahdanau:     e_ij = v_h . tanh(q_i + k_j)
  luong_concat: e_ij = v_h . tanh(W_h [q_i; k_j]) = v_h . tanh(Wq_h q_i + Wk_h k_j)
Bahdanau's W s_{i-1} and U h_j are the layer's query and key projections;
Luong's W_h is split into its query and key halves. Logits are unscaled:
v . tanh(.) is bounded by |v|_1 and v starts with std d^-0.5, so they start
with variance below 1 whatever d is.

The tanh acts on every (query, key) pair: a [b, h, n, m, d] float32 tensor,
O(n m d) memory where dot products need O(n m). Fine for RNN decoders (n = 1
per step) and the short sequences these variants are compared on. The chunked
form holds one block's [b, h, bq, bk, d] at a time, blocks of at most
ADDITIVE_CHUNK_SIZE.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.attention.alignment.luong import attend, per_head_matrix

# The chunked form's largest block: its tanh is [b, h, bq, bk, d] float32,
# d times the size of a block of scores.
ADDITIVE_CHUNK_SIZE = 64


def additive_logits(query, key, v):
  """v_h . tanh(q_i + k_j): query [b, n, h, d], key [b, m, h, d], v [h, d] -> [b, h, n, m] float32."""
  q = jnp.transpose(query.astype(jnp.float32), (0, 2, 1, 3))[:, :, :, None]  # [b, h, n, 1, d]
  k = jnp.transpose(key.astype(jnp.float32), (0, 2, 1, 3))[:, :, None]  # [b, h, 1, m, d]
  return jnp.einsum('bhnmd,hd->bhnm', jnp.tanh(q + k), v.astype(jnp.float32))


def bahdanau_attention(query, key, value, additive_v, *, dtype=None, **common):
  """Bahdanau (additive) attention.

  Args:
    query: [b, n, h, d]; key, value: [b, m, h, d].
    additive_v: [h, d].
    common: mask, bias, dropout, return_weights, as `luong.attend`.
  Returns:
    [b, n, h, d] in `dtype` (default: query's); with return_weights,
    (that, weights [b, h, n, m]).
  """
  return attend(additive_logits(query, key, additive_v), value,
                dtype=dtype or query.dtype, **common)


def luong_concat_attention(query, key, value, concat_wq, concat_wk, concat_v, *,
                           dtype=None, **common):
  """Luong's concat score, v_h . tanh(Wq_h q_i + Wk_h k_j).

  Args:
    query: [b, n, h, d]; key, value: [b, m, h, d].
    concat_wq, concat_wk: [h, d, d]; concat_v: [h, d].
  Returns:
    as bahdanau_attention.
  """
  f32 = jnp.float32
  q = jnp.einsum('bnhd,hde->bnhe', query.astype(f32), concat_wq.astype(f32))
  k = jnp.einsum('bmhd,hde->bmhe', key.astype(f32), concat_wk.astype(f32))
  return attend(additive_logits(q, k, concat_v), value, dtype=dtype or query.dtype, **common)


def _block_logits(q, k, tables):
  """v_h . tanh(Wq_h q_i + Wk_h k_j) for one block (scheme.Terms.product:
  a score that is not q.k); bahdanau has no Wq, Wk."""
  project = lambda x, w: jnp.einsum('bnhd,hde->bnhe', x, w.astype(jnp.float32))  # noqa: E731
  if 'wq' in tables:
    q, k = project(q, tables['wq']), project(k, tables['wk'])
  return additive_logits(q, k, tables['v'])


def _chunked(q, k, value, params, *, mask, q_offset, chunk_size, dtype, **dropout):
  chunk_size = min(chunk_size or ADDITIVE_CHUNK_SIZE, ADDITIVE_CHUNK_SIZE)
  out = blockwise.attend(q.astype(jnp.float32), k.astype(jnp.float32), value,
                         scheme.Terms(product=_block_logits), params, mask=mask,
                         q_offset=q_offset, chunk_size=chunk_size, dtype=jnp.float32,
                         **dropout)
  return out.astype(dtype)


def bahdanau_chunked(query, key, value, additive_v, *, mask=None, q_offset=0,
                     chunk_size=None, dtype=None, **dropout):
  """bahdanau_attention block by block (blockwise.attend; blocks of at most
  ADDITIVE_CHUNK_SIZE)."""
  return _chunked(query, key, value, {'v': additive_v}, mask=mask, q_offset=q_offset,
                  chunk_size=chunk_size, dtype=dtype or query.dtype, **dropout)


def luong_concat_chunked(query, key, value, concat_wq, concat_wk, concat_v, *, mask=None,
                         q_offset=0, chunk_size=None, dtype=None, **dropout):
  """luong_concat_attention block by block: Wq and Wk applied to each block
  as it is read (bq d^2 beside the block's bq bk d tanh), so no projected
  [b, n, h, d] copy of q or k is kept for the backward pass."""
  return _chunked(query, key, value, {'v': concat_v, 'wq': concat_wq, 'wk': concat_wk},
                  mask=mask, q_offset=q_offset, chunk_size=chunk_size,
                  dtype=dtype or query.dtype, **dropout)


def _v_init(head_dim):
  return jax.nn.initializers.normal(head_dim ** -0.5)


registry.register(registry.AttentionVariant(
    name='bahdanau',
    fn=bahdanau_attention,
    chunked=bahdanau_chunked,
    params=lambda num_heads, head_dim, kwargs: {
        'additive_v': ((num_heads, head_dim), _v_init(head_dim), ('heads', 'kv'))},
    doc='softmax(v_h . tanh(q + k)) v, additive (Bahdanau et al. 2015); '
        'O(n*m*d) memory'))

registry.register(registry.AttentionVariant(
    name='luong_concat',
    fn=luong_concat_attention,
    chunked=luong_concat_chunked,
    params=lambda num_heads, head_dim, kwargs: {
        'concat_wq': ((num_heads, head_dim, head_dim), per_head_matrix, ('heads', 'kv', None)),
        'concat_wk': ((num_heads, head_dim, head_dim), per_head_matrix, ('heads', 'kv', None)),
        'concat_v': ((num_heads, head_dim), _v_init(head_dim), ('heads', 'kv'))},
    doc='softmax(v_h . tanh(Wq_h q + Wk_h k)) v (Luong et al. 2015, concat); '
        'O(n*m*d) memory'))
