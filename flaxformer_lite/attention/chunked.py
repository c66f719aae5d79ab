"""Block-wise attention in O(n) memory, for every variant that can say what
it adds to one block of scores.

Queries go in blocks of `chunk_size` rows, keys in blocks of `chunk_size`
columns. For each query block an online softmax (Milakov & Gimelshein 2018)
runs over the key blocks it can see: a running row maximum, a running sum of
exp(s - max) and a running output, each rescaled when the maximum grows. Key
blocks that the causal or window part of the mask hides entirely are skipped
(the loop's bounds are computed, not masked), so causal attention does about
half the work and a window O(n * window).

The backward pass is a `jax.custom_vjp` in FlashAttention-2's order: key
blocks outside, query blocks inside; each block's probabilities are
recomputed from q, k and the saved per-row log-sum-exp, so nothing of size
[n, m] is stored. With delta_i = dO_i . O_i (the output is linear in the
probabilities, so this is sum_j p_ij dp_ij), ds = p * (dp - delta).

A variant describes its block with `BlockTerms`:
  logits(q [b, bq, h, d], k [b, bk, h, d], params, q_pos [bq], k_pos [bk])
      -> float32 [b, h, bq, bk], the scores of the block's pairs;
  values(p float32 [b, h, bq, bk], v [b, bk, h, dv], params, q_pos, k_pos)
      -> float32 [b, h, bq, dv], what the block adds to the output (linear in p);
  uniform(value [b, m, h, dv], params, q_pos [n], m) -> [b, n, h, dv], the
      output of a query that sees no key (the dense path's rule: uniform
      weights, see dot_product.py);
  rotate(x [b, L, h, d], pos [L]) -> [b, L, h, d], or None: a map of each
      query and key by its own position (rotary's rotation), which `logits`
      receives applied. Under a gradient it is applied to each block as it
      is read (rotated copies of q and k would be two more [b, n, h, d]
      arrays in the forward and two, their gradients, in the backward);
      without one (evaluation, prefill) once to all queries and keys, beside
      the copies the forward keeps there anyway (_heads_first).
The backward pass differentiates `logits` and `values` one block at a time
(`jax.vjp`), so a variant writes its forward math only. Gradients of
`params` (position tables) are summed over the blocks in a fixed order:
deterministic on every backend. The q.k and p.v products of the blocks
(`dot_logits`, `dot_values`) take dO and ds in the inputs' dtype in the
backward, as FlashAttention-2 does: bf16 matmuls, float32 accumulation.

Attention dropout (FlashAttention's): each block draws its keep bits from
dropout.py's hash of (row, head, query, key), in the forward and again in
the backward, so no mask is stored and the dense kernel drops the same
weights. The row sums use the undropped probabilities; the block's values
term gets the dropped ones, p * keep / (1 - rate).

Keys and values may have fewer heads than the queries (grouped-query
attention, g dividing h): query head i reads key/value head i // (h / g).
Each block copies its g heads to h, a block-sized copy, never the whole
keys and values (nor a decoding cache).

Blocks that the causal or window parts hide are outside the loops' bounds;
blocks that key padding, query padding or segments hide for every row of
the batch are skipped by a `lax.cond` (packed rows do no cross-example work
where a whole block is cross-example). Large blocks that every pair sees
(below the causal diagonal, and where padding leaves them whole in every
row: a model's calls always carry its PAD mask) run in a loop of their own
without the mask's select (`unmasked_key_blocks`, `unmasked_query_blocks`),
and the blocks on the causal diagonal as a staircase of row steps
(`_staircase`) that leaves out most of their hidden half.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dropout
from flaxformer_lite.attention.masks import MaskSpec, pad_to

DEFAULT_CHUNK_SIZE = 512


# _one_query: a single query row against a block of keys is a matrix-vector
# product, bound by reading the block. As a product and a sum, XLA reads the
# block where it lies in the cache; as a dot, XLA:CPU first copies it out of
# the cache and transposes it to [b, h, bk, d], which made a decoding step at
# the end of a 16k cache 1.7x the dense step (benchmarks/decode_step.py).


@jax.custom_vjp
def dot_logits_(q, k):
  """q . k -> float32 [b, h, bq, bk], accumulated in float32; its gradient
  takes ds in the inputs' dtype, as FlashAttention-2's backward does: in
  bfloat16 the backward's matmuls run at the bfloat16 rate and accumulate
  in float32 (preferred_element_type), and the gradients are as accurate
  as the dense bfloat16 path's (tests/attention/test_chunked.py)."""
  if q.shape[1] == 1:  # one query (a decoding step): _one_query
    return jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), -1).transpose(0, 2, 1)[:, :, None]
  return jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)


def _dot_logits_fwd(q, k):
  return dot_logits_(q, k), (q, k)


def _dot_logits_bwd(res, ds):
  q, k = res
  ds = ds.astype(q.dtype)
  dq = jnp.einsum('bhqk,bkhd->bqhd', ds, k, preferred_element_type=jnp.float32)
  dk = jnp.einsum('bhqk,bqhd->bkhd', ds, q, preferred_element_type=jnp.float32)
  return dq.astype(q.dtype), dk.astype(k.dtype)


dot_logits_.defvjp(_dot_logits_fwd, _dot_logits_bwd)


@jax.custom_vjp
def dot_values_(p, v):
  """sum_j p_ij v_j: p float32 [b, h, bq, bk], v [b, bk, h, dv] -> float32
  [b, h, bq, dv]; p is rounded to v's dtype, and the gradient takes dO in
  v's dtype (dot_logits_)."""
  if p.shape[2] == 1:  # one query (a decoding step): _one_query
    weights = p[:, :, 0].astype(v.dtype).astype(jnp.float32).transpose(0, 2, 1)[..., None]
    return jnp.sum(weights * v.astype(jnp.float32), 1)[:, :, None]  # [b, h, 1, dv]
  return jnp.einsum('bhqk,bkhd->bhqd', p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _dot_values_fwd(p, v):
  return dot_values_(p, v), (p, v)


def _dot_values_bwd(res, d_out):
  p, v = res
  d_out = d_out.astype(v.dtype)
  dp = jnp.einsum('bhqd,bkhd->bhqk', d_out, v, preferred_element_type=jnp.float32)
  dv = jnp.einsum('bhqk,bhqd->bkhd', p.astype(v.dtype), d_out,
                  preferred_element_type=jnp.float32)
  return dp.astype(p.dtype), dv.astype(v.dtype)


dot_values_.defvjp(_dot_values_fwd, _dot_values_bwd)


def _bf16_backward(x) -> bool:
  """Whether the products' custom backward (dO, ds in the inputs' dtype)
  differs from autodiff's: inputs under 32 bits. In float32 they are the
  same, and plain autodiff also gives forward mode (jax.linearize, jvp),
  which a custom_vjp refuses: the dense path from_terms.py derives runs the
  same block terms and is linearised by tests and users."""
  return jnp.dtype(x.dtype).itemsize < 4


def dot_logits(q, k, params, q_pos, k_pos):
  """q . k (queries already scaled): -> float32 [b, h, bq, bk]."""
  del params, q_pos, k_pos
  return dot_logits_(q, k) if _bf16_backward(q) else dot_logits_.fun(q, k)


def dot_values(p, v, params, q_pos, k_pos):
  """sum_j p_ij v_j: p [b, h, bq, bk] -> float32 [b, h, bq, dv]."""
  del params, q_pos, k_pos
  return dot_values_(p, v) if _bf16_backward(v) else dot_values_.fun(p, v)


def mean_values(value, params, q_pos, m):
  """Uniform weights over all m keys: the mean value, for every query -> [b, n, h, dv]."""
  del params, m
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


def add_head_bias(s, bias):
  """s [b, h, bq, bk] + bias [h, bq, bk] (a position bias shared by the
  batch), the bias as b copies, not a broadcast: the transpose is then adds
  of slices, not XLA:CPU's slow reduction over the leading axis
  (t5_bias.broadcast_batch)."""
  return s + jnp.concatenate([bias.astype(s.dtype)[None]] * s.shape[0], axis=0)


def distance_range(n: int, m: int, q_offset, chunk_size):
  """Every query-minus-key distance a (padded) block of this call can meet,
  largest first: (top float32 [], distances int32 [n + m - 1 + 2 chunk]),
  distances[r] = top - r. For variants that look up one row per distance
  once per call and slice a block's rows with `distance_slice`. `top` is a
  float so that it can travel with the block parameters (its gradient is 0);
  exact below 2**24."""
  pad = chunk_size or DEFAULT_CHUNK_SIZE  # blocks may run past n and m by < a chunk
  top = q_offset + n - 1 + pad  # q_offset may be traced
  return jnp.asarray(top, jnp.float32), top - jnp.arange(n + m - 1 + 2 * pad)


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
  """What a variant computes for one block (module docstring). A `values`
  other than dot_values adds to what a row's weights give, so it brings its
  own `uniform` (what a row that sees no key gets): with mean_values such
  rows would silently differ from the dense path's."""
  logits: Callable[..., Any] = dot_logits
  values: Callable[..., Any] = dot_values
  uniform: Callable[..., Any] | None = None  # None: mean_values, for dot_values only
  rotate: Callable[..., Any] | None = None

  def __post_init__(self):
    if self.uniform is None:
      if self.values is not dot_values:
        raise TypeError(f'BlockTerms(values={self.values!r}) needs uniform=: the output of a '
                        'query that sees no key under that values term (dot_values: '
                        'mean_values)')
      object.__setattr__(self, 'uniform', mean_values)


def attend(query, key, value, terms: BlockTerms = BlockTerms(), params=None, *,
           mask: MaskSpec | None = None, q_offset=0, chunk_size: int = DEFAULT_CHUNK_SIZE,
           dtype=None, dropout_rate: float = 0.0, dropout_rng=None, return_lse: bool = False,
           dropout_first_query: int = 0):
  """Attention over blocks, never holding an [n, m] array.

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i (already
      scaled if the variant's scores are); key [b, m, g, d]; value
      [b, m, g, dv], g dividing h (g < h: grouped-query attention).
    terms: the variant's block math (BlockTerms), called with h heads.
    params: a pytree of arrays `terms` uses (position tables), or None.
    mask: a MaskSpec (None: every key visible).
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
  bq, bk = min(chunk_size, n), min(chunk_size, m)
  nq, nk = -(-n // bq), -(-m // bk)
  mask = mask if mask is not None else MaskSpec()
  may_hide_rows = mask.may_hide_rows(n, m, q_offset)
  rise = _staircase(mask, q_offset, n, m, bq, bk, b * h * bq * bk)
  mask = mask.padded(nq * bq, nk * bk)
  q_offset = jnp.asarray(q_offset, jnp.int32)
  kernel = _kernel(terms, n, m, bq, bk, nq, nk, rate, rise, dropout_first_query)
  out, lse = kernel(pad_to(query, 1, nq * bq), pad_to(key, 1, nk * bk),
                    pad_to(value, 1, nk * bk), params, mask, q_offset, seed)
  out, lse = out[:, :n], lse[:, :, :n]
  if return_lse:  # merge() weighs a row that sees no key by exp(-inf) = 0
    return out.astype(dtype), lse
  if not may_hide_rows:
    return out.astype(dtype)
  empty = jnp.isneginf(lse).transpose(0, 2, 1)[..., None]  # [b, n, h, 1]
  # A query that sees no key gets the dense path's uniform weights; that
  # output is cheap (a mean over keys) and differentiated by plain autodiff.
  # Heads of a group share their keys, so they share this output too.
  fallback = repeat_heads(terms.uniform(value, params, q_offset + jnp.arange(n), m), h)
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


def repeat_heads(x, h: int):
  """[b, L, g, d] -> [b, L, h, d]: group i's head for query heads i*h/g ..
  (i+1)*h/g - 1 (the identity when g = h)."""
  g = x.shape[2]
  return x if g == h else jnp.repeat(x, h // g, axis=2)


def _visible(mask: MaskSpec, qs, ks, bq, bk, q_offset, n, m):
  """bool [b | 1, h | 1, bq, bk]: the block's pairs that may attend, real
  keys (< m) and real queries (< n) only."""
  real = ((qs + jnp.arange(bq))[:, None] < n) & ((ks + jnp.arange(bk))[None, :] < m)
  ok = mask.block(qs, ks, bq, bk, q_offset)
  return real[None, None] if ok is None else ok & real[None, None]


def _unless_hidden(mask: MaskSpec, visible, compute, carry):
  """compute(carry), or carry itself when no pair of the block is visible
  (`visible` bool [..., bq, bk]) and the mask has arrays (padding, segments:
  the causal and window parts are already in the loop bounds)."""
  if not mask.has_arrays():
    return compute(carry)
  return jax.lax.cond(jnp.any(visible), compute, lambda c: c, carry)


# Blocks of at least this many scores (b * h * bq * bk) skip the mask where
# every pair of the block is visible: a pass of the mask's select over the
# block saved, forward and backward (most of a long causal call's blocks;
# benchmarks/chunked_attention.py). Those blocks run in a loop of their own,
# so the block's math is compiled twice; small blocks, where the select
# costs little, keep one loop.
UNMASKED_MIN_SCORES = 2**17


def _may_skip_mask(mask: MaskSpec, scores: int) -> bool:
  """Whether some blocks may need no mask: none of segments, an explicit mask
  or a window, and blocks of at least UNMASKED_MIN_SCORES scores. Padding
  may leave whole blocks visible (a model's calls always carry its PAD
  mask): which ones is read from the arrays at run time (_first_partial)."""
  return (mask.query_segments is None and mask.dense is None and mask.window is None
          and scores >= UNMASKED_MIN_SCORES)


def _first_partial(valid, size: int, start):
  """The first block of `size` tokens at or after block `start` (int32
  scalar) where some row of the batch has a padding token: valid bool [b, L]
  (L a multiple of size; None: no padding) -> int32 scalar, L // size if
  none."""
  if valid is None:
    return jnp.int32(2**30)
  count = valid.shape[1] // size
  whole = valid.reshape(valid.shape[0], count, size).all((0, 2))
  index = jnp.arange(count, dtype=jnp.int32)
  return jnp.min(jnp.where(~whole & (index >= start), index, count))


def _all_valid(valid, start, size: int):
  """Whether tokens start .. start + size - 1 are valid in every row: valid
  bool [b, L] or None (no padding) -> bool scalar."""
  if valid is None:
    return jnp.bool_(True)
  return jax.lax.dynamic_slice_in_dim(valid, start, size, axis=1).all()


def unmasked_key_blocks(mask: MaskSpec, qs, bq, bk, lo, hi, q_offset, n, m, scores: int):
  """(first, last): the key blocks [first, last) of [lo, hi) that every
  query of the block at qs sees whole (below the causal diagonal, real
  queries < n and keys < m, no padding token in any row of the batch up to
  the last one): a prefix of [lo, hi), int32 scalars; None where
  _may_skip_mask says no."""
  if not _may_skip_mask(mask, scores):
    return None
  last = jnp.minimum(m // bk, _first_partial(mask.key_valid, bk, lo))
  if mask.causal:  # key block kb ends at or before the block's first query
    last = jnp.minimum(last, (q_offset + qs + 1) // bk)
  whole = (qs + bq <= n) & _all_valid(mask.query_valid, qs, bq)
  return lo, jnp.where(whole, jnp.clip(last, lo, hi), lo)


def unmasked_query_blocks(mask: MaskSpec, ks, bq, bk, lo, hi, q_offset, n, m, scores: int):
  """(first, last): the query blocks [first, last) of [lo, hi) that see the
  whole key block at ks (unmasked_key_blocks' rule, from the keys' side),
  int32 scalars; None where _may_skip_mask says no."""
  if not _may_skip_mask(mask, scores):
    return None
  first = lo
  if mask.causal:  # query block qb starts at or after the key block's last key
    first = jnp.maximum(lo, -((q_offset - ks - bk + 1) // bq))
  first = jnp.minimum(first, hi)
  last = jnp.clip(jnp.minimum(n // bq, _first_partial(mask.query_valid, bq, first)), first, hi)
  whole = (ks + bk <= m) & _all_valid(mask.key_valid, ks, bk)
  return jnp.where(whole, first, hi), jnp.where(whole, last, hi)


def _loops(lo, hi, unmasked, body, carry):
  """body(i, carry, masked) for i in [lo, hi): masked=False for i in
  unmasked = [first, last) (lo <= first <= last <= hi), masked=True for the
  rest, those first (in order: [lo, first), then [last, hi)). unmasked None:
  one loop, every block masked."""
  if unmasked is None:
    return jax.lax.fori_loop(lo, hi, lambda i, c: body(i, c, True), carry)
  first, last = unmasked
  before = first - lo

  def masked(t, carry):
    return body(jnp.where(t < before, lo + t, last + t - before), carry, True)
  carry = jax.lax.fori_loop(0, before + hi - last, masked, carry)
  return jax.lax.fori_loop(first, last, lambda i, c: body(i, c, False), carry)


# The blocks on the causal diagonal have their upper half hidden. Where the
# diagonal blocks are whole blocks (_staircase), each runs as a staircase:
# rows r0 .. r0 + STAIRCASE_ROWS - 1 against the block's first
# r0 + STAIRCASE_ROWS keys, masked in their last STAIRCASE_ROWS only (in all
# of them where there is padding): with blocks of 512, (1 + 4) / 8 of the
# block's pairs, in 4 products 128 rows tall
# (benchmarks/chunked_attention.py --no_staircase). Without padding they
# are the loops' only masked blocks; with it, a cond picks the staircase
# where a masked block is the diagonal.
STAIRCASE_ROWS = 128


def _staircase(mask: MaskSpec, q_offset, n: int, m: int, bq: int, bk: int, scores: int):
  """The rows a step of the diagonal blocks' staircase (STAIRCASE_ROWS), or
  None: the mask causal, with no window or segments (_may_skip_mask;
  padding may be), q_offset a Python 0 (training, evaluation), bq = bk
  dividing n <= m, so that the diagonal blocks are whole blocks, and the
  block more than one step tall."""
  if not (mask.causal and _may_skip_mask(mask, scores) and type(q_offset) is int
          and q_offset == 0 and bq == bk and n <= m and not n % bq and not m % bk):
    return None
  rise = STAIRCASE_ROWS
  return rise if bq > rise and not bq % rise else None


def _step_visible(r0: int, rise: int):
  """bool [rise, r0 + rise]: rows r0 .. r0 + rise - 1 of a diagonal block
  against its keys 0 .. r0 + rise - 1, key j seen by row i where j <= i."""
  return jnp.arange(r0 + rise)[None, :] <= (r0 + jnp.arange(rise))[:, None]


def _step_mask(mask: MaskSpec, start, r0: int, rise: int):
  """_step_visible with the padding of the diagonal block at `start` (its
  queries and keys both): bool [rise, r0 + rise], or [b, 1, rise, r0 + rise]
  where the mask has padding."""
  visible = _step_visible(r0, rise)
  if mask.key_valid is not None:
    keys = jax.lax.dynamic_slice_in_dim(mask.key_valid, start, r0 + rise, axis=1)
    visible = visible & keys[:, None, None, :]
  if mask.query_valid is not None:
    queries = jax.lax.dynamic_slice_in_dim(mask.query_valid, start + r0, rise, axis=1)
    visible = visible & queries[:, None, :, None]
  return visible


def _heads_first(x):
  """[b, L, h, d] <-> [b, h, L, d]. Heads first, the key block that every
  query block slices again is one contiguous piece a head, which the block's
  einsums read as it is (the terms' [b, bk, h, d] view of it, _block, is a
  transpose that XLA folds into them): on CPU the forward pass at n = 8192
  took 0.9-0.95x the time, at the cost of a copy of the keys and values.
  The backward keeps [b, L, h, d], where heads first measured slower."""
  return x.transpose(0, 2, 1, 3)


def _block(x_t, start, size: int):
  """x_t [b, h, L, d] (heads first) -> rows [start, start + size) as [b, size, h, d]."""
  return _heads_first(jax.lax.dynamic_slice_in_dim(x_t, start, size, axis=2))


def _add_at(x, part, start):
  """x with `part` added to rows start .. start + len(part) - 1 (axis 1): a
  slice and an update in place, not `.at[].add`'s scatter; where `part` is
  all of x, XLA makes it a plain add."""
  rows = part.shape[1]
  return jax.lax.dynamic_update_slice_in_dim(
      x, jax.lax.dynamic_slice_in_dim(x, start, rows, axis=1) + part, start, axis=1)


def _unblock(x, axis: int):
  """Blocks stacked first, [nb, ..., block (at axis), ...] -> [..., nb * block, ...]."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _kernel(terms: BlockTerms, n, m, bq, bk, nq, nk, rate, rise, first_query=0):
  """The custom_vjp function for these static sizes and dropout rate:
  (q [b, nq*bq, h, d], k [b, nk*bk, g, d], v [b, nk*bk, g, dv], params,
  mask, q_offset, seed) -> (out float32 [b, nq*bq, h, dv], lse float32
  [b, h, nq*bq], -inf where a query sees no key). rise: _staircase's rows
  a step, or None."""

  def block_logits(q, k, params, q_idx, k_idx, q_offset, rotated=False):
    """Scores of queries q_idx [rows] against keys k_idx [cols] (indices into
    the call; query i sits at q_offset + i)."""
    q_pos = q_offset + q_idx
    if terms.rotate is not None and not rotated:  # k's g heads, before repeat_heads
      q, k = terms.rotate(q, q_pos), terms.rotate(k, k_idx)
    return terms.logits(q, repeat_heads(k, q.shape[2]), params, q_pos, k_idx)

  def block_values(p, v, params, q_idx, k_idx, q_offset):
    return terms.values(p, repeat_heads(v, p.shape[1]), params, q_offset + q_idx, k_idx)

  def dropped(x, seed, q_idx, k_idx):
    """x [b, h, rows, cols] with dropout applied: keep / (1 - rate), else 0."""
    if not rate:
      return x
    return dropout.drop(x, seed, rate, first_query + q_idx[:, None], k_idx[None, :])

  def forward(q, k, v, params, mask, q_offset, seed, heads_first=False):
    b, _, h, _ = q.shape
    dv = v.shape[-1]
    rotated = heads_first and terms.rotate is not None
    if rotated:  # each query and key once, not once a block (BlockTerms.rotate)
      q = terms.rotate(q, q_offset + jnp.arange(q.shape[1]))
      k = terms.rotate(k, jnp.arange(k.shape[1]))
    if heads_first:  # each key block is read by every query block: heads first once
      k_src, v_src, rows = _heads_first(k), _heads_first(v), _block
    else:  # under a gradient, or one query block (a decode step: no cache copy)
      k_src, v_src, rows = k, v, functools.partial(jax.lax.dynamic_slice_in_dim, axis=1)

    def update(carry, s, v_blk, q_idx, k_idx, visible):
      """The online softmax carried over one more block of scores s [b, h, rows, cols]."""
      row_max, row_sum, acc = carry
      if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
      new_max = jnp.maximum(row_max, jnp.max(s, -1))
      shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # no key seen yet: any value
      p = jnp.exp(s - shift[..., None])  # hidden pairs: exp(-inf) = 0
      scale = jnp.exp(row_max - shift)
      row_sum = row_sum * scale + jnp.sum(p, -1)
      acc = acc * scale[..., None] + block_values(dropped(p, seed, q_idx, k_idx), v_blk, params,
                                                  q_idx, k_idx, q_offset)
      return new_max, row_sum, acc

    def query_block(qb):
      qs = qb * bq
      q_idx = qs + jnp.arange(bq)
      q_blk = jax.lax.dynamic_slice_in_dim(q, qs, bq, axis=1)
      lo, hi = mask.key_block_range(q_offset + qs, q_offset + qs + bq - 1, bk, nk)

      def diagonal(carry, ks):
        """The block on the causal diagonal (ks = qs, _staircase): its rows
        r0 .. r0 + rise - 1 against its first r0 + rise keys, step by step."""
        k_blk, v_blk = rows(k_src, ks, bk), rows(v_src, ks, bk)
        steps = []
        for r0 in range(0, bq, rise):
          r1 = r0 + rise
          i_idx, j_idx = q_idx[r0:r1], ks + jnp.arange(r1)
          s = block_logits(q_blk[:, r0:r1], k_blk[:, :r1], params, i_idx, j_idx, q_offset, rotated)
          steps.append(update(tuple(x[:, :, r0:r1] for x in carry), s, v_blk[:, :r1], i_idx,
                              j_idx, _step_mask(mask, ks, r0, rise)))
        return tuple(jnp.concatenate(parts, axis=2) for parts in zip(*steps))

      def key_block(kb, carry, masked):
        """_loops' body. Under the staircase the masked blocks are the
        diagonal and, where there is padding, the blocks it hides."""
        if not (masked and rise):
          return whole_block(kb, carry, masked)
        if not mask.has_arrays():
          return diagonal(carry, kb * bk)
        return jax.lax.cond(kb == qb, lambda c: diagonal(c, kb * bk),
                            lambda c: whole_block(kb, c, True), carry)

      def whole_block(kb, carry, masked):
        ks = kb * bk
        k_idx = ks + jnp.arange(bk)
        visible = _visible(mask, qs, ks, bq, bk, q_offset, n, m)

        def compute(carry):
          k_blk, v_blk = rows(k_src, ks, bk), rows(v_src, ks, bk)
          s = block_logits(q_blk, k_blk, params, q_idx, k_idx, q_offset, rotated)
          return update(carry, s, v_blk, q_idx, k_idx, visible if masked else None)
        return _unless_hidden(mask, visible, compute, carry) if masked else compute(carry)

      init = (jnp.full((b, h, bq), -jnp.inf, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
              jnp.zeros((b, h, bq, dv), jnp.float32))
      unmasked = unmasked_key_blocks(mask, qs, bq, bk, lo, hi, q_offset, n, m, b * h * bq * bk)
      row_max, row_sum, acc = _loops(lo, hi, unmasked, key_block, init)
      seen = row_sum > 0
      out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
      lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
      return out.transpose(0, 2, 1, 3), lse  # [b, bq, h, dv], [b, h, bq]

    out, lse = jax.lax.map(query_block, jnp.arange(nq))  # [nq, b, bq, h, dv], [nq, b, h, bq]
    return _unblock(out, 1), _unblock(lse, 2)

  @jax.custom_vjp
  def kernel(q, k, v, params, mask, q_offset, seed):
    # Without a gradient (evaluation, prefill) the keys and values go heads
    # first (_heads_first); under a gradient not, where the two copies would
    # add to the training step's peak memory for no gain in its time.
    return forward(q, k, v, params, mask, q_offset, seed, heads_first=nq > 1)

  def kernel_fwd(q, k, v, params, mask, q_offset, seed):
    out, lse = forward(q, k, v, params, mask, q_offset, seed)
    return (out, lse), (q, k, v, params, mask, q_offset, seed, out, lse)

  def kernel_bwd(res, cotangents):
    q, k, v, params, mask, q_offset, seed, out, lse = res
    d_out, d_lse = (x.astype(jnp.float32) for x in cotangents)
    # D_i = dO_i . O_i = sum_j p_ij dp_ij, dropout included (dp_ij is then
    # keep_ij / (1 - rate) times the gradient of the dropped weight). The
    # lse's own gradient (return_lse) is d lse_i / d s_ij = p_ij, so
    # ds_ij = p_ij (dp_ij - D_i + dlse_i): it joins D.
    delta = jnp.einsum('bnhd,bnhd->bhn', d_out, out) - d_lse  # [b, h, nq*bq]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731

    # Key block kb is read only in step kb of the outer loop, so its dk and
    # dv are written over it: the loop carries k and v and returns dk and dv
    # in their buffers (XLA updates them in place), two [b, m, g, d] arrays
    # fewer at the backward's peak.
    def key_block(kb, carry):
      dq, k_dk, v_dv, dparams = carry
      ks = kb * bk
      k_blk = jax.lax.dynamic_slice_in_dim(k_dk, ks, bk, axis=1)
      v_blk = jax.lax.dynamic_slice_in_dim(v_dv, ks, bk, axis=1)
      lo, hi = mask.query_block_range(ks, ks + bk - 1, bq, nq, q_offset)

      def pair(carry, qs, rows_, k_part, v_part, k_idx, visible):
        """carry with the gradients of queries qs .. qs + rows_ - 1 against the
        keys k_idx (k_part, v_part: the key block's first len(k_idx)) added."""
        dq, dk_blk, dv_blk, dparams = carry
        q_idx = qs + jnp.arange(rows_)
        q_blk = jax.lax.dynamic_slice_in_dim(q, qs, rows_, axis=1)
        s, pull_s = jax.vjp(lambda q_, k_, p_: block_logits(q_, k_, p_, q_idx, k_idx, q_offset),
                            q_blk, k_part, params)
        lse_blk = jax.lax.dynamic_slice_in_dim(lse, qs, rows_, axis=2)
        p = jnp.exp(s - lse_blk[..., None])
        if visible is not None:
          p = jnp.where(visible, p, 0.0)
        _, pull_v = jax.vjp(lambda p_, v_, pr_: block_values(p_, v_, pr_, q_idx, k_idx, q_offset),
                            dropped(p, seed, q_idx, k_idx), v_part, params)
        d_out_blk = jax.lax.dynamic_slice_in_dim(d_out, qs, rows_, axis=1).transpose(0, 2, 1, 3)
        dp, dv_part, dparams_v = pull_v(d_out_blk)
        dp = dropped(dp, seed, q_idx, k_idx)
        ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, qs, rows_, axis=2)[..., None])
        dq_part, dk_part, dparams_s = pull_s(ds)
        dparams = jax.tree.map(
            lambda a, x, y: a + x.astype(jnp.float32) + y.astype(jnp.float32),
            dparams, dparams_v, dparams_s)
        return (_add_at(dq, dq_part, qs), _add_at(dk_blk, dk_part, 0),
                _add_at(dv_blk, dv_part, 0), dparams)

      def diagonal(carry):
        """The block on the causal diagonal (query block kb), _staircase."""
        for r0 in range(0, bq, rise):
          r1 = r0 + rise
          carry = pair(carry, ks + r0, rise, k_blk[:, :r1], v_blk[:, :r1], ks + jnp.arange(r1),
                       _step_mask(mask, ks, r0, rise))
        return carry

      def query_block(qb, carry, masked):
        """_loops' body (key_block's rule in the forward)."""
        if not (masked and rise):
          return whole_block(qb, carry, masked)
        if not mask.has_arrays():
          return diagonal(carry)
        return jax.lax.cond(qb == kb, diagonal, lambda c: whole_block(qb, c, True), carry)

      def whole_block(qb, carry, masked):
        qs = qb * bq
        visible = _visible(mask, qs, ks, bq, bk, q_offset, n, m)

        def compute(carry):
          return pair(carry, qs, bq, k_blk, v_blk, ks + jnp.arange(bk),
                      visible if masked else None)
        return _unless_hidden(mask, visible, compute, carry) if masked else compute(carry)

      unmasked = unmasked_query_blocks(mask, ks, bq, bk, lo, hi, q_offset, n, m,
                                       q.shape[0] * q.shape[2] * bq * bk)
      dq, dk_blk, dv_blk, dparams = _loops(lo, hi, unmasked, query_block,
                                           (dq, zeros(k_blk), zeros(v_blk), dparams))
      k_dk = jax.lax.dynamic_update_slice_in_dim(k_dk, dk_blk.astype(k.dtype), ks, axis=1)
      v_dv = jax.lax.dynamic_update_slice_in_dim(v_dv, dv_blk.astype(v.dtype), ks, axis=1)
      return dq, k_dk, v_dv, dparams

    # dq starts from a zero computed from d_out: XLA shares constant zeros
    # with the forward pass's buffers and allocates them before it, where
    # they would sit through the forward (32 MiB at n = 16k). XLA keeps
    # s * 0.0 (it is NaN for s = inf).
    s = d_out[0, 0, 0, 0]
    zero = jnp.where(jnp.isfinite(s), s * 0.0, 0.0)
    init = (jnp.full(q.shape, zero), k, v, jax.tree.map(zeros, params))
    dq, dk, dv, dparams = jax.lax.fori_loop(0, nk, key_block, init)
    dparams = jax.tree.map(lambda g, p: g.astype(p.dtype), dparams, params)
    return (dq.astype(q.dtype), dk, dv, dparams, None, None, None)

  kernel.defvjp(kernel_fwd, kernel_bwd)
  return kernel
