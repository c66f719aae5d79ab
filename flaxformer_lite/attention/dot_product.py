"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1).

Shapes follow `jax.nn.dot_product_attention`:
  query [b, n, h, d], key/value [b, m, h, d]; weights and logits [b, h, n, m].
  `mask` is boolean (True = may attend), broadcastable to [b, h, n, m];
  `bias` is added to the scaled logits, broadcastable to [b, h, n, m], in
  float32 (at least) whatever the compute dtype, except by cuDNN's kernel.

A query row whose keys are all masked gets uniform weights over the keys (the
same rule as `jax.nn.dot_product_attention` and flax): finite, never NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import chunked, dropout, masks, registry, select, splash

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
  backward pass needs the weights only. With jax.nn.softmax instead (the
  same formula behind its `where`/`initial` handling) forward+backward of
  MultiHeadAttention, b=4, n=256, d_model=512, took about 25% more time and
  38% more XLA temp memory on CPU (benchmarks/attention.py). A JVP rule, not
  a VJP, so forward mode (jax.jvp, jax.linearize) works too.
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


# Both products take heads-major operands ([b, h, L, d]; the g key/value
# heads repeated to h). Written on [b, L, h, d] operands, or grouped in place
# as [b, n, g, h/g, d], XLA:CPU transposes [b, h, n, m]-sized arrays around
# the backward's matmuls, which costs more than the matmuls' own transposes
# of [b, L, h, d] inputs (benchmarks/attention.py: ours against flax's
# layer). A decoding step (one query) keeps the grouped form: it reads the
# cache's g heads in place, with no copy of the cache.


def _heads_major(x, h: int):
  """[b, L, g, d] -> [b, h, L, d], key/value head i // (h / g) for query head i."""
  return chunked.repeat_heads(x, h).transpose(0, 2, 1, 3)


def _scores(query, key):
  """q [b, n, h, d] . k [b, m, g, d] -> [b, h, n, m], in float32 (at least)
  as in jax.nn.dot_product_attention: bfloat16 logits lose the small
  differences that the softmax exponentiates."""
  b, n, h, d = query.shape
  g, acc = key.shape[2], jnp.promote_types(query.dtype, jnp.float32)
  if n == 1:
    return jnp.einsum('bngrd,bmgd->bgrnm', query.reshape(b, n, g, h // g, d), key,
                      preferred_element_type=acc).reshape(b, h, n, key.shape[1])
  return jnp.einsum('bhnd,bhmd->bhnm', query.transpose(0, 2, 1, 3), _heads_major(key, h),
                    preferred_element_type=acc)


def _mix(weights, value):
  """weights [b, h, n, m] . v [b, m, g, dv] -> [b, n, h, dv]."""
  b, h, n, m = weights.shape
  g = value.shape[2]
  if n == 1:
    return jnp.einsum('bgrnm,bmgd->bngrd', weights.reshape(b, g, h // g, n, m),
                      value).reshape(b, n, h, value.shape[-1])
  return jnp.einsum('bhnm,bhmd->bhnd', weights, _heads_major(value, h)).transpose(0, 2, 1, 3)


def dot_product_attention_weights(query, key, *, mask=None, bias=None,
                                  dropout_rate=0.0, dropout_rng=None,
                                  deterministic=True, dtype=None):
  """softmax(q·k / sqrt(d) + bias), masked.

  Args:
    query: [b, n, h, d].
    key: [b, m, g, d], g dividing h: query head i reads key head i // (h / g).
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
  Returns:
    weights [b, h, n, m], rows summing to 1 (before dropout).
  """
  dtype = dtype or query.dtype
  query = query.astype(dtype) / jnp.sqrt(query.shape[-1]).astype(dtype)
  logits = _scores(query, key.astype(dtype))
  if bias is not None:
    # In float32, not `dtype`: bfloat16 keeps 8 significant bits, so a bias
    # near 100 (ALiBi's -slope*|j-i| at long range) would move by up to 0.25.
    logits = logits + bias.astype(logits.dtype)
  return softmax_weights(logits, mask, dropout_rate=dropout_rate,
                         dropout_rng=dropout_rng, deterministic=deterministic,
                         dtype=dtype)


def dot_product_attention(query, key, value, *, mask=None, bias=None,
                          dropout_rate=0.0, dropout_rng=None,
                          deterministic=True, dtype=None,
                          implementation=None, return_weights=False):
  """Scaled dot-product attention.

  Args:
    query: [b, n, h, d].
    key, value: [b, m, g, d], g dividing h (grouped-query attention: query
      head i reads head i // (h / g), in place).
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
    implementation: None or 'dense' (the default path: explicit
      weights; of these three, the one with dropout), or 'xla'/'cudnn' for
      `jax.nn.dot_product_attention`. None does not defer to
      `jax.nn.dot_product_attention`: there (JAX 0.10) None means 'xla',
      never cuDNN, and its XLA path (a vmap over head groups, logits scaled
      after the matmul) costs a third more time for forward+backward and
      two thirds more temp memory on CPU than the same math written out here
      (benchmarks/attention.py, its jax.nn column). Ask for 'cudnn' to get
      the fused GPU kernel.
    return_weights: also return the weights [b, h, n, m] (always computed on
      the reference path, whatever `implementation` says).
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype); with return_weights,
    (that, weights [b, h, n, m]).
  """
  dtype = dtype or query.dtype
  if implementation in (None, 'dense') or return_weights:
    weights = dot_product_attention_weights(
        query, key, mask=mask, bias=bias, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, deterministic=deterministic, dtype=dtype)
    out = _mix(weights, value.astype(dtype))
    return (out, weights) if return_weights else out
  if implementation not in ('xla', 'cudnn'):
    raise ValueError(f"implementation={implementation!r}; valid: None, "
                     "'dense', 'xla', 'cudnn'")
  if not deterministic and dropout_rate > 0.0:
    raise ValueError(f'implementation={implementation!r} has no attention '
                     "dropout; use implementation=None or 'dense'")
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  b, n, h, _ = query.shape
  m = key.shape[1]
  if mask is not None:
    mask = jnp.broadcast_to(mask.astype(bool), jnp.broadcast_shapes(mask.shape, (1, 1, n, m)))
  if bias is not None:
    bias = jnp.broadcast_to(bias, jnp.broadcast_shapes(bias.shape, (1, 1, n, m)))
    # XLA adds the bias to its float32 logits, so it gets the bias in float32.
    # cuDNN's kernel takes it in the compute dtype: with a float32 bias its
    # gradients came out NaN (jax-ml/jax#32242).
    bias = bias.astype(jnp.promote_types(dtype, jnp.float32) if implementation == 'xla'
                       else dtype)
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                      implementation=implementation)


def dot_product_chunked(query, key, value, terms=chunked.BlockTerms(), params=None, *,
                        mask=None, q_offset=0, chunk_size=None, dtype=None, dropout_rate=0.0,
                        dropout_rng=None):
  """dot_product_attention block by block (chunked.attend): mask a
  masks.MaskSpec; O(n) memory, the same attention dropout. The queries are scaled by
  1/sqrt(d) here, once; `terms` and `params` add a variant's own block terms
  to q.k (alibi, t5_bias, shaw, local)."""
  dtype = dtype or query.dtype
  scaled = query.astype(dtype) / jnp.sqrt(query.shape[-1]).astype(dtype)
  return chunked.attend(scaled, key, value, terms, params, mask=mask, q_offset=q_offset,
                        chunk_size=chunk_size, dtype=dtype, dropout_rate=dropout_rate,
                        dropout_rng=dropout_rng)


def auto_dot_product(query, key, value, *, implementation='auto', mask=None, dropout_rate=0.0,
                     deterministic=True, dtype=None, return_weights=False, **common):
  """dot_product_attention on `implementation`; 'auto': cuDNN's fused kernel
  (GPU, select.cudnn_fits) or splash's (TPU, select.splash_fits: a causal or
  full masks.MaskSpec with padding, no bias) where it runs these inputs, else
  the dense path. `mask` may be a MaskSpec whose causal rule puts query i at
  position i (select.mask_kind; the layer passes one only then). The
  variants that only change q and k (rotary) call it on their q and k."""
  n, m = query.shape[1], key.shape[1]
  dropout_active = not deterministic and dropout_rate > 0.0
  if implementation == 'auto':  # the explicit path, unless a fused kernel fits
    kind = select.mask_kind(mask) if common.get('bias') is None else None
    if select.splash_fits(query, key, dtype=dtype, dropout=dropout_active,
                          return_weights=return_weights, mask_kind=kind):
      spec = mask if isinstance(mask, masks.MaskSpec) else masks.MaskSpec()
      dtype = dtype or query.dtype
      return splash.splash_attention(
          query.astype(dtype), key.astype(dtype), value.astype(dtype),
          causal=kind == 'causal', query_valid=spec.query_valid, key_valid=spec.key_valid)
    fits = select.cudnn_fits(query, key, dtype=dtype, return_weights=return_weights,
                             dropout=dropout_active)
    implementation = 'cudnn' if fits else 'dense'
  return dot_product_attention(query, key, value, implementation=implementation,
                               mask=masks.as_dense(mask, n, m), dropout_rate=dropout_rate,
                               deterministic=deterministic, dtype=dtype,
                               return_weights=return_weights, **common)


registry.register(registry.AttentionVariant(
    name='dot_product',
    fn=auto_dot_product,
    chunked=dot_product_chunked,
    dense_implementations=('xla', 'cudnn'),
    fused_fits=select.fused_fits,
    grouped_kv=True,
    doc='softmax(q.k/sqrt(d)) v (Vaswani et al. 2017); implementation=xla|cudnn '
        'for jax.nn.dot_product_attention'))
