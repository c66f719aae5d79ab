"""Block-wise attention in O(n) memory, for every scheme that can say what
it changes in one block of scores.

`attend` is the entry point: it checks its arguments, plans the blocks and
runs the kernel, kernels/blockwise.py (an online softmax over blocks of
`chunk_size` queries and keys, a `jax.custom_vjp` whose backward recomputes
each block's probabilities; the hidden blocks skipped, the whole ones run
without the mask's select). This module holds what a scheme uses to
describe its blocks: `BlockTerms` and the position helpers.

A scheme describes its blocks with `BlockTerms`, FlexAttention's score_mod
kept to JAX. The kernels compute the q.k product themselves
(kernels/product.py); each field says what the scheme changes, and each is
optional:
  prepare(params, q_pos int [nq, bq], k_pos int [nk, bk]) -> tables, what
      the blocks read, made once per call from the scheme's parameters
      (Transformer-XL's projected distance rows); q_pos and k_pos hold the
      call's queries and keys as the kernel blocks them, a block a row,
      padding included. None: the tables are the parameters.
  transform_q(q [b, L, h, d], tables, q_pos [L], origin) -> [b, L, h, d],
  transform_k(k [b, L, g, d], tables, k_pos [L], origin) -> [b, L, g, d]:
      a map of each query and key by its position (rotary's rotation),
      before the product. origin (int32, [] or [L]) is the first key of the
      block each row meets: a map whose products depend on q_pos - k_pos
      only may measure positions from it (xPos, whose factors measured from
      0 leave float32's range). transform_k sees the keys' own g heads
      (grouped-query attention). The queries are mapped as each block reads
      them; the keys too under a gradient (mapped copies of q and k would
      be two more [b, n, h, d] arrays in the forward and two, their
      gradients, in the backward), and without one (evaluation, prefill)
      once for the whole call, beside the copy the forward keeps there
      anyway (blockwise._heads_first).
  score(s, q_pos, k_pos, head, tables) -> s: the scheme's elementwise change
      to scaled q.k scores (FlexAttention's score_mod), the one form every
      kernel can run, the Pallas kernel and the dense reference included:
      s float32, q_pos int [.., 1] (queries down), k_pos int [1, ..] (keys
      across), head the query head (an index array [h, 1, 1] here, the
      program's head in a fused kernel), tables per head [h, ...], read as
      tables[name][head] or tables[name][head, index].
  additive: True where score(s, ...) = s + score(0, ...), a bias (ALiBi,
      KERPLE): the kernels then make the bias once for the batch and add it
      as Block.add does (checked on random scores at the first lookup).
  block_score(s float32 [b, h, bq, bk], block) -> float32 [b, h, bq, bk]: the
      same change for a whole block at once, where that is faster (one
      lookup per diagonal: T5's buckets) or needs the block's q and k
      (Transformer-XL's and DeBERTa's position terms, Shaw's); block a
      product.Block (the block's mapped q and k, positions [bq] and [bk],
      tables). The blockwise kernel runs it in place of `score`; a scheme
      with both is tested equal. A bias that is the same for every row of
      the batch goes in by block.add(s, bias [h | 1, bq | 1, bk | 1]): the
      kernel's add, whose gradient sums the batch by adds, not by XLA:CPU's
      slow reduction over the leading axis.
  values(p float32 [b, h, bq, bk], v [b, bk, h, dv], tables, q_pos, k_pos)
      -> float32 [b, h, bq, dv], what the block adds to the output (linear in p);
  uniform(value [b, m, h, dv], tables, q_pos [n], m) -> [b, n, h, dv], the
      output of a query that sees no key (the dense path's rule: uniform
      weights, see schemes/dot_product.py);
  product(q [b, bq, h, d], k [b, bk, h, d], tables) -> float32 [b, h, bq, bk]:
      for the alignment family only, a score of a query and a key that is
      not their product (Bahdanau's v . tanh(q + k)), in place of q.k.
The backward pass differentiates the scores and `values` one block at a
time (`jax.vjp`), so a scheme writes its forward math only. Gradients of
the tables are summed over the blocks in a fixed order (deterministic on
every backend) and reach the parameters through `prepare` by autodiff.

Attention dropout (FlashAttention's): each block draws its keep bits from
dropout.py's hash of (row, head, query, key), in the forward and again in
the backward, so no mask is stored and the dense kernel drops the same
weights. The row sums use the undropped probabilities; the block's values
term gets the dropped ones, p * keep / (1 - rate).

Keys and values may have fewer heads than the queries (grouped-query
attention, g dividing h): query head i reads key/value head i // (h / g).
Each block copies its g heads to h, a block-sized copy, never the whole
keys and values (nor a decoding cache).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dropout
from flaxformer_lite.attention.kernels import blockwise
# Re-exported: schemes and tests read them here. The kernel reads the
# constants from blockwise, so a change to them goes there.
from flaxformer_lite.attention.kernels.blockwise import (  # noqa: F401
    STAIRCASE_ROWS, UNMASKED_MIN_SCORES, unmasked_key_blocks, unmasked_query_blocks)
from flaxformer_lite.attention.kernels.product import dot_values, repeat_heads  # noqa: F401
from flaxformer_lite.attention.masks import Mask, MaskSpec, pad_to

DEFAULT_CHUNK_SIZE = 512


def mean_values(value, tables, q_pos, m):
  """Uniform weights over all m keys: the mean value, for every query -> [b, n, h, dv]."""
  del tables, m
  mean = jnp.mean(value.astype(jnp.float32), axis=1, keepdims=True)  # [b, 1, h, dv]
  return jnp.broadcast_to(mean, (value.shape[0], q_pos.shape[0]) + value.shape[2:])


def _read_skewed(padded, n: int, length: int):
  """[..., n * (L + 1)] (n rows of L + 1, flat) -> [..., n, L], reading with
  stride L so that row i starts i places further left than row i - 1."""
  flat = jax.lax.slice_in_dim(padded, n - 1, n - 1 + n * length, axis=-1)
  return flat.reshape(padded.shape[:-1] + (n, length))


def rel_shift(x):
  """x [..., n, L] -> [..., n, L - n + 1], out[..., i, j] = x[..., i, j - i + n - 1].

  Column c of x holds the key-minus-query offset c - (n - 1); the output
  puts each at its key. Transformer-XL's relative shift (Dai et al. 2019,
  appendix B; the skew of Music Transformer's relative attention): one pad,
  one reshape, slices, never a gather, so its derivative is slices and pads
  too (deterministic table gradients).
  """
  n, length = x.shape[-2:]
  lead = x.shape[:-2]
  x = jnp.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, 1)])  # rows of length L + 1
  return _read_skewed(x.reshape(lead + (-1,)), n, length)[..., :length - n + 1]


def by_offset(x, bq: int, bk: int):
  """x [..., bq + bk - 1], indexed by j - i + bq - 1 -> [..., bq, bk] with
  out[..., i, j] = x[..., j - i + bq - 1]: a value per diagonal of a block,
  spread over the block.

  rel_shift of x tiled over the rows, with the one row padded before the
  tile: padding the tiled rows instead leaves XLA a block-sized buffer to
  fill (t5_bias's chunked temp memory, benchmarks/relative_attention.py).
  """
  length = bq + bk - 1
  lead = x.shape[:-1]
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 1)])  # [..., L + 1]
  tiled = jnp.broadcast_to(x[..., None, :], lead + (bq, length + 1)).reshape(lead + (-1,))
  return _read_skewed(tiled, bq, length)[..., :bk]


def query_key_positions(n: int, m: int, q_offset=0, positions=None):
  """(q_pos [n], k_pos [m]): queries at q_offset + 0..n-1 and keys at 0..m-1,
  or both at `positions` (int [n], n = m: self-attention with positions as
  data, such as randomized positions)."""
  if positions is None:
    return q_offset + jnp.arange(n), jnp.arange(m)
  positions = jnp.asarray(positions)
  return positions, positions


def distance_range(q_pos, k_pos):
  """Every query-minus-key distance of a call, largest first, for a scheme
  that looks up one row per distance in `prepare` and slices a block's rows
  with `distance_slice`: q_pos, k_pos the call's positions, ranges (as
  `prepare` gets them: any shape, in order) -> (top float32 [], distances
  int32 [n + m - 1]), distances[r] = top - r. `top` is a float so that it
  can travel with the tables (its gradient is 0); exact below 2**24."""
  q_pos, k_pos = q_pos.reshape(-1), k_pos.reshape(-1)
  top = q_pos[-1] - k_pos[0]
  return top.astype(jnp.float32), top - jnp.arange(q_pos.shape[0] + k_pos.shape[0] - 1)


def distance_slice(rows, top, q_pos, k_pos):
  """The bq + bk - 1 rows [L, ...] of one block's distances q_pos - k_pos,
  largest first, from rows laid out by `distance_range` (its `top`). A slice
  that would leave the table is moved inside it, which a table whose end
  rows repeat may rely on (jax's dynamic_slice would wrap a negative start)."""
  bq, bk = q_pos.shape[0], k_pos.shape[0]
  first = top.astype(jnp.int32) - (q_pos[0] + bq - 1 - k_pos[0])
  first = jnp.clip(first, 0, rows.shape[0] - (bq + bk - 1))
  return jax.lax.dynamic_slice_in_dim(rows, first, bq + bk - 1, axis=0)


@dataclasses.dataclass(frozen=True)
class BlockTerms:
  """What a scheme changes in a block (module docstring); None: nothing. A
  `values` other than dot_values adds to what a row's weights give, so it
  brings its own `uniform` (what a row that sees no key gets): with
  mean_values such rows would silently differ from the dense path's."""
  score: Callable[..., Any] | None = None  # elementwise (module docstring)
  additive: bool = False  # score(s) = s + score(0): a bias
  block_score: Callable[..., Any] | None = None  # a whole block at once
  prepare: Callable[..., Any] | None = None  # None: the tables are the parameters
  transform_q: Callable[..., Any] | None = None
  transform_k: Callable[..., Any] | None = None
  values: Callable[..., Any] = dot_values
  uniform: Callable[..., Any] | None = None  # None: mean_values, for dot_values only
  product: Callable[..., Any] | None = None  # None: the kernel's q.k

  def __post_init__(self):
    if self.uniform is None:
      if self.values is not dot_values:
        raise TypeError(f'BlockTerms(values={self.values!r}) needs uniform=: the output of a '
                        'query that sees no key under that values term (dot_values: '
                        'mean_values)')
      object.__setattr__(self, 'uniform', mean_values)


def attend(query, key, value, terms: BlockTerms = BlockTerms(), params=None, *,
           mask: MaskSpec | Mask | None = None, q_offset=0, chunk_size: int = DEFAULT_CHUNK_SIZE,
           dtype=None, dropout_rate: float = 0.0, dropout_rng=None, return_lse: bool = False,
           dropout_first_query: int = 0):
  """Attention over blocks, never holding an [n, m] array.

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i (already
      scaled if the variant's scores are); key [b, m, g, d]; value
      [b, m, g, dv], g dividing h (g < h: grouped-query attention).
    terms: the scheme's block terms (BlockTerms), called with h heads.
    params: a pytree of arrays (the scheme's parameters), or None; the
      blocks read what terms.prepare makes of them.
    mask: a MaskSpec or a Mask (None: every key visible).
    q_offset: int, may be traced (decoding with a cache).
    chunk_size: rows and columns per block; lengths need not divide it.
    dropout_rate, dropout_rng: attention dropout (dropout.py's keep mask);
      off when the rate is 0 or the key None.
    return_lse: also return each row's log-sum-exp of its scores, so that
      attention over another set of keys can be merged with this one
      (`merge`); it is differentiable, and a row that sees no key has -inf.
    dropout_first_query: the index dropout's hash gives query 0, for a call
      on the queries [s, s + n) of a longer sequence that must drop what
      the whole sequence's call drops.
  Returns:
    [b, n, h, dv] in `dtype` (default: query's dtype); with return_lse,
    (that, lse float32 [b, h, n]).
  """
  dtype = dtype or query.dtype
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  b, n, h, _ = query.shape
  m, g = key.shape[1], key.shape[2]
  if h % g:
    raise ValueError(f'{g} key/value heads do not divide {h} query heads')
  chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f'chunk_size={chunk_size!r}; must be an int >= 1')
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f'dropout_rate={dropout_rate!r}; must be in [0, 1)')
  rate = dropout_rate if dropout_rng is not None else 0.0
  seed = dropout.seed(dropout_rng) if rate else jnp.uint32(0)
  mask = mask if mask is not None else MaskSpec()
  # A Mask may hide any row: the uniform rule's output is always made.
  may_hide_rows = isinstance(mask, Mask) or mask.may_hide_rows(n, m, q_offset)
  blocks = blockwise.plan(mask, q_offset, b, h, n, m, chunk_size, rate, dropout_first_query)
  n_pad, m_pad = blocks.nq * blocks.bq, blocks.nk * blocks.bk
  if isinstance(mask, Mask):
    mask = blockwise.mask_blocks(mask, q_offset, b, h, blocks)
  else:
    mask = mask.padded(n_pad, m_pad)
  q_offset = jnp.asarray(q_offset, jnp.int32)
  tables = blockwise.prepare(blocks, terms, params, q_offset)
  out, lse = blockwise.attention(blocks, terms, pad_to(query, 1, n_pad), pad_to(key, 1, m_pad),
                                 pad_to(value, 1, m_pad), tables, mask, q_offset, seed)
  out, lse = out[:, :n], lse[:, :, :n]
  if return_lse:  # merge() weighs a row that sees no key by exp(-inf) = 0
    return out.astype(dtype), lse
  if not may_hide_rows:
    return out.astype(dtype)
  empty = jnp.isneginf(lse).transpose(0, 2, 1)[..., None]  # [b, n, h, 1]
  # A query that sees no key gets the dense path's uniform weights; that
  # output is cheap (a mean over keys) and differentiated by plain autodiff.
  # Heads of a group share their keys, so they share this output too.
  fallback = repeat_heads(terms.uniform(value, tables, q_offset + jnp.arange(n), m), h)
  return jnp.where(empty, fallback.astype(jnp.float32), out).astype(dtype)


def merge(out_a, lse_a, out_b, lse_b):
  """Attention over two disjoint sets of keys, merged into attention over
  both: out_a, out_b [b, n, h, dv], each normalised over its own keys, with
  their rows' log-sum-exps lse_a, lse_b float32 [b, h, n] (-inf: the row
  sees none of that set's keys) -> float32 [b, n, h, dv]. The
  weights are exp(lse - lse_all), each set's share of the row's sum; a row
  that sees neither set gets 0."""
  top = jax.lax.stop_gradient(jnp.maximum(lse_a, lse_b))  # any value: the shares do not move
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  wa, wb = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
  total = jnp.where(wa + wb > 0, wa + wb, 1.0)
  share = lambda w: (w / total).transpose(0, 2, 1)[..., None]  # noqa: E731
  return out_a.astype(jnp.float32) * share(wa) + out_b.astype(jnp.float32) * share(wb)
