"""Fused attention kernels that JAX ships, for schemes without a score term:
cuDNN's (`jax.nn.dot_product_attention`, GPU) and splash attention (TPU).
`auto_dot_product` runs one of them where select.py says it fits these
inputs, else the dense reference. dot_product calls it, and rotary on its
rotated q and k.
"""
from __future__ import annotations

from flaxformer_lite.attention import masks, select
from flaxformer_lite.attention.kernels import splash
from flaxformer_lite.attention.kernels.reference import dot_product_attention


def auto_dot_product(query, key, value, *, implementation='auto', mask=None, dropout_rate=0.0,
                     deterministic=True, dtype=None, return_weights=False, **common):
  """dot_product_attention on `implementation`; 'auto': cuDNN's fused kernel
  (GPU, select.cudnn_fits) or splash's (TPU, select.splash_fits: a causal or
  full masks.MaskSpec with padding, no bias) where it runs these inputs, else
  the dense path. `mask` may be a MaskSpec whose causal rule puts query i at
  position i (select.mask_kind; the layer passes one only then), or a
  masks.Mask (query i at index i; never splash's: its kind is None). The
  variants that only change q and k (rotary) call it on their q and k."""
  (b, n, h, _), m = query.shape, key.shape[1]
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
                               mask=masks.as_dense(mask, b, h, n, m), dropout_rate=dropout_rate,
                               deterministic=deterministic, dtype=dtype,
                               return_weights=return_weights, **common)
