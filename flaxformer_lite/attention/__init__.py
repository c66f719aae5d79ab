"""Attention math: pure functions of arrays, no parameters, no state.

scheme.py: the contract a scheme fills in (its score, tables, maps of q and
k, values term); schemes/: the position schemes, one file each; alignment/:
the RNN papers' attention and CoPE; masks.py: masks as functions; kernels/:
how a call is computed, every kernel a row of kernels/table.py; select.py:
which kernel runs a call; registry.py: the names; entry.py: `attend`.
Importing this package registers every variant.
"""
from flaxformer_lite.attention import alignment
from flaxformer_lite.attention import registry
from flaxformer_lite.attention import schemes
from flaxformer_lite.attention.entry import attend
from flaxformer_lite.attention.registry import AttentionVariant
from flaxformer_lite.attention.schemes import alibi
from flaxformer_lite.attention.schemes import deberta
from flaxformer_lite.attention.schemes import rotary
from flaxformer_lite.attention.schemes import shaw
from flaxformer_lite.attention.schemes import t5_bias
from flaxformer_lite.attention.schemes import transformer_xl
from flaxformer_lite.attention.kernels.reference import dot_product_attention
from flaxformer_lite.attention.kernels.reference import dot_product_attention_weights
from flaxformer_lite.attention.schemes.shaw import relative_positions
from flaxformer_lite.attention.schemes.shaw import shaw_attention
from flaxformer_lite.attention.schemes.shaw import shaw_relative_logits
from flaxformer_lite.attention.schemes.shaw import shaw_relative_values
from flaxformer_lite.attention.schemes.t5_bias import t5_relative_position_bucket

__all__ = [
    'AttentionVariant',
    'alibi',
    'alignment',
    'attend',
    'deberta',
    'dot_product_attention',
    'dot_product_attention_weights',
    'registry',
    'relative_positions',
    'rotary',
    'schemes',
    'shaw',
    'shaw_attention',
    'shaw_relative_logits',
    'shaw_relative_values',
    't5_bias',
    't5_relative_position_bucket',
    'transformer_xl',
]
