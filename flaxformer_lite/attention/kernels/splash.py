"""Scaled dot-product attention on JAX's Pallas splash kernel (TPU).

`splash_attention` runs what dot_product's dense path computes for a causal
or full mask with padding, on `splash_attention_kernel.make_splash_mha`: the
mask's block plan is built once per call from its structure (causal or full,
the same for every head), and padding goes in as segment ids (valid tokens 1,
padding 0), so no [n, m] array is ever built. The gradient is the kernel's
own custom VJP. `interpret=True` runs the kernel on any platform (the tests).
kernels/table.py splash_fits says where 'auto' takes it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import softmax


@functools.cache
def _kernels():
  """(splash_attention_kernel, splash_attention_mask), imported on first
  use (only a TPU's 'auto' or a test asks), or None for a JAX without them."""
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel, splash_attention_mask)
  except ImportError:
    return None
  return splash_attention_kernel, splash_attention_mask


def available() -> bool:
  """Whether this JAX ships the splash kernels."""
  return _kernels() is not None


def _segments(valid, length: int, batch: int):
  """bool [b, L] or None -> int32 [b, L]: 1 for a token, 0 for padding."""
  if valid is None:
    return jnp.ones((batch, length), jnp.int32)
  return jnp.broadcast_to(valid, (batch, length)).astype(jnp.int32)


def _sees_a_key(query_valid, key_valid, n: int, m: int, batch: int, causal: bool):
  """bool [b, n]: whether query i sees at least one key (query i at position i)."""
  keys = _segments(key_valid, m, batch).astype(bool)  # [b, m]
  if causal:  # some valid key at j <= i
    seen = jnp.cumsum(keys, axis=1) > 0
    seen = seen[:, :n] if n <= m else jnp.pad(seen, ((0, 0), (0, n - m)), mode='edge')
  else:
    seen = jnp.broadcast_to(jnp.any(keys, axis=1, keepdims=True), (batch, n))
  return seen & _segments(query_valid, n, batch).astype(bool)


def splash_attention(query, key, value, *, causal: bool, query_valid=None, key_valid=None,
                     interpret: bool = False):
  """softmax(q.k / sqrt(d)) v under a causal or full mask with padding.

  Args:
    query: [b, n, h, d]; query i at position i.
    key, value: [b, m, g, d], g dividing h (query head i reads key head
      i // (h / g)); n and m multiples of the kernel's block (128).
    causal: query i sees keys j <= i; else every key.
    query_valid: bool [b, n] or None; False: a padding query.
    key_valid: bool [b, m] or None; False: a padding key, seen by no query.
  Returns:
    [b, n, h, d] in query's dtype. A query that sees no key (padding, or a
    causal row whose keys are all padding) gets the mean of the values, as
    on every kernel (softmax.where_no_key), never NaN.
  """
  b, n, h, d = query.shape
  m = key.shape[1]
  shape = (n, m)
  kernel_lib, mask_lib = _kernels()
  head_mask = mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)
  kernel = kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([head_mask] * h),
                                      head_shards=1, q_seq_shards=1, interpret=interpret)
  scaled = query / jnp.sqrt(d).astype(query.dtype)
  padded = query_valid is not None or key_valid is not None
  segments = kernel_lib.SegmentIds(q=_segments(query_valid, n, b),
                                   kv=_segments(key_valid, m, b)) if padded else None
  # the kernel takes one example, heads first: [h, n, d], [g, m, d]
  heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
  out = jax.vmap(kernel)(heads_first(scaled), heads_first(key), heads_first(value),
                         segments)  # [b, h, n, d]
  out = heads_first(out).astype(query.dtype)  # [b, n, h, d]
  if not padded:
    return out
  # The kernel's log-sum-exp has no gradient (save_residuals=True has no
  # VJP), so the rows that see no key are told to the rule by a stand-in:
  # -inf there, 0 elsewhere.
  seen = _sees_a_key(query_valid, key_valid, n, m, b, causal)  # [b, n]
  lse = jnp.broadcast_to(jnp.where(seen, 0.0, -jnp.inf)[:, None, :], (b, h, n))
  uniform = lambda: jnp.repeat(jnp.mean(value, axis=1, keepdims=True),  # noqa: E731
                               h // value.shape[2], axis=2)
  return softmax.where_no_key(out, lse, uniform).astype(query.dtype)
