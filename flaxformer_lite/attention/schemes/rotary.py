"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", eq. 34), and
the context-extension family.

Queries and keys are rotated by an angle proportional to their position, pair
of features by pair of features, so that q_rot(i) . k_rot(j) depends on the
positions only through j - i. Pair i turns by theta_i = b^(-2i/d) a position
(b = max_wavelength). A model trained at context L runs at s * L
(rope_factor s, rope_original_max_len L) with the frequencies changed:
  linear (Position Interpolation, Chen et al. 2023): theta_i / s, positions
      squeezed into the trained range;
  ntk (NTK-aware, bloc97 2023): base b * s^(d / (d - 2)): the fastest pair
      unchanged, the slowest interpolated by exactly s;
  yarn (Peng et al. 2023, eq. 17-20): per pair, by r = L / wavelength_i,
      theta_i / s where r < 1 (pairs that never turned a full circle in
      training), theta_i where r > 32, a linear ramp between; and q and k
      each scaled by 0.1 ln s + 1 (the paper's sqrt(1/t), a temperature on
      the logits).
rotary_fraction < 1 rotates the first fraction of each head's features only
(partial RoPE, GPT-J / GPT-NeoX's rotary_pct); the rest carry no position.
rotary_layout: which features form pair i: 'interleaved', (2i, 2i+1) as in
the paper (and GGUF files, whose converter permutes Llama's q and k into
it), or 'halves', (i, i + r/2) as in GPT-NeoX and Hugging Face's Llama.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import registry, scheme, select
from flaxformer_lite.attention.kernels.reference import dot_product_attention


SCALINGS = ('none', 'linear', 'ntk', 'yarn')
LAYOUTS = ('interleaved', 'halves')
# YaRN's ramp bounds (alpha, beta of the paper's eq. 18, its LLaMA values): a
# pair with fewer than YARN_ALPHA turns over the trained context is
# interpolated, one with more than YARN_BETA is kept.
YARN_ALPHA, YARN_BETA = 1.0, 32.0


def rotated_dims(d: int, fraction: float = 1.0) -> int:
  """The features of a head of d that turn: an even count, at most d."""
  return 2 * int(d * fraction // 2)


def frequencies(d: int, *, max_wavelength=10000.0, scaling='none', factor=1.0,
                original_max_len=0):
  """theta_i, i = 0 .. d/2 - 1, for d rotated features (module docstring):
  -> float32 [d/2] radians a position."""
  exponent = -np.arange(0, d, 2, dtype=np.float64) / d
  base = max_wavelength * factor ** (d / (d - 2)) if scaling == 'ntk' and d > 2 else max_wavelength
  theta = base ** exponent
  if scaling == 'linear':
    theta = theta / factor
  elif scaling == 'yarn':
    turns = original_max_len * theta / (2 * np.pi)  # r = L / wavelength
    ramp = np.clip((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA), 0.0, 1.0)
    theta = (1 - ramp) * theta / factor + ramp * theta
  return jnp.asarray(theta, jnp.float32)


def temperature(scaling='none', factor=1.0) -> float:
  """What YaRN multiplies q and k by (0.1 ln s + 1); 1 otherwise."""
  return 0.1 * math.log(factor) + 1.0 if scaling == 'yarn' and factor > 1 else 1.0


def _cos_sin(angle):
  """(cos, sin) of angle [n, r/2], computed once. Fused into the rotation,
  XLA:CPU evaluates them again for every element of the rotated [b, n, h, r];
  a conditional is not fused into its users, so its outputs are computed once.
  Both branches are the same: the predicate only has to be one XLA cannot
  fold."""
  same = lambda a: (jnp.cos(a), jnp.sin(a))  # noqa: E731
  return jax.lax.cond(angle[0, 0] >= 0, same, same, angle) if angle.size else same(angle)


def apply_rotary(x, positions, *, max_wavelength=10000.0, rope_scaling='none', rope_factor=1.0,
                 rope_original_max_len=0, rotary_fraction=1.0, rotary_layout='interleaved'):
  """Rotates each feature pair of the first r = rotated_dims(d,
  rotary_fraction) features by positions * theta_i (`frequencies`), and
  scales them by `temperature`. Pair i is (x[2i], x[2i+1]) ('interleaved',
  the paper's) or (x[i], x[i + r/2]) ('halves', GPT-NeoX's).

  Args:
    x: [b, n, h, d], d even.
    positions: [n] int (may be traced), the absolute position of each row.
  Returns:
    [b, n, h, d] in x's dtype; angles and rotation in float32.
  """
  b, n, h, d = x.shape
  if d % 2:
    raise ValueError(f'rotary attention needs an even head_dim, got d={d}')
  r = rotated_dims(d, rotary_fraction)
  theta = frequencies(r, max_wavelength=max_wavelength, scaling=rope_scaling, factor=rope_factor,
                      original_max_len=rope_original_max_len)  # [r/2]
  angle = jnp.asarray(positions, jnp.float32)[:, None] * theta[None, :]  # [n, r/2]
  scale = temperature(rope_scaling, rope_factor)
  cos, sin = _cos_sin(angle)
  cos = scale * cos[None, :, None, :]  # [1, n, 1, r/2]
  sin = scale * sin[None, :, None, :]
  pair_axis = -1 if rotary_layout == 'interleaved' else -2
  pairs = x[..., :r].astype(jnp.float32).reshape(
      (b, n, h, r // 2, 2) if pair_axis == -1 else (b, n, h, 2, r // 2))
  x0, x1 = jnp.take(pairs, 0, axis=pair_axis), jnp.take(pairs, 1, axis=pair_axis)  # [b, n, h, r/2]
  rotated = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=pair_axis)
  rotated = rotated.reshape(b, n, h, r).astype(x.dtype)
  return rotated if r == d else jnp.concatenate([rotated, x[..., r:]], axis=-1)


def rotary_attention(query, key, value, *, q_offset=0, positions=None, max_wavelength=10000.0,
                     rope_scaling='none', rope_factor=1.0, rope_original_max_len=0,
                     rotary_fraction=1.0, rotary_layout='interleaved', implementation=None,
                     **common):
  """Dot-product attention over rotated queries and keys; values unrotated.

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i.
    key, value: [b, m, h, d], key j at position j.
    positions: None, or int [n] (n = m): query and key i at positions[i].
    max_wavelength .. rotary_layout: apply_rotary's (module docstring).
    implementation: dot_product_attention's (None or 'dense', 'xla', 'cudnn').
    common: its mask, bias, dropout, dtype and return_weights.
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype).
  """
  rope = dict(max_wavelength=max_wavelength, rope_scaling=rope_scaling, rope_factor=rope_factor,
              rope_original_max_len=rope_original_max_len, rotary_fraction=rotary_fraction,
              rotary_layout=rotary_layout)
  q_pos, k_pos = scheme.query_key_positions(query.shape[1], key.shape[1], q_offset, positions)
  query = apply_rotary(query, q_pos, **rope)
  key = apply_rotary(key, k_pos, **rope)
  return dot_product_attention(query, key, value, implementation=implementation, **common)


def _rotate(rope, x, tables, positions, origin):
  """apply_rotary by absolute position (Terms.transform_q, transform_k):
  a rotation keeps every product a function of j - i, whatever the origin."""
  del tables, origin
  return apply_rotary(x, positions, **rope)


def _terms(num_heads, **rope):
  """The block terms (scheme.py), the reference for rotary_attention:
  q_rot . k_rot, each rotated by its absolute position."""
  del num_heads
  rotate = functools.partial(_rotate, rope)
  return scheme.Terms(transform_q=rotate, transform_k=rotate)


def _check_head_dim(head_dim):
  if head_dim % 2:
    raise ValueError(f'rotary rotates pairs of features: the head size {head_dim} must be even')


@dataclasses.dataclass(frozen=True)
class RotaryOptions:
  """RoPE's options (module docstring).

  max_wavelength: the base b, a number > 0 (registry.SHARED_OPTIONS).
  rope_scaling: how a trained context is extended (SCALINGS): 'none',
    'linear' (Position Interpolation), 'ntk' or 'yarn'.
  rope_factor: s, the context extension (new context / trained context); >= 1.
  rope_original_max_len: L, the trained context length; yarn needs it > 0.
  rotary_fraction: the fraction of each head's features that turn, in (0, 1].
  rotary_layout: which features form a pair (LAYOUTS): 'interleaved',
    (2i, 2i+1), or 'halves', (i, i + r/2).
  """
  max_wavelength: float = 10000.0
  rope_scaling: str = 'none'
  rope_factor: float = 1.0
  rope_original_max_len: int = 0
  rotary_fraction: float = 1.0
  rotary_layout: str = 'interleaved'

  def __post_init__(self):
    registry.check_positive(self, 'max_wavelength')
    registry.check_choice(self, 'rope_scaling', SCALINGS)
    registry.check_choice(self, 'rotary_layout', LAYOUTS)
    factor, fraction = self.rope_factor, self.rotary_fraction
    if not registry.is_number(factor) or factor < 1:
      raise ValueError(f'attention_kwargs.rope_factor={factor!r}; must be a number >= 1 '
                       '(the context extension s: new context / trained context)')
    registry.check_int(self, 'rope_original_max_len', why='the trained context length')
    if self.rope_scaling == 'yarn' and not self.rope_original_max_len > 0:
      raise ValueError(f'attention_kwargs.rope_original_max_len={self.rope_original_max_len!r}'
                       '; rope_scaling=yarn needs the trained context length (> 0)')
    if not registry.is_number(fraction) or not 0 < fraction <= 1:
      raise ValueError(f'attention_kwargs.rotary_fraction={fraction!r}; must be in (0, 1]')


registry.register(registry.AttentionVariant(
    name='rotary',
    models=registry.TRANSFORMER_MODELS,
    fn=rotary_attention,
    terms=_terms,
    options=RotaryOptions,
    check_head_dim=_check_head_dim,
    grouped_kv=True,
    doc='rotate q and k feature pairs by position-proportional angles (RoPE, '
        'Su et al. 2021); head_dim must be even; rope_scaling linear (PI) | ntk | yarn '
        'with rope_factor extends a trained context; rotary_fraction < 1: partial RoPE; '
        'rotary_layout interleaved | halves'))
