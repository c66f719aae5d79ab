"""Attention math: pure functions of arrays, no parameters, no state.

Importing this package registers every variant (see registry.py).
"""
from flaxformer_lite.attention import additive
from flaxformer_lite.attention import alibi
from flaxformer_lite.attention import cope
from flaxformer_lite.attention import deberta
from flaxformer_lite.attention import dot_product
from flaxformer_lite.attention import fire
from flaxformer_lite.attention import hard
from flaxformer_lite.attention import kerple
from flaxformer_lite.attention import local
from flaxformer_lite.attention import location
from flaxformer_lite.attention import luong
from flaxformer_lite.attention import registry
from flaxformer_lite.attention import relative
from flaxformer_lite.attention import rotary
from flaxformer_lite.attention import sandwich
from flaxformer_lite.attention import t5_bias
from flaxformer_lite.attention import transformer_xl
from flaxformer_lite.attention import xpos
from flaxformer_lite.attention.dot_product import dot_product_attention
from flaxformer_lite.attention.dot_product import dot_product_attention_weights
from flaxformer_lite.attention.registry import AttentionVariant
from flaxformer_lite.attention.relative import relative_positions
from flaxformer_lite.attention.relative import shaw_attention
from flaxformer_lite.attention.relative import shaw_relative_logits
from flaxformer_lite.attention.relative import shaw_relative_values
from flaxformer_lite.attention.t5_bias import t5_relative_position_bucket

__all__ = [
    'AttentionVariant',
    'alibi',
    'deberta',
    'dot_product_attention',
    'dot_product_attention_weights',
    'registry',
    'relative',
    'relative_positions',
    'rotary',
    'shaw_attention',
    'shaw_relative_logits',
    'shaw_relative_values',
    't5_bias',
    't5_relative_position_bucket',
    'transformer_xl',
]
