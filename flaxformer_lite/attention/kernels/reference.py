"""The dense kernel: attention over the whole [n, m] scores, the reference
every other kernel is tested against.

`dot_product_attention` takes a boolean mask and an additive bias as arrays
(the public function of the package; shapes as `jax.nn.dot_product_attention`:
query [b, n, h, d], key/value [b, m, g, d], weights and logits [b, h, n, m];
the bias is added in float32 at least, whatever the compute dtype, except
by cuDNN's kernel). `dense_attention` evaluates a scheme's terms
(scheme.Terms) on the whole [n, m] as one block, with its elementwise
`score`: the one source of truth for every scheme.

A query row whose keys are all masked gets uniform weights over the keys
(softmax.py; the same rule as `jax.nn.dot_product_attention` and flax):
finite, never NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks, scheme
from flaxformer_lite.attention.kernels import product
from flaxformer_lite.attention.softmax import softmax_weights


# Both products take heads-major operands ([b, h, L, d]; the g key/value
# heads repeated to h): XLA:CPU then transposes the [b, L, h, d] inputs, where
# on [b, L, h, d] operands, or grouped in place as [b, n, g, h/g, d], it
# transposes [b, h, n, m]-sized arrays around the backward's matmuls. A
# decoding step (one query) keeps the grouped form: it reads the cache's g
# heads in place, with no copy of the cache.


def _heads_major(x, h: int):
  """[b, L, g, d] -> [b, h, L, d], key/value head i // (h / g) for query head i."""
  return product.repeat_heads(x, h).transpose(0, 2, 1, 3)


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
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend. Or a
      masks.Mask (query i at index i), evaluated here.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
  Returns:
    weights [b, h, n, m], rows summing to 1 (before dropout).
  """
  dtype = dtype or query.dtype
  (b, n, h, _), m = query.shape, key.shape[1]
  mask = masks.as_dense(mask, b, h, n, m)
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
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend. Or a
      masks.Mask (query i at index i), evaluated here.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
    implementation: None or 'dense' (the default path: explicit
      weights; of these three, the one with dropout), or 'xla'/'cudnn' for
      `jax.nn.dot_product_attention`. None does not defer to
      `jax.nn.dot_product_attention`: there (JAX 0.10) None means 'xla',
      never cuDNN, and its XLA path (a vmap over head groups, logits scaled
      after the matmul) takes more time and temp memory on CPU than the same
      math written out here (benchmarks/attention.py, its jax.nn column).
      Ask for 'cudnn' to get the fused GPU kernel.
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
  mask = masks.as_dense(mask, b, h, n, m)
  if mask is not None:
    mask = jnp.broadcast_to(mask.astype(bool), jnp.broadcast_shapes(mask.shape, (1, 1, n, m)))
  if bias is not None:
    bias = jnp.broadcast_to(bias, jnp.broadcast_shapes(bias.shape, (1, 1, n, m)))
    # XLA adds the bias to its float32 logits, so it gets the bias in float32.
    # cuDNN's kernel takes it in the compute dtype: with a float32 bias its
    # gradients are NaN (jax-ml/jax#32242).
    bias = bias.astype(jnp.promote_types(dtype, jnp.float32) if implementation == 'xla'
                       else dtype)
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                      implementation=implementation)


def dense_attention(query, key, value, terms: scheme.Terms, params=None, *, mask=None,
                    bias=None, q_offset=0, positions=None, dropout_rate=0.0, dropout_rng=None,
                    deterministic=True, dtype=None, return_weights=False,
                    elementwise=True):
  """`terms` on the whole [n, m] as one block: the reference for every kernel.

  Args:
    query: [b, n, h, d], query i at position q_offset + i; key [b, m, h, d],
      value [b, m, h, dv], key j at position j.
    terms, params: the variant's block terms and their arrays.
    positions: None, or int [n] (n = m, self-attention): the positions of
      the queries and of the keys, in place of q_offset + i and j.
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend. Or a
      masks.Mask (query i at index q_offset + i), evaluated here.
    bias: broadcastable to [b, h, n, m]; added to the terms' scores.
    elementwise: the scheme's elementwise `score` where it has one (the
      reference); False: its `block_score` where it has one (one lookup per
      diagonal: the faster dense path; positions must then be a range).
  Returns:
    [b, n, h, dv] in `dtype` (default: query's dtype); with return_weights,
    (that, weights [b, h, n, m]). A row that sees no key gets uniform weights
    (dot_product's rule), so `terms.uniform` is what the chunked kernel must
    match, not what this uses.
  """
  dtype = dtype or query.dtype
  b, n, h, d = query.shape
  if terms.mask is not None:
    mask = scheme.call_mask(terms, masks.as_mask(mask, q_offset))
  mask = masks.as_dense(mask, b, h, n, key.shape[1], q_offset)
  scaled = query.astype(dtype) / jnp.sqrt(d).astype(dtype)
  q_pos, k_pos = scheme.query_key_positions(n, key.shape[1], q_offset, positions)
  tables = scheme.call_tables(terms, params, q_pos, k_pos)
  logits = product.scores(terms, scaled, key.astype(dtype), tables, q_pos, k_pos,
                          reference=elementwise)  # [b, h, n, m]
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights = softmax_weights(logits, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic, dtype=jnp.float32)
  values = terms.values or product.dot_values
  out = values(weights, value.astype(dtype), tables, q_pos, k_pos)  # [b, h, n, dv]
  out = out.transpose(0, 2, 1, 3).astype(dtype)
  return (out, weights.astype(dtype)) if return_weights else out

