"""Attention kernels: how the blocks of one call are computed, given a
scheme's terms (scheme.py) and a mask (blockwise.py: the pure-JAX online softmax;
product.py: what every kernel, the dense reference too, computes for one
block: the q.k scores with the variant's terms, and p.v; pallas_gpu.py:
FlashAttention in Pallas carrying a score function, for GPUs).

Import a kernel's module itself; this package re-exports nothing.
"""
