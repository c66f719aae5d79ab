"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via
the Lens of Receptive Field Analysis", section 5).

The inner product of two sinusoidal position embeddings of d' features,
  p_i . p_j = sum_{k=1..d'/2} cos((i - j) / 10000^(2k/d')),
is a function of i - j that decays, roughly logarithmically, from d'/2 at
distance 0. Sandwich adds it to the logits with no parameters, shifted to 0
at distance 0 and compressed per head as ALiBi's slopes are: head h = 1..H
adds (p_i . p_j - d'/2) / (8h / H). (A constant per row, such as the shift,
does not change the softmax: NeMo's form, which sums k = 1..d'/2 - 1, gives
the same weights.)

Written once as block terms (scheme.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import registry, scheme


def sandwich_bias(offset, num_heads: int, dim: int):
  """offset float [L] (i - j) -> [h, L]: (p_i . p_j - d'/2) / (8h / H)."""
  inv = 10000.0 ** (-2.0 * np.arange(1, dim // 2 + 1) / dim)  # [d'/2]
  inner = jnp.sum(jnp.cos(offset[:, None] * inv[None, :].astype(np.float32)), -1)  # [L]
  compress = 8.0 * np.arange(1, num_heads + 1, dtype=np.float32) / num_heads  # [h]
  return (inner[None, :] - dim / 2) / compress[:, None]


def _score(dim, num_heads, s, b, head, q_pos, k_pos, tables):
  """s + the Sandwich bias of i - j for head h (scheme.Terms.score)."""
  offset = (q_pos - k_pos).astype(jnp.float32)
  inner = jnp.sum(jnp.cos(offset[..., None] * tables['sandwich_frequencies'][head]), -1)
  compress = 8.0 * (head + 1).astype(jnp.float32) / num_heads
  return s + (inner - dim / 2) / compress


def _block_score(dim, s, block):
  """_score for a whole block, looked up once per diagonal (block_score)."""
  q_pos, k_pos = block.q_pos, block.k_pos
  bq, bk = q_pos.shape[0], k_pos.shape[0]
  # diagonal t = j - i + bq - 1 of the block has i - j = q_pos[0] - k_pos[0] + bq - 1 - t
  offset = (q_pos[0] - k_pos[0] + bq - 1 - jnp.arange(bq + bk - 1)).astype(jnp.float32)
  return block.add(s, scheme.by_offset(sandwich_bias(offset, s.shape[1], dim), bq, bk))


def _frequencies(num_heads, dim, params, q_pos, k_pos):
  """The embedding's frequencies 10000^(-2t/d'), t = 1..d'/2, as a table
  per head [h, d'/2] (a fused kernel takes its constants as inputs)."""
  del params, q_pos, k_pos
  inv = (10000.0 ** (-2.0 * np.arange(1, dim // 2 + 1) / dim)).astype(np.float32)
  return {'sandwich_frequencies': np.broadcast_to(inv, (num_heads, dim // 2))}


def _terms(num_heads, *, sandwich_dim):
  return scheme.Terms(score=functools.partial(_score, sandwich_dim, num_heads),
                            block_score=functools.partial(_block_score, sandwich_dim),
                            prepare=functools.partial(_frequencies, num_heads, sandwich_dim))


@dataclasses.dataclass(frozen=True)
class SandwichOptions:
  """Sandwich's option.

  sandwich_dim: d', the features of the sinusoidal embeddings of i and j
    (sine and cosine pairs): even, >= 2.
  """
  sandwich_dim: int = 128

  def __post_init__(self):
    registry.check_int(self, 'sandwich_dim', 2, "d', the sinusoidal embedding's features")
    if self.sandwich_dim % 2:
      raise ValueError(f"attention_kwargs.sandwich_dim={self.sandwich_dim}; must be even "
                       '(sine and cosine pairs)')


registry.register(registry.AttentionVariant(
    name='sandwich',
    models=registry.TRANSFORMER_MODELS,
    terms=_terms,
    options=SandwichOptions,
    doc="parameter-free bias: the inner product of sinusoidal embeddings of i and j "
        "(sandwich_dim features), per-head compressed as ALiBi (Sandwich, Chi et al. 2023); "
        'use with positions=none'))
