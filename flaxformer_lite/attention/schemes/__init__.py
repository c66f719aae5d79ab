"""Position schemes, one file each: what a scheme changes in attention.

A scheme is written once as `scheme.Terms` (its per-call tables, its
score change to a block of scaled q.k scores, its maps of q and k, its values
term) and registered by name (registry.py); every kernel in kernels/ runs
it. Importing this package registers them all.
"""
from flaxformer_lite.attention.schemes import alibi
from flaxformer_lite.attention.schemes import deberta
from flaxformer_lite.attention.schemes import dot_product
from flaxformer_lite.attention.schemes import fire
from flaxformer_lite.attention.schemes import kerple
from flaxformer_lite.attention.schemes import local
from flaxformer_lite.attention.schemes import rotary
from flaxformer_lite.attention.schemes import sandwich
from flaxformer_lite.attention.schemes import shaw
from flaxformer_lite.attention.schemes import t5_bias
from flaxformer_lite.attention.schemes import transformer_xl
from flaxformer_lite.attention.schemes import xpos
