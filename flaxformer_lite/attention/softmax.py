"""The masked softmax every dense form shares, dropout included.

logits [b, h, n, m] -> weights [b, h, n, m]. A query row whose keys are all
masked gets uniform weights over the keys (the same rule as
`jax.nn.dot_product_attention` and flax): finite, never NaN.
`window_softmax` is the same inside a window (local attention, Luong's
local variants). `where_no_key` is that rule for the kernels that return a
log-sum-exp instead of weights (blockwise, Pallas, Shaw's band, splash).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dropout

# Masked logits are set to this (times the dtype's max), not -inf, so that a
# fully masked row stays finite. Same constant as jax.nn.dot_product_attention.
_MASK_VALUE = -0.7


def masked_logits(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Replaces logits where `mask` is False by a large finite negative number."""
  if mask is None:
    return logits
  big_neg = _MASK_VALUE * jnp.finfo(logits.dtype).max
  return jnp.where(mask.astype(bool), logits, big_neg)


@jax.custom_jvp
def _softmax(z):
  """softmax over the last axis of float32 z [..., m].

  The derivative is written out, dw = w * (dz - sum(w * dz)), so that the
  backward pass needs the weights only; jax.nn.softmax (the same formula
  behind its `where`/`initial` handling) takes more time and temp memory
  there. A JVP rule, not a VJP, so forward mode (jax.jvp, jax.linearize)
  works too.
  """
  e = jnp.exp(z - jnp.max(z, -1, keepdims=True))
  return e / jnp.sum(e, -1, keepdims=True)


@_softmax.defjvp
def _softmax_jvp(primals, tangents):
  (z,), (dz,) = primals, tangents
  w = _softmax(z)
  return w, w * (dz - jnp.sum(w * dz, -1, keepdims=True))


def softmax_weights(logits, mask, *, dropout_rate=0.0, dropout_rng=None,
                    deterministic=True, dtype=None, q_idx=None, k_idx=None):
  """Masked float32 softmax over the last axis, then dropout.

  logits [b, h, n, m] -> weights [b, h, n, m] in `dtype` (default: logits'
  dtype). Dropout zeroes weights with probability `dropout_rate` and rescales
  the rest by 1/(1-rate), as in the paper's attention dropout; its keep mask
  is dropout.py's, the chunked kernel's (q_idx, k_idx: dropout.apply). A
  fully masked row's uniform weights are not dropped.
  """
  dtype = dtype or logits.dtype
  weights = _softmax(masked_logits(logits.astype(jnp.float32), mask)).astype(dtype)
  dropped = dropout.apply(weights, dropout_rate, dropout_rng, deterministic, q_idx, k_idx)
  if deterministic or dropout_rate == 0.0 or mask is None:
    return dropped
  # A row that sees no key keeps its uniform weights whole, as in the
  # chunked kernel (which never draws dropout for such a row).
  return jnp.where(jnp.any(mask, -1, keepdims=True), dropped, weights)


def window_softmax(logits, in_window, mask, *, dropout_rate=0.0, dropout_rng=None,
                   deterministic=True, dtype=None, q_idx=None, k_idx=None):
  """Masked softmax over the keys inside a window.

  logits [..., k] float32; in_window and mask (None or) boolean, broadcastable
  to it. A row with no visible key inside its window gets uniform weights over
  its window: softmax_weights' rule for fully masked rows, restricted to the
  window so that forms that see different key sets (blocked, plain) agree. An
  empty window gives a zero row. q_idx, k_idx: each weight's query and key
  index for dropout (dropout.apply). Returns [..., k] in `dtype`.
  """
  allowed = in_window if mask is None else jnp.logical_and(in_window, mask)
  weights = softmax_weights(logits, allowed, dropout_rate=dropout_rate,
                            dropout_rng=dropout_rng, deterministic=deterministic,
                            dtype=dtype, q_idx=q_idx, k_idx=k_idx)
  uniform = in_window / jnp.maximum(jnp.sum(in_window, -1, keepdims=True), 1)
  return jnp.where(jnp.any(allowed, -1, keepdims=True), weights,
                   uniform.astype(weights.dtype))


def where_no_key(out, lse, uniform):
  """The rule for a query that sees no key, for every kernel that returns
  (out [b, n, h, dv], lse float32 [b, h, n]), lse -inf on such a row: the
  row gets uniform(), [b, n, h, dv], the output of uniform weights over the
  keys (the mean value for plain attention). That is the dense softmax's
  answer (all its logits equal), jax.nn.dot_product_attention's and
  flax's: finite where a -inf row would give NaN, and the same on every
  kernel. uniform None: the mask hides no row (masks.hides_no_row), and out
  is returned as it is -> float32 [b, n, h, dv]."""
  if uniform is None:
    return out.astype(jnp.float32)
  empty = jnp.isneginf(lse).transpose(0, 2, 1)[..., None]  # [b, n, h, 1]
  return jnp.where(empty, uniform().astype(jnp.float32), out.astype(jnp.float32))
