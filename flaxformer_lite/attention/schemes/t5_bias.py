"""T5 relative position bias (Raffel et al. 2020, section 2.1).

Each head learns one scalar per relative-position bucket; the scalar for the
bucket of (key_pos - query_pos) is added to that head's attention logits.
Buckets are exact for small distances and log-spaced up to `max_distance`
(the option `bucket_max_distance`: shaw's `max_distance` is another
quantity); farther offsets share the last bucket. The bucketing is mesh-tensorflow's
`_relative_position_bucket`, the function T5 checkpoints were trained with.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry, scheme


def t5_relative_position_bucket(relative_position, *, bidirectional=True,
                                num_buckets=32, max_distance=128):
  """Maps relative positions to bucket ids, as mesh-tensorflow / T5.

  Args:
    relative_position: int array, any shape; key_pos - query_pos.
    bidirectional: if True, half the buckets are for keys before the query
      (and the query itself), half for keys after it; if False, every key
      after the query falls in bucket 0 (meant for causal attention).
    num_buckets: total number of buckets.
    max_distance: distances at or beyond this share the farthest bucket.
  Returns:
    int32 array, same shape, values in [0, num_buckets).
  """
  n = -jnp.asarray(relative_position, jnp.int32)  # query_pos - key_pos
  ret = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  # n >= 0 now. The first half of the buckets are the distances 0..max_exact-1.
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # Log-spaced buckets, in float32 as in T5. The maximum only keeps log()
  # finite where the is_small branch is taken anyway.
  ratio = jnp.maximum(n, max_exact).astype(jnp.float32) / max_exact
  val_if_large = max_exact + (
      jnp.log(ratio) / math.log(max_distance / max_exact)
      * (num_buckets - max_exact)).astype(jnp.int32)
  val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
  return ret + jnp.where(is_small, n, val_if_large)


def t5_bias(rel_embedding, q_len, k_len, *, q_offset=0, positions=None, bidirectional=True,
            num_buckets=32, max_distance=128):
  """The bias of every head for every (query, key) pair.

  Query i sits at absolute position q_offset + i (q_offset may be traced),
  key j at position j; or both at positions[i], positions[j] (int [n], n = m).

  Args:
    rel_embedding: [num_buckets, h], one learned scalar per bucket and head.
  Returns:
    [1, h, q_len, k_len] in rel_embedding's dtype.
  """
  q_pos, k_pos = scheme.query_key_positions(q_len, k_len, q_offset, positions)  # [n], [m]
  buckets = t5_relative_position_bucket(
      k_pos[None, :] - q_pos[:, None], bidirectional=bidirectional,
      num_buckets=num_buckets, max_distance=max_distance)  # [n, m]
  values = rel_embedding[buckets]  # [n, m, h]
  return jnp.transpose(values, (2, 0, 1))[None]  # [1, h, n, m]


def _score(bucket_kw, s, b, head, q_pos, k_pos, tables):
  """s + table[h, bucket(j - p)] (scheme.Terms.score)."""
  return s + tables['t5_rows'][head, t5_relative_position_bucket(k_pos - q_pos, **bucket_kw)]


def _block_score(bucket_kw, s, block):
  """_score for a whole block (scheme.Terms.block_score).

  The offset j - p is constant along a block's diagonals: the bias is looked
  up once per diagonal (a one-hot matmul, so the table's gradient is a
  matmul too, deterministic) and spread over the block by scheme.by_offset.
  A block whose offsets all fall in one bucket (far from the diagonal, past
  bucket_max_distance) adds one number per head instead.
  """
  table = block.tables['t5_rows'].astype(jnp.float32)  # [h, buckets]
  q_pos, k_pos = block.q_pos, block.k_pos
  bq, bk = q_pos.shape[0], k_pos.shape[0]
  offsets = k_pos[0] - q_pos[0] - (bq - 1) + jnp.arange(bq + bk - 1)  # per diagonal
  buckets = t5_relative_position_bucket(offsets, **bucket_kw)

  def one_bucket(s, table):
    return block.add(s, (table @ jax.nn.one_hot(buckets[0], table.shape[1]))[:, None, None])

  def per_diagonal(s, table):
    bias = table @ jax.nn.one_hot(buckets, table.shape[1], dtype=jnp.float32).T  # [h, L]
    return block.add(s, scheme.by_offset(bias, bq, bk))

  return jax.lax.cond(jnp.all(buckets == buckets[0]), one_bucket, per_diagonal, s, table)


def _rows(params, q_pos, k_pos):
  """The bucket table per head: rel_embedding [buckets, h] -> [h, buckets]."""
  del q_pos, k_pos
  return {'t5_rows': params['rel_embedding'].astype(jnp.float32).T}


def _terms(num_heads, *, bidirectional, num_buckets, bucket_max_distance):
  """The block terms (scheme.py): every kernel's, the dense one
  included (the table's gradient summed over the blocks)."""
  del num_heads  # the table carries the heads
  bucket_kw = dict(bidirectional=bidirectional, num_buckets=num_buckets,
                   max_distance=bucket_max_distance)
  return scheme.Terms(score=functools.partial(_score, bucket_kw),
                            block_score=functools.partial(_block_score, bucket_kw),
                            prepare=_rows)


@dataclasses.dataclass(frozen=True)
class T5Options:
  """T5's options.

  num_buckets: buckets of key - query offsets (the rows of the learned
    table); >= 2, and with bidirectional even and >= 4, so that each
    direction has an exact bucket.
  bucket_max_distance: offsets at or beyond this share the farthest bucket;
    > the exact buckets per direction (num_buckets//4 bidirectional,
    num_buckets//2 otherwise), else the log-spaced range is empty.
  bidirectional: half the buckets for keys before the query, half for keys
    after it; False puts every later key in bucket 0 (causal models).
  """
  num_buckets: int = 32
  bucket_max_distance: int = 128
  bidirectional: bool = True

  def __post_init__(self):
    registry.check_bool(self, 'bidirectional')
    registry.check_int(self, 'num_buckets')
    registry.check_int(self, 'bucket_max_distance')
    num_buckets, bidirectional = self.num_buckets, self.bidirectional
    if bidirectional and (num_buckets < 4 or num_buckets % 2):
      raise ValueError(f'attention_kwargs.num_buckets={num_buckets}; with '
                       'bidirectional=True it must be even and >= 4')
    if num_buckets < 2:
      raise ValueError(f'attention_kwargs.num_buckets={num_buckets}; must be >= 2')
    max_exact = num_buckets // 4 if bidirectional else num_buckets // 2
    if self.bucket_max_distance <= max_exact:
      raise ValueError(
          f'attention_kwargs.bucket_max_distance={self.bucket_max_distance}; must be > '
          f'{max_exact} (the exact buckets per direction for num_buckets={num_buckets}, '
          f'bidirectional={bidirectional})')


registry.register(registry.AttentionVariant(
    name='t5_bias',
    models=registry.TRANSFORMER_MODELS,
    terms=_terms,
    options=T5Options,
    params=lambda num_heads, head_dim, kwargs: {
        'rel_embedding': ((kwargs['num_buckets'], num_heads),
                          nn.initializers.normal(0.02), ('relative', 'heads'))},
    doc='learned per-head bias of bucketed key-query offset (T5, Raffel et al. '
        '2020); bidirectional=False for causal-only models'))
