"""xPos: RoPE with an exponential decay (Sun et al. 2023, "A Length-Extrapolatable
Transformer", eq. 11-12).

Feature pair i of a head of d is rotated as in RoPE and, besides, queries
are scaled by zeta_i^(n/gamma) and keys by zeta_i^(-m/gamma), so that pair
i's share of q_n . k_m decays as zeta_i^((n - m)/gamma), with
  zeta_i = (2i/d + a) / (1 + a),  a = 0.4,  gamma = `xpos_scale_base` (512),
as in the authors' torchscale code. The decay is that of a causal model (the
paper's): a key after its query (n < m) would be weighted up, so the variant
serves decoder-only models.

zeta^(n/gamma) alone under- or overflows at long range (zeta_0 = 0.29: at
n = 64k, 0.29^128 = 1e-69). Within a block only the difference matters, so
positions are measured from the block's first key (the `origin` of
Terms.transform_q and transform_k): the keys' factors stay within
zeta^(-bk/gamma), the queries' never exceed 1 where n >= m, and a far
block's products shrink towards 0, their true value.

Written once as block terms (scheme.py): the queries and keys mapped,
the kernel's q.k of them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.schemes.rotary import apply_rotary

DECAY_OFFSET = 0.4  # a in zeta_i above (torchscale's 0.4)


def decay_base(d: int):
  """zeta_i for the d/2 feature pairs -> float32 [d/2]."""
  return ((np.arange(0, d, 2) / d + DECAY_OFFSET) / (1 + DECAY_OFFSET)).astype(np.float32)


def _scaled(x, positions, sign, scale_base, max_wavelength):
  """x [b, L, h, d] rotated by `positions` [L] and scaled pair by pair by
  zeta_i^(sign * positions / gamma)."""
  zeta = decay_base(x.shape[-1])  # [d/2]
  power = sign * positions.astype(jnp.float32)[:, None] / scale_base * np.log(zeta)[None, :]
  factor = jnp.repeat(jnp.exp(power), 2, axis=-1)[None, :, None, :]  # [1, L, 1, d]
  rotated = apply_rotary(x, positions, max_wavelength=max_wavelength)
  return (rotated.astype(jnp.float32) * factor).astype(x.dtype)


def _transform(sign, scale_base, max_wavelength, x, tables, positions, origin):
  """A query (sign 1) or key (sign -1) rotated and scaled by its position
  measured from the block's first key (module docstring), so that pair i
  of q_n . k_m is weighted by zeta_i^((n - m)/gamma)."""
  del tables
  return _scaled(x, positions - origin, sign, scale_base, max_wavelength)


def _terms(num_heads, *, xpos_scale_base, max_wavelength):
  del num_heads
  scale_base, max_wavelength = float(xpos_scale_base), float(max_wavelength)
  return scheme.Terms(
      transform_q=functools.partial(_transform, 1.0, scale_base, max_wavelength),
      transform_k=functools.partial(_transform, -1.0, scale_base, max_wavelength))


def _check_head_dim(head_dim):
  if head_dim % 2:
    raise ValueError(f'xpos rotates pairs of features: the head size {head_dim} must be even')


@dataclasses.dataclass(frozen=True)
class XposOptions:
  """xPos's options, numbers > 0.

  xpos_scale_base: the decay's length scale: pair i decays by
    zeta_i^((i - j)/xpos_scale_base).
  max_wavelength: RoPE's base (registry.SHARED_OPTIONS).
  """
  xpos_scale_base: float = 512.0
  max_wavelength: float = 10000.0

  def __post_init__(self):
    registry.check_positive(self, 'xpos_scale_base')
    registry.check_positive(self, 'max_wavelength')


registry.register(registry.AttentionVariant(
    name='xpos',
    models=('decoder_only',),
    terms=_terms,
    options=XposOptions,
    check_head_dim=_check_head_dim,
    doc='RoPE times a per-pair decay zeta_i^((i-j)/xpos_scale_base) (xPos, Sun et al. 2023); '
        'causal, so decoder-only models; use with positions=none'))
