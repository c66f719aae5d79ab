"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1).

Shapes follow `jax.nn.dot_product_attention`:
  query [b, n, h, d], key/value [b, m, h, d]; weights and logits [b, h, n, m].
  `mask` is boolean (True = may attend), broadcastable to [b, h, n, m];
  `bias` is added to the scaled logits, broadcastable to [b, h, n, m], in
  float32 (at least) whatever the compute dtype, except by cuDNN's kernel.

A query row whose keys are all masked gets uniform weights over the keys
(softmax.py; the same rule as `jax.nn.dot_product_attention` and flax):
finite, never NaN.
"""
from __future__ import annotations

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels import blockwise, reference


registry.register(registry.AttentionVariant(
    name='dot_product',
    fn=reference.dot_product_attention,
    chunked=blockwise.dot_product,
    terms=lambda num_heads: scheme.Terms(),  # nothing to change: the fused kernels' view
    grouped_kv=True,
    doc='softmax(q.k/sqrt(d)) v (Vaswani et al. 2017); kernel=xla|cudnn '
        'for jax.nn.dot_product_attention'))
