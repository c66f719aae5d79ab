"""ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long").

No position embeddings; each head h adds -slope_h * distance to its logits,
with fixed slopes forming a geometric sequence. The paper's bias is causal
(-slope * (i - j) for j <= i); we use -slope * |j - i| so that the same
function serves bidirectional attention and equals the paper where j <= i.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import registry, scheme


def alibi_slopes(num_heads):
  """The paper's per-head slopes -> [num_heads] float32.

  For h a power of two: 2^(-8/h), 2^(-16/h), ..., 2^(-8) (start = ratio =
  2^(-8/h)). Otherwise, with p the largest power of two below h: the p
  slopes for p heads, then the first h - p of every other slope for 2p heads
  (2^(-8*1/2p), 2^(-8*3/2p), ...), as in the paper's reference code.
  """
  if not isinstance(num_heads, int) or num_heads < 1:
    raise ValueError(f'alibi needs num_heads >= 1, got {num_heads!r}')
  return head_slope(np.arange(num_heads), num_heads)


def alibi_bias(num_heads, q_len, k_len, *, q_offset=0, positions=None):
  """-slope_h * |j - (q_offset + i)| -> [1, h, q_len, k_len] float32.

  Query i sits at absolute position q_offset + i (q_offset may be traced),
  key j at position j; or both at positions[i], positions[j] (int [n], n = m).
  """
  q_pos, k_pos = scheme.query_key_positions(q_len, k_len, q_offset, positions)  # [n], [m]
  distance = jnp.abs(k_pos[None, :] - q_pos[:, None]).astype(jnp.float32)  # [n, m]
  slopes = alibi_slopes(num_heads)  # [h]
  return -slopes[None, :, None, None] * distance[None, None]  # [1, h, n, m]


def head_slope(head, num_heads: int):
  """The slope of `head` (an int array of any shape, or a traced scalar) ->
  float32, alibi_slopes' formula on the index: so that no kernel carries the
  slopes as a table."""
  p = 2 ** int(math.floor(math.log2(num_heads)))
  h = jnp.asarray(head).astype(jnp.float32)
  return jnp.where(h < p, jnp.exp2(-8.0 * (h + 1) / p), jnp.exp2(-8.0 * (2 * (h - p) + 1) / (2 * p)))


def _score(num_heads, s, b, head, q_pos, k_pos, tables):
  """s - slope_h |j - p| (scheme.Terms.score)."""
  del b, tables
  return s - head_slope(head, num_heads) * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def _terms(num_heads):
  """The terms (scheme.py): every kernel's, the dense one included."""
  return scheme.Terms(score=functools.partial(_score, num_heads), additive=True)


registry.register(registry.AttentionVariant(
    name='alibi',
    models=registry.TRANSFORMER_MODELS,
    terms=_terms,
    doc='fixed per-head linear distance penalty -slope*|j-i| (ALiBi, Press et al. '
        '2022); use with positions=none'))
