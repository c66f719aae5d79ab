"""Attention math: pure functions of arrays, no parameters, no state."""
from flaxformer_lite.attention import registry
from flaxformer_lite.attention.dot_product import dot_product_attention
from flaxformer_lite.attention.dot_product import dot_product_attention_weights
from flaxformer_lite.attention.registry import AttentionVariant

__all__ = [
    'AttentionVariant',
    'dot_product_attention',
    'dot_product_attention_weights',
    'registry',
]
