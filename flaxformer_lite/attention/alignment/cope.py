"""CoPE: contextual position encoding (Golovneva et al. 2024, eq. 3-5).

Positions are counted by the content: each key j that query i sees opens a
gate g_ij = sigmoid(q_i . k_j), and key j sits at position
  p_ij = sum_{t = j..i} g_it
from the query (the visible keys at or after j; in causal attention, those
up to i). A learned embedding e[p] of each integer position up to P - 1
(`cope_positions`), interpolated between floor(p) and ceil(p) and clipped at
P - 1, adds q_i . e[p_ij] to the logits:
  softmax_j((q_i . k_j + q_i . e[p_ij]) / sqrt(d)).
As in the paper's code, q_i . e[p] is computed once for the P integer
positions and interpolated, and the gates use the scaled logits; e [d, P]
is shared by the heads of a layer.

Dense only: p_ij sums gates over every key between j and i, across all key
blocks, so a block's scores are not a function of that block alone (a
chunked form would carry suffix sums from block to block, forward and
backward).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.softmax import softmax_weights


def cope_positions(gates):
  """gates [..., m] (0 where hidden) -> p [..., m], p_j = sum_{t >= j} g_t."""
  return jnp.flip(jnp.cumsum(jnp.flip(gates, -1), -1), -1)


def interpolated(z, positions):
  """z [..., P] (q . e[p] at the integer positions), positions [..., m] in
  [0, P - 1] -> [..., m], linear between floor and ceil."""
  floor = jnp.floor(positions)
  w = positions - floor
  lo = jnp.take_along_axis(z, floor.astype(jnp.int32), -1)
  hi = jnp.take_along_axis(z, jnp.ceil(positions).astype(jnp.int32), -1)
  return hi * w + lo * (1 - w)


def cope_attention(query, key, value, cope_embedding, *, mask=None, bias=None, dropout_rate=0.0,
                   dropout_rng=None, deterministic=True, dtype=None, return_weights=False,
                   cope_positions_max=None):
  """Args: query [b, n, h, d]; key, value [b, m, h, d]; cope_embedding
  [d, P]; mask boolean, broadcastable to [b, h, n, m]; bias added to the
  logits (after the gates). Returns [b, n, h, d] (and weights [b, h, n, m])."""
  del cope_positions_max  # carried by the embedding's shape
  dtype = dtype or query.dtype
  d, num_positions = cope_embedding.shape
  q = query.astype(dtype) / jnp.sqrt(d).astype(dtype)
  logits = jnp.einsum('bnhd,bmhd->bhnm', q, key.astype(dtype),
                      preferred_element_type=jnp.float32)
  gates = jax.nn.sigmoid(logits)
  if mask is not None:
    gates = jnp.where(mask, gates, 0.0)
  positions = jnp.minimum(cope_positions(gates), num_positions - 1)
  # In float32: small ([b, h, n, P]), and XLA:CPU has no bf16 x bf16 -> f32
  # kernel for this contraction.
  z = jnp.einsum('bnhd,dp->bhnp', q.astype(jnp.float32),
                 cope_embedding.astype(jnp.float32))  # [b, h, n, P]
  logits = logits + interpolated(z, positions)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights = softmax_weights(logits, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic, dtype=dtype)
  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value.astype(dtype))
  return (out, weights) if return_weights else out


def _params(num_heads, head_dim, kwargs):
  del num_heads
  return {'cope_embedding': ((head_dim, kwargs['cope_positions_max']),
                             jax.nn.initializers.normal(head_dim ** -0.5), ('kv', None))}


@dataclasses.dataclass(frozen=True)
class CopeOptions:
  """CoPE's option.

  cope_positions_max: P, the integer positions 0 .. P - 1 with a learned
    embedding (farther contextual positions are clipped to P - 1); >= 2.
  """
  cope_positions_max: int = 64

  def __post_init__(self):
    registry.check_int(self, 'cope_positions_max', 2,
                       'P, the integer positions with an embedding')


registry.register(registry.AttentionVariant(
    name='cope',
    models=registry.TRANSFORMER_MODELS,
    fn=cope_attention,
    options=CopeOptions,
    params=_params,
    doc='contextual positions: p_ij = sum of sigmoid(q_i.k_t) over the visible keys t from j '
        'on, q_i.e[p_ij] (interpolated, learned) added to the logits (CoPE, Golovneva et al. '
        '2024); dense only: p_ij sums gates across key blocks'))
