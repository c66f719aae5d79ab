"""Multi-head attention: the projections, the scheme's parameters and the
decoding cache around one call of attention.attend."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks, registry
from flaxformer_lite.attention.entry import attend


class MultiHeadAttention(nn.Module):
  """Multi-head self or cross attention with an autoregressive decoding cache.

  Called as `(inputs_q [b, n, f], inputs_kv [b, m, f] | None, *, mask, bias,
  deterministic)` -> [b, n, out_features]. `inputs_kv=None` is
  self-attention. Parameter names and shapes are flax's
  MultiHeadDotProductAttention's ('query' [f, h, d], 'key', 'value' [f, g, d], 'out').

  With `decode=True` (self-attention only) the layer keeps `cached_key`,
  `cached_value` [b, max_len, g, d] and `cache_index` in the 'cache'
  collection. The first `apply` after `init` may pass any number of tokens
  (a prompt: prefill), later ones as many as wanted (usually one); each call
  appends its keys/values at `cache_index` and its queries see every cached
  position at or before their own. `mask`, if given, is and-ed with that rule.

  Attributes:
    num_heads: number of query heads h; must divide qkv_features.
    num_kv_heads: key/value heads g (None: h). g < h is grouped-query
      attention (Ainslie et al. 2023; g = 1: multi-query, Shazeer 2019):
      'key' and 'value' are [f, g, d], the decoding cache holds g heads, and
      query head i reads key/value head i // (h / g), as in the GQA paper and
      Llama. The chunked kernel and dot_product's dense one read the g heads
      in place; other dense forms get each head copied to its group.
    qkv_features: h * d (default: the input features).
    out_features: output features (default: the input features).
    attention: registry name of the attention function.
    attention_kwargs: the variant's options (unset ones may be None).
    dropout_rate: attention-weights dropout.
    sow_weights: store the attention weights [b, h, n, m] in the
      'intermediates' collection as 'attention_weights' (apply with
      mutable=['intermediates'] to read them; for plots).

  `prev_alignment` [b, h, n, m] is passed to variants that use it
  (location-sensitive attention; see attention/registry.py). Stochastic
  variants (hard attention) draw from the 'dropout' rng stream.
  `q_offset` (scalar, may be traced) is the absolute position of the first
  query for variants that use positions, when not decoding with the cache
  (which supplies it): an RNN decoder's step t attending over the encoder.
  `return_weights=True` returns (output, weights [b, h, n, m]), for callers
  that use the weights (the RNN decoder's cumulative alignment).

  `mask` is a `masks.Mask` (a function of batch, head, query and key
  index; query i at index q_offset + i) or a boolean array broadcastable to
  [b, h, n, m]: the kernel that `attention_kwargs.kernel` picks
  (attention/entry.py, select.py) evaluates it whole (dense) or one block at
  a time (chunked). With decode=True it is and-ed with the cache's causal rule.
  """
  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  out_features: int | None = None
  attention: str = 'dot_product'
  attention_kwargs: Mapping[str, Any] | None = None
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()
  out_kernel_init: Any = None  # the output projection's; None: kernel_init
  bias_init: Any = nn.initializers.zeros
  use_bias: bool = True
  decode: bool = False
  sow_weights: bool = False

  @nn.compact
  def __call__(self, inputs_q, inputs_kv=None, *, mask=None, bias=None,
               deterministic=True, prev_alignment=None, q_offset=None,
               positions=None, return_weights=False):
    features = inputs_q.shape[-1]
    qkv_features = self.qkv_features or features
    if qkv_features % self.num_heads:
      raise ValueError(f'qkv_features={qkv_features} is not divisible by '
                       f'num_heads={self.num_heads}')
    h, d = self.num_heads, qkv_features // self.num_heads
    g = self.num_kv_heads or h
    if g < 1 or h % g:
      raise ValueError(f'num_kv_heads={self.num_kv_heads} does not divide num_heads={h}; '
                       f'valid: {[x for x in range(1, h + 1) if h % x == 0]}')
    # Logical axes (train/partitioning.py LOGICAL_RULES): a model axis shards
    # the heads, Megatron-style: the projections in by their output heads, 'out'
    # by its input heads.
    def dense(heads, name):
      return nn.DenseGeneral(
          features=(heads[1], d), axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
          kernel_init=nn.with_logical_partitioning(self.kernel_init, ('embed', heads[0], 'kv')),
          bias_init=nn.with_logical_partitioning(self.bias_init, (heads[0], 'kv')),
          use_bias=self.use_bias, name=name)

    if inputs_kv is None:
      inputs_kv = inputs_q
    elif self.decode:
      raise ValueError('decode=True caches self-attention only; build '
                       'cross-attention with decode=False')
    # Three projections, not one fused [f, 3, h, d] matmul: on CPU the fused
    # form's backward (slicing, then re-stacking the gradient) is the slower
    # (benchmarks/attention.py).
    query = dense(('heads', h), 'query')(inputs_q)  # [b, n, h, d]
    key = dense(('kv_heads', g), 'key')(inputs_kv)  # [b, m, g, d]
    value = dense(('kv_heads', g), 'value')(inputs_kv)  # [b, m, g, d]

    if self.decode:
      if q_offset is not None:
        raise ValueError('q_offset is supplied by the cache when decode=True')
      key, value, mask, q_offset = self._update_cache(key, value, mask)
    elif q_offset is None:
      q_offset = 0
    if positions is not None and (self.decode or inputs_kv is not inputs_q):
      raise ValueError('positions= is for self-attention without the cache (randomized '
                       'positions in training)')

    variant = registry.get(self.attention)
    kwargs = registry.resolve_kwargs(self.attention, self.attention_kwargs)
    specs = variant.params(h, d, kwargs) if variant.params else {}
    params = {name: self.param(name, nn.with_logical_partitioning(init, axes), shape,
                               self.param_dtype)
              for name, (shape, init, axes) in specs.items()}
    dropout_active = not deterministic and self.dropout_rate > 0.0
    # a stochastic variant (hard attention) samples from the 'dropout' stream
    stochastic = not deterministic and self.has_rng('dropout')
    want_weights = self.sow_weights or return_weights
    x = attend(query, key, value, scheme=self.attention, mask=mask,
               options=self.attention_kwargs, params=params, q_offset=q_offset,
               positions=positions, bias=bias, dropout_rate=self.dropout_rate,
               dropout_rng=self.make_rng('dropout') if dropout_active else None,
               rng=self.make_rng('dropout') if stochastic else None,
               prev_alignment=prev_alignment, decoding=self.decode, dtype=self.dtype,
               return_weights=want_weights)
    if not want_weights:
      return self._out(x, features)
    x, weights = x
    if self.sow_weights:
      self.sow('intermediates', 'attention_weights', weights)
    out = self._out(x, features)
    return (out, weights) if return_weights else out

  def _out(self, x, features):
    """The output projection, [b, n, h, d] -> [b, n, out_features]."""
    return nn.DenseGeneral(
        features=self.out_features or features, axis=(-2, -1),
        dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=nn.with_logical_partitioning(self.out_kernel_init or self.kernel_init,
                                                 ('heads', 'kv', 'embed')),
        bias_init=nn.with_logical_partitioning(self.bias_init, ('embed',)),
        use_bias=self.use_bias, name='out')(x)

  def _update_cache(self, key, value, mask):
    """Writes key/value [b, L, g, d] at cache_index; returns the full cache.

    Returns (key, value [b, max_len, g, d], a masks.Mask, q_offset); a
    boolean mask's row i is this call's query i, at index + i. A mask is
    the whole rule (it is not made causal): it must hide the later tokens
    it should hide.
    The pass that creates the cache (inside `init`) attends over its own
    inputs only, with the caller's mask.
    """
    initialized = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros, value.shape,
                                 value.dtype)
    cache_index = self.variable('cache', 'cache_index',
                                lambda: jnp.array(0, dtype=jnp.int32))
    if not initialized:
      return key, value, mask, 0
    length, index = key.shape[1], cache_index.value
    key = jax.lax.dynamic_update_slice(cached_key.value, key.astype(cached_key.value.dtype),
                                       (0, index, 0, 0))
    value = jax.lax.dynamic_update_slice(cached_value.value,
                                         value.astype(cached_value.value.dtype),
                                         (0, index, 0, 0))
    cached_key.value, cached_value.value = key, value
    cache_index.value = index + length
    # Query i of this call sits at absolute position index + i: without a
    # mask it sees the cached keys at positions <= its own (the causal rule
    # at q_offset = index); a mask's rule (prefix-LM's prompt read both
    # ways) holds over the keys written so far, never the empty slots.
    if mask is None:
      return key, value, masks.causal(), index
    b, max_len = key.shape[:2]
    written = jnp.broadcast_to(jnp.arange(max_len) < index + length, (b, max_len))
    return key, value, masks.as_mask(mask, index) & masks.key_padding(written), index
