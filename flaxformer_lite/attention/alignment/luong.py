"""Luong et al. 2015, "Effective Approaches to Attention-based NMT": dot, general, local-p, local-m.

Luong phrases attention as a score, then a softmax over the source, then the
weighted sum; `attend` is that second half, shared by every score-function
variant (additive.py, location.py). Scores here are unscaled (no 1/sqrt(d)),
as in the paper, whose states came out of tanh/LSTM cells. Layer queries and
keys have per-feature variance ~1, so q.k has variance ~d: at d=64 the
softmax starts out sharp. That is the paper's math, kept on purpose.

`general_w` starts as the identity, so luong_general starts equal to
luong_dot and the comparison of the two isolates what W learns. A random
(lecun) W would give logits of the same variance (d) and no other benefit;
no noise is needed to break symmetry, the heads' query/key projections
already differ.

Key positions are 0-based. Local attention uses a window of half-width D
(the option `half_window`): query i sees keys |j - p_i| <= D, 2D + 1 at most.
local.py's `window` is another quantity (|j - p| < window there), hence
another name.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.attention.softmax import softmax_weights, window_softmax


def attend(logits, value, *, mask=None, bias=None, dropout_rate=0.0, dropout_rng=None,
           deterministic=True, dtype=None, return_weights=False):
  """softmax over keys of logits [b, h, n, m] (+ bias, masked), then sum_j w_ij v_j.

  value: [b, m, h, d]. Returns [b, n, h, d] in `dtype` (default: value's);
  with return_weights, (that, weights [b, h, n, m]).
  """
  dtype = dtype or value.dtype
  logits = logits.astype(jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights = softmax_weights(logits, mask, dropout_rate=dropout_rate,
                            dropout_rng=dropout_rng, deterministic=deterministic,
                            dtype=dtype)
  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value.astype(dtype))
  return (out, weights) if return_weights else out


def general_logits(query, key, general_w):
  """q_i^T W_h k_j: query [b, n, h, d], key [b, m, h, d], W [h, d, d] -> [b, h, n, m] float32."""
  qw = jnp.einsum('bnhd,hde->bnhe', query.astype(jnp.float32), general_w.astype(jnp.float32))
  return jnp.einsum('bnhe,bmhe->bhnm', qw, key.astype(jnp.float32))


def luong_dot_attention(query, key, value, *, dtype=None, **common):
  """score = q_i . k_j, unscaled.

  query [b, n, h, d]; key, value [b, m, h, d]; `common` (mask, bias, dropout,
  return_weights) as `attend`. Returns [b, n, h, d] in `dtype` (default:
  query's), and weights [b, h, n, m] with return_weights.
  """
  logits = jnp.einsum('bnhd,bmhd->bhnm', query.astype(jnp.float32), key.astype(jnp.float32))
  return attend(logits, value, dtype=dtype or query.dtype, **common)


def luong_general_attention(query, key, value, general_w, *, dtype=None, **common):
  """score = q_i^T W_h k_j with W [h, d, d]; otherwise as luong_dot_attention."""
  return attend(general_logits(query, key, general_w), value, dtype=dtype or query.dtype,
                **common)


def luong_dot_chunked(query, key, value, terms=scheme.Terms(), params=None, *,
                      mask=None, q_offset=0, chunk_size=None, dtype=None, **dropout):
  """luong_dot_attention block by block (blockwise.attend): unscaled q.k in
  float32, as the dense form; `terms` and `params` map the queries
  (luong_general)."""
  f32 = jnp.float32
  out = blockwise.attend(query.astype(f32), key.astype(f32), value.astype(dtype or query.dtype),
                         terms, params, mask=mask, q_offset=q_offset, chunk_size=chunk_size,
                         dtype=f32, **dropout)
  return out.astype(dtype or query.dtype)


def luong_general_chunked(query, key, value, general_w, *, mask=None, q_offset=0,
                          chunk_size=None, dtype=None, **dropout):
  """luong_general_attention block by block: unscaled (q_i W_h) . k_j in
  float32. W_h is applied to each query block as it is read (d / block more
  work than the block's dot): q W_h for all queries at once would be one
  more [b, n, h, d] array forward and another, its gradient, backward."""
  return luong_dot_chunked(query, key, value, scheme.Terms(transform_q=_general_w),
                           {'general_w': general_w.astype(jnp.float32)}, mask=mask,
                           q_offset=q_offset, chunk_size=chunk_size, dtype=dtype, **dropout)


def _general_w(q, tables, positions, origin):
  """q W_h for one block's queries [b, bq, h, d] (Terms.transform_q)."""
  del positions, origin
  return jnp.einsum('bqhd,hde->bqhe', q, tables['general_w'], preferred_element_type=jnp.float32)


def visible_keys(mask, m):
  """S: how many keys each query may attend to -> float32 [..., n | 1, 1] (m without a mask).

  For a padding mask that is the source length, the paper's S; under a causal
  mask it is i + 1, so a predicted or clipped position stays among the keys
  the query can see, in a full pass and step by step with a cache alike.
  """
  if mask is None:
    return jnp.float32(m)
  mask = jnp.broadcast_to(mask, mask.shape[:-1] + (m,))
  return jnp.sum(mask, axis=-1, keepdims=True, dtype=jnp.float32)


def _window_weights(logits, positions, half_window, *, mask, bias, dtype, **drop):
  """Softmax of logits [b, h, n, m] over the visible keys |j - p| <= half_window.

  positions: p, float32 broadcastable to [b, h, n, 1]. Returns (weights
  [b, h, n, m] in `dtype`, offsets j - p float32).
  """
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  offsets = jnp.arange(logits.shape[-1], dtype=jnp.float32) - positions  # [.., n, m]
  weights = window_softmax(logits, jnp.abs(offsets) <= half_window, mask, dtype=dtype,
                           **drop)
  return weights, offsets


def luong_local_p_attention(query, key, value, general_w, local_wp, local_vp, *,
                            half_window=8, mask=None, bias=None, dtype=None,
                            return_weights=False, **drop):
  """Local-p (eq. 9-10): a predicted window position, general score, Gaussian.

  p_i = S * sigmoid(vp_h . tanh(Wp_h q_i)) in [0, S] (S from `visible_keys`);
  a_ij = softmax over visible keys |j - p_i| <= D of q_i^T W_h k_j, times
  exp(-(j - p_i)^2 / (2 sigma^2)), sigma = D / 2, not renormalised (as the
  paper): rows sum to less than 1. The Gaussian carries the gradient to p_i
  (the window's edges have none).

  Args:
    query: [b, n, h, d]; key, value: [b, m, h, d].
    general_w, local_wp: [h, d, d]; local_vp: [h, d].
    half_window: D >= 1.
  Returns:
    [b, n, h, d] in `dtype`; with return_weights, (that, weights [b, h, n, m]).
  """
  hidden = jnp.tanh(jnp.einsum('bnhd,hde->bhne', query.astype(jnp.float32),
                               local_wp.astype(jnp.float32)))  # [b, h, n, d]
  gate = jax.nn.sigmoid(jnp.einsum('bhne,he->bhn', hidden, local_vp.astype(jnp.float32)))
  positions = visible_keys(mask, key.shape[1]) * gate[..., None]  # [b, h, n, 1]
  dtype = dtype or query.dtype
  weights, offsets = _window_weights(general_logits(query, key, general_w), positions,
                                     half_window, mask=mask, bias=bias, dtype=dtype,
                                     **drop)
  sigma = half_window / 2
  weights = (weights * jnp.exp(-offsets ** 2 / (2 * sigma ** 2))).astype(dtype)
  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value.astype(dtype))
  return (out, weights) if return_weights else out


def luong_local_m_attention(query, key, value, general_w, *, half_window=8, q_offset=0,
                            mask=None, bias=None, dtype=None, return_weights=False, **drop):
  """Local-m: a monotonic window around p_i = q_offset + i, general score, no Gaussian.

  p_i is clipped to S - 1 (S from `visible_keys`), so a target longer than
  its source attends to the last D + 1 source keys rather than to none.
  Weights are the softmax over visible keys |j - p_i| <= D (rows sum to 1).

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i.
    key, value: [b, m, h, d], key j at position j.
    general_w: [h, d, d].
    half_window: D >= 1.
  Returns:
    [b, n, h, d] in `dtype`; with return_weights, (that, weights [b, h, n, m]).
  """
  n, m = query.shape[1], key.shape[1]
  last = jnp.maximum(visible_keys(mask, m) - 1, 0)
  positions = jnp.minimum((q_offset + jnp.arange(n, dtype=jnp.float32))[:, None], last)
  dtype = dtype or query.dtype
  weights, _ = _window_weights(general_logits(query, key, general_w), positions,
                               half_window, mask=mask, bias=bias, dtype=dtype, **drop)
  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value.astype(dtype))
  return (out, weights) if return_weights else out


# For [h, d_in, d_out] matrices: fan-in d_in (by default the head axis would
# count into the fan-in too, shrinking the init by sqrt(h)).
per_head_matrix = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


def identity_init(key, shape, dtype=jnp.float32):
  """[h, d, d] identities (the key is unused: the init is deterministic)."""
  del key
  return jnp.broadcast_to(jnp.eye(shape[-1], dtype=dtype), shape)


def _general_params(num_heads, head_dim, kwargs):
  del kwargs
  return {'general_w': ((num_heads, head_dim, head_dim), identity_init, ('heads', 'kv', None))}


def _local_p_params(num_heads, head_dim, kwargs):
  return {**_general_params(num_heads, head_dim, kwargs),
          'local_wp': ((num_heads, head_dim, head_dim), per_head_matrix, ('heads', 'kv', None)),
          # vp . tanh(.) has variance ~1 with std d^-0.5: p starts spread around S/2.
          'local_vp': ((num_heads, head_dim), jax.nn.initializers.normal(head_dim ** -0.5),
                       ('heads', 'kv'))}


@dataclasses.dataclass(frozen=True)
class LuongLocalOptions:
  """The local variants' option.

  half_window: D (registry.SHARED_OPTIONS): query i sees the keys
    |j - p_i| <= D around its window position p_i; >= 1.
  """
  half_window: int = 8

  def __post_init__(self):
    registry.check_int(self, 'half_window', 1, 'D: query i sees the keys |j - p_i| <= D')


registry.register(registry.AttentionVariant(
    name='luong_dot',
    fn=luong_dot_attention,
    chunked=luong_dot_chunked,
    doc='softmax(q.k) v, unscaled (Luong et al. 2015, dot)'))

registry.register(registry.AttentionVariant(
    name='luong_general',
    fn=luong_general_attention,
    chunked=luong_general_chunked,
    params=_general_params,
    doc='softmax(q^T W_h k) v, W_h [d, d] per head starting at the identity '
        '(Luong et al. 2015, general)'))

registry.register(registry.AttentionVariant(
    name='luong_local_p',
    fn=luong_local_p_attention,
    options=LuongLocalOptions,
    params=_local_p_params,
    doc='general score in a window |j-p_i| <= half_window around a predicted '
        'p_i = S*sigmoid(vp.tanh(Wp q_i)), times a Gaussian (sigma=half_window/2); '
        'rows sum to < 1 (Luong et al. 2015, local-p)'))

registry.register(registry.AttentionVariant(
    name='luong_local_m',
    fn=luong_local_m_attention,
    options=LuongLocalOptions,
    params=_general_params,
    doc='general score in a window |j-p_i| <= half_window around p_i = query position '
        '(clipped to the last visible key) (Luong et al. 2015, local-m)'))
