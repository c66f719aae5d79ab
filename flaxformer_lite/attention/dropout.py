"""Attention dropout: the keep mask as a function of (row, head, query, key).

Each (batch row, head, query index, key index) gets its keep bit from a
counter-based hash of those indices and a seed drawn from the dropout key,
the way FlashAttention derives its dropout from Philox counters: any block of
the [b, h, n, m] weights can draw its own bits, in the forward and again in
the backward, without the whole mask ever being stored. The dense kernel and
the chunked kernel (whatever its chunk size) therefore drop the same weights,
so they can be tested against each other with dropout on.

The hash is MurmurHash3's 32-bit finaliser (`_mix`), a bijection with full
avalanche, applied per row and then per key: within one (row, head, query)
the key indices map to distinct words, and a weight is kept when its word is
at or above rate * 2**32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _mix(x):
  """MurmurHash3's fmix32: uint32 -> uint32, a bijection."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def seed(rng) -> jax.Array:
  """A uint32 [] seed from a PRNG key: what travels with the kernels."""
  return jax.random.bits(rng, (), jnp.uint32)


def keep(seed_, rate: float, lead: tuple[int, ...], q_idx, k_idx):
  """Which weights dropout keeps.

  Args:
    seed_: uint32 [] (`seed`).
    rate: the dropout probability, 0 <= rate < 1 (a python float).
    lead: the leading axes, (b, h): their flat index (row * h + head) joins
      the hash, so rows and heads differ.
    q_idx, k_idx: int arrays of query and key indices that broadcast to the
      trailing shape (e.g. [n, 1] and [1, m], or a block's).
  Returns:
    bool [*lead, *broadcast(q_idx, k_idx)], True with probability 1 - rate.
  """
  q_idx, k_idx = jnp.asarray(q_idx), jnp.asarray(k_idx)
  trailing = jnp.broadcast_shapes(q_idx.shape, k_idx.shape)
  heads = jnp.arange(int(np.prod(lead)), dtype=jnp.uint32).reshape(lead + (1,) * len(trailing))
  per_head = _mix(seed_.astype(jnp.uint32) ^ _mix(heads + jnp.uint32(0x9E3779B9)))
  per_query = _mix(per_head + q_idx.astype(jnp.uint32) * jnp.uint32(0x9E3779B1))
  word = _mix(per_query ^ (k_idx.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)))
  threshold = np.uint32(min(round(rate * 2.0**32), 2**32 - 1))
  return word >= threshold


def apply(weights, rate: float, rng, deterministic: bool, q_idx=None, k_idx=None):
  """Attention dropout on weights [b, h, n, m] (the paper's: a weight is
  zeroed with probability `rate`, the rest scaled by 1 / (1 - rate)); the
  identity when deterministic or rate 0.

  q_idx, k_idx: the query and key index of each weight (int arrays that
  broadcast to the trailing axes; the axes before them are the (b, h) of
  `keep`); default arange(n) [n, 1] and arange(m) [1, m]. A form that lays
  the weights out otherwise (local's blocks) passes its own, so that every
  form drops the same weights.
  """
  if deterministic or rate == 0.0:
    return weights
  if rng is None:
    raise ValueError('attention dropout needs dropout_rng when deterministic=False')
  n, m = weights.shape[-2:]
  q_idx = jnp.arange(n)[:, None] if q_idx is None else q_idx
  k_idx = jnp.arange(m)[None, :] if k_idx is None else k_idx
  return drop(weights, seed(rng), rate, q_idx, k_idx)


def drop(x, seed_, rate: float, q_idx, k_idx):
  """x with each weight kept (`keep`) scaled by 1 / (1 - rate), the others 0:
  the axes of x before broadcast(q_idx, k_idx)'s are keep's (b, h). The
  chunked kernel calls it per block with the block's indices."""
  q_idx, k_idx = jnp.asarray(q_idx), jnp.asarray(k_idx)
  trailing = len(jnp.broadcast_shapes(q_idx.shape, k_idx.shape))
  kept = keep(seed_, rate, x.shape[:x.ndim - trailing], q_idx, k_idx)
  return jnp.where(kept, x / (1.0 - rate), 0).astype(x.dtype)
