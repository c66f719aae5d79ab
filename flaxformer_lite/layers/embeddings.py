"""Token embeddings and absolute positions."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

POSITIONS = ('sinusoidal', 'learned', 'none')


def sinusoidal_positions(length: int, features: int, *, offset=0,
                         max_timescale: float = 10000.0):
  """The 2017 paper's table, sin/cos interleaved.

  PE[p, 2i] = sin(p / max_timescale^(2i/features)),
  PE[p, 2i+1] = cos(p / max_timescale^(2i/features)), p = offset + 0..length-1.

  Returns [length, features] float32. `offset` may be traced (decoding).
  """
  return sinusoid(offset + jnp.arange(length), features, max_timescale=max_timescale)


def sinusoid(positions, features: int, *, max_timescale: float = 10000.0):
  """The table's rows at int positions [...] -> float32 [..., features]."""
  if features % 2:
    raise ValueError(f'sinusoidal positions need an even feature size, got {features}')
  inv_freq = max_timescale ** (-np.arange(0, features, 2, dtype=np.float32) / features)
  angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., f/2]
  # stack on a new last axis then flatten: sin, cos, sin, cos, ...
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(
      angles.shape[:-1] + (features,))


class AddPositions(nn.Module):
  """Adds absolute positions to [b, n, f] inputs.

  kind: 'sinusoidal' (fixed), 'learned' ([max_len, f] table) or 'none'.
  With `decode=True`, remembers how many positions were consumed in the
  'cache' collection, so that step t gets position t. `positions` [b, n]
  (int) gives each token its own (packed rows: each example from 0).
  """
  kind: str = 'sinusoidal'
  max_len: int = 512
  decode: bool = False

  @nn.compact
  def __call__(self, x, positions=None):
    if self.kind not in POSITIONS:
      raise ValueError(f'positions={self.kind!r}; valid: {", ".join(POSITIONS)}')
    if self.kind == 'none':
      return x
    length, features = x.shape[-2], x.shape[-1]
    offset = 0
    if self.decode:
      initialized = self.has_variable('cache', 'position_index')
      consumed = self.variable('cache', 'position_index', lambda: jnp.array(0, jnp.int32))
      if initialized:
        offset = consumed.value
        consumed.value = offset + length
    index = offset + jnp.arange(length) if positions is None else positions  # [n] | [b, n]
    if self.kind == 'sinusoidal':
      pos = sinusoid(index, features)
    else:
      table = self.param('pos_embedding', nn.initializers.normal(stddev=0.02),
                         (self.max_len, features))
      pos = jnp.take(table, index, axis=0)
    return x + pos.astype(x.dtype)


class Embed(nn.Module):
  """Token embedding shared by encoder, decoder and the output softmax.

  `__call__`: ids [b, n] -> [b, n, f], scaled by sqrt(f).
  `attend`: [b, n, f] -> logits [b, n, vocab] with the same (unscaled) table.
  Initialised with stddev f^-0.5, so the scaled embedding has unit variance
  (or `stddev`, and `scale=False`, as GPT-2).
  """
  vocab_size: int
  features: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  stddev: float | None = None  # None: features ** -0.5
  scale: bool = True  # False: no sqrt(f) on the way in (GPT-2)
  multiplier: float = 0.0  # > 0: the embedding times this instead (model.embed_scale)

  def setup(self):
    stddev = self.features ** -0.5 if self.stddev is None else self.stddev
    self.embedding = self.param('embedding', nn.initializers.normal(stddev=stddev),
                                (self.vocab_size, self.features), self.param_dtype)

  def __call__(self, ids):
    x = jnp.take(self.embedding, ids, axis=0).astype(self.dtype)
    if self.multiplier:
      return x * jnp.asarray(self.multiplier, self.dtype)
    return x * jnp.sqrt(self.features).astype(self.dtype) if self.scale else x

  def attend(self, x):
    return jnp.einsum('bnf,vf->bnv', x, self.embedding.astype(self.dtype))
