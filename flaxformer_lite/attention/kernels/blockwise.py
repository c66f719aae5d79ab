"""The blockwise kernel: attention in O(n) memory by an online softmax over
blocks of queries and keys, for any scheme's Terms (scheme.py) and any
masks.Mask. `attend` is the entry point (queries already scaled;
`dot_product` scales them): it checks its arguments, plans the blocks and
runs the kernel. A block's scores and values are product.py's, shared with
the dense kernel.

Queries go in nq blocks of bq rows, keys in nk blocks of bk columns. For
each query block an online softmax (Milakov & Gimelshein 2018) runs over the
key blocks it can see: a running row maximum, a running sum of
exp(s - max) and a running output, each rescaled when the maximum grows.

The backward pass is a `jax.custom_vjp` in FlashAttention-2's order: key
blocks outside, query blocks inside; each block's probabilities are
recomputed from q, k and the saved per-row log-sum-exp, so nothing of size
[n, m] is stored. With delta_i = dO_i . O_i (the output is linear in the
probabilities, so this is sum_j p_ij dp_ij), ds = p * (dp - delta).

The mask's fast paths come from its block map, computed once per call
(`mask_blocks`: masks.block_mask over every row and head at once), as
FlexAttention's BlockMask: per query block the lists of its FULL, PARTIAL
and DIAGONAL key blocks (and per key block the same by query), each run in
a loop of its own. EMPTY blocks are in no list (causal attention does about
half the work, a window O(n * window), packed rows no cross-example block);
FULL ones run without the mask's select; PARTIAL ones evaluate the mask on
the block's indices; DIAGONAL ones (nothing visible above the block's
diagonal: a causal rule's diagonal blocks) run as a staircase of row steps
(`_forward_staircase`) that leaves out most of their hidden half. No kernel code
knows a mask's rule.

Attention dropout (FlashAttention's): each block draws its keep bits from
dropout.py's hash of (row, head, query, key), in the forward and again in
the backward, so no mask is stored and the dense kernel drops the same
weights. The row sums use the undropped probabilities; the block's values
term gets the dropped ones, p * keep / (1 - rate).

Keys and values may have fewer heads than the queries (grouped-query
attention, g dividing h): query head i reads key/value head i // (h / g).
Each block copies its g heads to h, a block-sized copy, never the whole
keys and values (nor a decoding cache).

Layout: `plan` fixes a call's static settings (`Blocks`) once; `attention`
is the custom_vjp, whose forward is `forward` (one `query_block` per query
block: a decoding step's few queries are one query block, so `query_block`
is all of a decode step's work) and whose backward is `backward` (one
`key_block_grads` per key block). The terms and the Blocks are the
custom_vjp's static arguments; the call's arrays travel as `Call`, the
terms' tables among them (`block_tables`, once per call, outside the
custom_vjp).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp

from flaxformer_lite.attention import dropout, masks, softmax
from flaxformer_lite.attention.kernels.product import dot_values, repeat_heads, scores
from flaxformer_lite.attention.scheme import Terms, call_mask

# Blocks of at least this many scores (b * h * bq * bk) run their FULL blocks
# (every pair visible) without the mask's select, in a loop of their own: a
# pass of the select over the block saved, forward and backward (most of a
# long causal call's blocks; benchmarks/chunked_attention.py). The block's
# math is then compiled once more; small blocks, where the select costs
# little, run every visible block in one masked loop.
UNMASKED_MIN_SCORES = 2**17

# A DIAGONAL block (nothing visible above its diagonal) runs as a staircase
# (_forward_staircase): rows r0 .. r0 + STAIRCASE_ROWS - 1 against the block's first
# r0 + STAIRCASE_ROWS keys, masked in their last STAIRCASE_ROWS only: with
# blocks of 512, (1 + 4) / 8 of the block's pairs, in 4 products 128 rows
# tall (benchmarks/chunked_attention.py --no_staircase).
STAIRCASE_ROWS = 128

# None, or a function(pass_name, masked, qb, kb) that each block a call
# computes is reported to (jax.debug.callback; pass_name 'forward' or
# 'backward', masked False for a FULL block): set while tracing, tests count
# the blocks visited against block_mask.
VISIT_HOOK = None

DEFAULT_CHUNK_SIZE = 512

def attend(query, key, value, terms: Terms = Terms(), params=None, *,
           mask: masks.Mask | None = None, q_offset=0, chunk_size: int = DEFAULT_CHUNK_SIZE,
           dtype=None, dropout_rate: float = 0.0, dropout_rng=None, return_lse: bool = False,
           dropout_first_query: int = 0):
  """Attention over blocks, never holding an [n, m] array.

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i (already
      scaled if the variant's scores are); key [b, m, g, d]; value
      [b, m, g, dv], g dividing h (g < h: grouped-query attention).
    terms: the scheme's terms (scheme.Terms), called with h heads.
    params: a pytree of arrays (the scheme's parameters), or None; the
      blocks read what terms.prepare makes of them.
    mask: a masks.Mask (or what masks.as_mask takes; None: every key visible).
    q_offset: int, may be traced (decoding with a cache).
    chunk_size: rows and columns per block; lengths need not divide it.
    dropout_rate, dropout_rng: attention dropout (dropout.py's keep mask);
      off when the rate is 0 or the key None.
    return_lse: return each row's log-sum-exp of its scores too, and no
      rule for rows that see no key (their lse is -inf), so that attention
      over another set of keys can be merged with this one (`merge`); it is
      differentiable.
    dropout_first_query: the index dropout's hash gives query 0, for a call
      on the queries [s, s + n) of a longer sequence that must drop what
      the whole sequence's call drops.
  Returns:
    [b, n, h, dv] in `dtype` (default: query's); with return_lse, (that,
    lse float32 [b, h, n]).
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
  mask = call_mask(terms, masks.as_mask(mask, q_offset))
  blocks = plan(b, h, n, m, chunk_size, rate, dropout_first_query,
                _causal_alone(mask, q_offset))
  n_pad, m_pad = blocks.nq * blocks.bq, blocks.nk * blocks.bk
  hides_no_row = masks.hides_no_row(mask)
  mask = mask_blocks(mask or masks.everything(), q_offset, b, h, blocks)
  q_offset = jnp.asarray(q_offset, jnp.int32)
  tables = block_tables(blocks, terms, params, q_offset)
  pad = masks.pad_to
  out, lse = attention(blocks, terms, pad(query, 1, n_pad), pad(key, 1, m_pad),
                       pad(value, 1, m_pad), tables, mask, q_offset, seed)
  out, lse = out[:, :n], lse[:, :, :n]
  if return_lse:
    return out.astype(dtype), lse
  # Heads of a group share their keys, so they share the uniform output too.
  uniform = None if hides_no_row else lambda: repeat_heads(
      terms.uniform(value, tables, q_offset + jnp.arange(n), jnp.arange(m)), h)
  return softmax.where_no_key(out, lse, uniform).astype(dtype)


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


def dot_product(query, key, value, terms: Terms = Terms(), params=None, *, mask=None,
                q_offset=0, chunk_size=None, dtype=None, dropout_rate=0.0, dropout_rng=None):
  """`attend` of unscaled queries: dot-product attention under a scheme's
  `terms` and `params`, the queries scaled by 1/sqrt(d) here, once; mask
  a masks.Mask. O(n) memory, the dense path's dropout."""
  dtype = dtype or query.dtype
  scaled = query.astype(dtype) / jnp.sqrt(query.shape[-1]).astype(dtype)
  return attend(scaled, key, value, terms, params, mask=mask, q_offset=q_offset,
                chunk_size=chunk_size, dtype=dtype, dropout_rate=dropout_rate,
                dropout_rng=dropout_rng)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A call's static settings: n queries and m keys (before padding) in nq
  blocks of bq rows and nk blocks of bk columns; the dropout rate (0: none);
  split, whether FULL blocks run apart from the masked ones; rise, the
  staircase's rows a step (_forward_staircase) or None; partial, whether a
  block may be PARTIAL; first_query, the index dropout's hash gives query 0."""
  n: int
  m: int
  bq: int
  bk: int
  nq: int
  nk: int
  rate: float
  split: bool
  rise: int | None
  partial: bool = True
  first_query: int = 0

  @property
  def visited(self) -> tuple[int, ...]:
    """The block states that run, each in a loop of its own (MaskBlocks)."""
    return ((masks.FULL,) if self.split else ()) + ((masks.PARTIAL,) if self.partial else ()) + (
        (masks.DIAGONAL,) if self.rise else ())


class Call(NamedTuple):
  """A call's arrays that every block reads."""
  tables: Any  # what terms.prepare made of the parameters (a pytree), or None
  mask: MaskBlocks
  q_offset: Any  # int32 []: query i sits at q_offset + i
  seed: Any  # uint32 []: dropout's hash seed


def plan(b: int, h: int, n: int, m: int, chunk_size: int, rate: float,
         first_query: int = 0, causal_alone: bool = False) -> Blocks:
  """The Blocks of a call: b rows, h query heads, n queries and m keys in
  blocks of chunk_size (fewer where a length is shorter). causal_alone
  (_causal_alone): with whole blocks of the staircase, every block is FULL,
  EMPTY or DIAGONAL, and the PARTIAL loop is not compiled (a masked whole
  block costs the forward a block-sized buffer more)."""
  bq, bk = min(chunk_size, n), min(chunk_size, m)
  nq, nk = -(-n // bq), -(-m // bk)
  split = b * h * bq * bk >= UNMASKED_MIN_SCORES
  rise = STAIRCASE_ROWS
  rise = rise if split and bq == bk and bq > rise and not bq % rise else None
  partial = not (causal_alone and rise and not n % bq and not m % bk)
  return Blocks(n, m, bq, bk, nq, nk, rate, split, rise, partial, first_query)


def _causal_alone(mask, q_offset) -> bool:
  """Whether `mask` is the causal rule alone (masks.causal_alone) with the
  queries at 0..n-1 (q_offset a Python 0): block (qb, kb) of square blocks
  is then FULL below the diagonal, EMPTY above, DIAGONAL on it."""
  return masks.causal_alone(mask) and type(q_offset) is int and q_offset == 0


def block_tables(blocks: Blocks, terms, params, q_offset):
  """terms.prepare's tables for a call (the parameters themselves without
  one), from the positions of its queries [nq, bq] and keys [nk, bk] as the
  blocks hold them. Made here, outside `attention`, so that autodiff takes
  their gradients on to the parameters."""
  if terms.prepare is None:
    return params
  q_pos = q_offset + jnp.arange(blocks.nq * blocks.bq).reshape(blocks.nq, blocks.bq)
  k_pos = jnp.arange(blocks.nk * blocks.bk).reshape(blocks.nk, blocks.bk)
  return terms.prepare(params, q_pos, k_pos)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attention(blocks: Blocks, terms, q, k, v, tables, mask, q_offset, seed):
  """(q [b, nq*bq, h, d], k [b, nk*bk, g, d], v [b, nk*bk, g, dv], tables,
  mask, q_offset, seed) -> (out float32 [b, nq*bq, h, dv], lse float32
  [b, h, nq*bq], -inf where a query sees no key); terms a scheme.Terms."""
  # Without a gradient (evaluation, prefill) the keys and values go heads
  # first (_heads_first); under a gradient not, where the two copies would
  # add to the training step's peak memory for no gain in its time.
  return forward(blocks, terms, q, k, v, tables, mask, q_offset, seed,
                 heads_first=blocks.nq > 1)


def _attention_fwd(blocks: Blocks, terms, q, k, v, tables, mask, q_offset, seed):
  out, lse = forward(blocks, terms, q, k, v, tables, mask, q_offset, seed)
  return (out, lse), (q, k, v, tables, mask, q_offset, seed, out, lse)


# ---------------------------------------------------------------------------
# Block math shared by the forward and the backward.


def _block_scores(terms, q, k, tables, q_idx, k_idx, q_offset, transformed_keys=False):
  """Scores of queries q_idx [rows] against keys k_idx [cols] (indices into
  the call; query i sits at q_offset + i) -> float32 [b, h, rows, cols]."""
  return scores(terms, q, k, tables, q_offset + q_idx, k_idx, transformed_keys)


def _block_values(terms, p, v, tables, q_idx, k_idx, q_offset):
  return (terms.values or dot_values)(p, repeat_heads(v, p.shape[1]), tables, q_offset + q_idx,
                                      k_idx)


def _dropped(blocks: Blocks, x, seed, q_idx, k_idx):
  """x [b, h, rows, cols] with dropout applied: keep / (1 - rate), else 0."""
  if not blocks.rate:
    return x
  return dropout.drop(x, seed, blocks.rate, blocks.first_query + q_idx[:, None],
                      k_idx[None, :])


# ---------------------------------------------------------------------------
# Forward: query blocks outside (lax.map), key blocks inside (_each_listed).


class _Source(NamedTuple):
  """The forward's queries, keys and values, as its blocks read them."""
  q: Any  # [b, nq*bq, h, d]
  k: Any  # [b, nk*bk, g, d], or heads first [b, g, nk*bk, d]
  v: Any  # as k, with dv
  heads_first: bool  # and the keys mapped by terms.transform_k


class _QueryRows(NamedTuple):
  """One query block of the forward: block qb, first row qs, rows idx [bq]
  and their queries q [b, bq, h, d]."""
  qb: Any
  qs: Any
  idx: Any
  q: Any


def forward(blocks: Blocks, terms, q, k, v, tables, mask, q_offset, seed, heads_first=False):
  """attention's value -> (out float32 [b, nq*bq, h, dv], lse float32
  [b, h, nq*bq]). heads_first: read the keys and values heads first and map
  every key by terms.transform_k once (without a gradient)."""
  if heads_first and terms.transform_k is not None:  # once, not once a block
    idx = jnp.arange(k.shape[1])
    k = terms.transform_k(k, tables, idx, idx - idx % blocks.bk)  # from its block's first key
  if heads_first:  # each key block is read by every query block: heads first once
    k, v = _heads_first(k), _heads_first(v)
  # else under a gradient, or one query block (a decode step: no cache copy)
  src = _Source(q, k, v, heads_first)
  one = functools.partial(query_block, blocks, terms, Call(tables, mask, q_offset, seed), src)
  out, lse = jax.lax.map(one, jnp.arange(blocks.nq))  # [nq, b, bq, h, dv], [nq, b, h, bq]
  return _unblock(out, 1), _unblock(lse, 2)


def query_block(blocks: Blocks, terms, call: Call, src: _Source, qb):
  """The online softmax of query block qb over every key block it sees, by
  the mask's lists (_each_listed) -> (out float32 [b, bq, h, dv], lse
  float32 [b, h, bq]). A decoding step's queries are one block: this is the
  whole of its work."""
  rows = _query_rows(blocks, src, qb)
  body = functools.partial(_forward_key_block, blocks, terms, call, src, rows)
  carry = _no_key_yet(src, blocks.bq)
  return _normalised(*_each_listed(blocks, call.mask.by_query, qb, body, carry))


def _query_rows(blocks: Blocks, src: _Source, qb) -> _QueryRows:
  """Query block qb's rows (_QueryRows)."""
  qs = qb * blocks.bq
  return _QueryRows(qb, qs, qs + jnp.arange(blocks.bq),
                    jax.lax.dynamic_slice_in_dim(src.q, qs, blocks.bq, axis=1))


def _no_key_yet(src: _Source, bq: int):
  """The online softmax's carry before any key: (row_max -inf, row_sum 0,
  acc 0) for bq rows."""
  b, _, h, _ = src.q.shape
  return (jnp.full((b, h, bq), -jnp.inf, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
          jnp.zeros((b, h, bq, src.v.shape[-1]), jnp.float32))


def _normalised(row_max, row_sum, acc):
  """The online softmax's carry after the last key block -> (out float32
  [b, bq, h, dv], lse float32 [b, h, bq], -inf where a row saw no key)."""
  seen = row_sum > 0
  out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
  return out.transpose(0, 2, 1, 3), lse  # [b, bq, h, dv], [b, h, bq]


def _key_rows(src: _Source, start, size: int):
  """Keys and values start .. start + size - 1 -> ([b, size, g, d], [b, size, g, dv])."""
  if src.heads_first:
    return _block(src.k, start, size), _block(src.v, start, size)
  return (jax.lax.dynamic_slice_in_dim(src.k, start, size, axis=1),
          jax.lax.dynamic_slice_in_dim(src.v, start, size, axis=1))


def _update(blocks: Blocks, terms, call: Call, carry, s, v_blk, q_idx, k_idx, visible):
  """The online softmax carried over one more block of scores s [b, h, rows, cols]."""
  row_max, row_sum, acc = carry
  if visible is not None:
    s = jnp.where(visible, s, -jnp.inf)
  new_max = jnp.maximum(row_max, jnp.max(s, -1))
  shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # no key seen yet: any value
  p = jnp.exp(s - shift[..., None])  # hidden pairs: exp(-inf) = 0
  scale = jnp.exp(row_max - shift)
  row_sum = row_sum * scale + jnp.sum(p, -1)
  acc = acc * scale[..., None] + _block_values(terms, _dropped(blocks, p, call.seed, q_idx, k_idx),
                                               v_blk, call.tables, q_idx, k_idx, call.q_offset)
  return new_max, row_sum, acc


def _forward_key_block(blocks: Blocks, terms, call: Call, src: _Source, rows: _QueryRows, kb,
                       carry, state: int):
  """_each_listed's body: key block kb, in `state` (masks.FULL, PARTIAL or
  DIAGONAL), against the query block."""
  _report('forward', state, rows.qb, kb)
  ks = kb * blocks.bk
  k_blk, v_blk = _key_rows(src, ks, blocks.bk)
  visible = None if state == masks.FULL else _visible(blocks, call, rows.qs, ks)
  if state == masks.DIAGONAL:
    return _forward_staircase(blocks, terms, call, src, rows, carry, ks, k_blk, v_blk, visible)
  k_idx = ks + jnp.arange(blocks.bk)
  s = _block_scores(terms, rows.q, k_blk, call.tables, rows.idx, k_idx, call.q_offset,
                    src.heads_first)
  return _update(blocks, terms, call, carry, s, v_blk, rows.idx, k_idx, visible)


def _forward_staircase(blocks: Blocks, terms, call: Call, src: _Source, rows: _QueryRows,
                       carry, ks, k_blk, v_blk, visible):
  """A DIAGONAL block as a staircase: its rows r0 .. r0 + rise - 1 against its
  first r0 + rise keys, step by step."""
  rise = blocks.rise
  steps = []
  for r0 in range(0, blocks.bq, rise):
    r1 = r0 + rise
    i_idx, j_idx = rows.idx[r0:r1], ks + jnp.arange(r1)
    s = _block_scores(terms, rows.q[:, r0:r1], k_blk[:, :r1], call.tables, i_idx, j_idx,
                      call.q_offset, src.heads_first)
    steps.append(_update(blocks, terms, call, tuple(x[:, :, r0:r1] for x in carry), s,
                         v_blk[:, :r1], i_idx, j_idx, visible[..., r0:r1, :r1]))
  return tuple(jnp.concatenate(parts, axis=2) for parts in zip(*steps))


# ---------------------------------------------------------------------------
# Backward: key blocks outside (fori_loop), query blocks inside (_each_listed).


class _Grads(NamedTuple):
  """The backward's arrays by query row."""
  q: Any  # [b, nq*bq, h, d]
  lse: Any  # float32 [b, h, nq*bq], 0 where a query sees no key
  d_out: Any  # float32 [b, nq*bq, h, dv]
  delta: Any  # float32 [b, h, nq*bq]: dO_i . O_i - dlse_i


class _KeyRows(NamedTuple):
  """One key block of the backward: block kb, first key ks, its keys k
  [b, bk, g, d] and values v [b, bk, g, dv]."""
  kb: Any
  ks: Any
  k: Any
  v: Any


def _zeros(x):
  return jnp.zeros(x.shape, jnp.float32)


def backward(blocks: Blocks, terms, res, cotangents):
  """attention's vjp: the saved (q, k, v, tables, mask, q_offset, seed, out,
  lse) and the cotangents of (out, lse) -> the gradients of q, k, v and
  tables (None for the mask, q_offset and seed)."""
  q, k, v, tables, mask, q_offset, seed, out, lse = res
  d_out, d_lse = (x.astype(jnp.float32) for x in cotangents)
  # D_i = dO_i . O_i = sum_j p_ij dp_ij, dropout included (dp_ij is then
  # keep_ij / (1 - rate) times the gradient of the dropped weight). The
  # lse's own gradient (return_lse) is d lse_i / d s_ij = p_ij, so
  # ds_ij = p_ij (dp_ij - D_i + dlse_i): it joins D.
  delta = jnp.einsum('bnhd,bnhd->bhn', d_out, out) - d_lse  # [b, h, nq*bq]
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  # dq starts from a zero computed from d_out: XLA shares constant zeros
  # with the forward pass's buffers and allocates them before it, where
  # they would sit through the forward. XLA keeps s * 0.0 (it is NaN for
  # s = inf).
  s = d_out[0, 0, 0, 0]
  zero = jnp.where(jnp.isfinite(s), s * 0.0, 0.0)
  init = (jnp.full(q.shape, zero), k, v, jax.tree.map(_zeros, tables))
  body = functools.partial(key_block_grads, blocks, terms, Call(tables, mask, q_offset, seed),
                           _Grads(q, lse, d_out, delta))
  dq, dk, dv, dtables = jax.lax.fori_loop(0, blocks.nk, body, init)
  dtables = jax.tree.map(lambda g, t: g.astype(t.dtype), dtables, tables)
  return (dq.astype(q.dtype), dk, dv, dtables, None, None, None)


attention.defvjp(_attention_fwd, backward)


def key_block_grads(blocks: Blocks, terms, call: Call, grads: _Grads, kb, carry):
  """The fori_loop's body: carry (dq, k_dk, v_dv, dtables) with key block kb's
  gradients added, over the query blocks that see it (the mask's lists by
  key, _each_listed). Key block kb is read only in step kb, so its dk and dv
  are written over it: the loop carries k and v and returns dk and dv in
  their buffers (XLA updates them in place), two [b, m, g, d] arrays fewer
  at the backward's peak."""
  dq, k_dk, v_dv, dtables = carry
  keys = _key_block(blocks, k_dk, v_dv, kb)
  body = functools.partial(_backward_query_block, blocks, terms, call, grads, keys)
  dq, dk_blk, dv_blk, dtables = _each_listed(blocks, call.mask.by_key, kb, body,
                                             (dq, _zeros(keys.k), _zeros(keys.v), dtables))
  return (dq, *_written(k_dk, v_dv, dk_blk, dv_blk, keys.ks), dtables)


def _key_block(blocks: Blocks, k_dk, v_dv, kb) -> _KeyRows:
  """Key block kb's keys and values, read from the carry (key_block_grads)."""
  ks = kb * blocks.bk
  return _KeyRows(kb, ks, jax.lax.dynamic_slice_in_dim(k_dk, ks, blocks.bk, axis=1),
                  jax.lax.dynamic_slice_in_dim(v_dv, ks, blocks.bk, axis=1))


def _written(k_dk, v_dv, dk_blk, dv_blk, ks):
  """(k_dk, v_dv) with the key block at ks replaced by its gradients."""
  return (jax.lax.dynamic_update_slice_in_dim(k_dk, dk_blk.astype(k_dk.dtype), ks, axis=1),
          jax.lax.dynamic_update_slice_in_dim(v_dv, dv_blk.astype(v_dv.dtype), ks, axis=1))


def _backward_query_block(blocks: Blocks, terms, call: Call, grads: _Grads, keys: _KeyRows, qb,
                          carry, state: int):
  """_each_listed's body (_forward_key_block's rule, from the keys' side)."""
  _report('backward', state, qb, keys.kb)
  qs = qb * blocks.bq
  visible = None if state == masks.FULL else _visible(blocks, call, qs, keys.ks)
  if state == masks.DIAGONAL:
    return _backward_staircase(blocks, terms, call, grads, keys, carry, qs, visible)
  return _pair_grads(blocks, terms, call, grads, carry, qs, blocks.bq, keys.k, keys.v,
                     keys.ks + jnp.arange(blocks.bk), visible)


def _backward_staircase(blocks: Blocks, terms, call: Call, grads: _Grads, keys: _KeyRows, carry,
                        qs, visible):
  """A DIAGONAL block's gradients (_forward_staircase's steps)."""
  rise = blocks.rise
  for r0 in range(0, blocks.bq, rise):
    r1 = r0 + rise
    carry = _pair_grads(blocks, terms, call, grads, carry, qs + r0, rise, keys.k[:, :r1],
                        keys.v[:, :r1], keys.ks + jnp.arange(r1), visible[..., r0:r1, :r1])
  return carry


def _pair_grads(blocks: Blocks, terms, call: Call, grads: _Grads, carry, qs, rows: int, k_part,
                v_part, k_idx, visible):
  """carry (dq, dk_blk, dv_blk, dtables) with the gradients of queries
  qs .. qs + rows - 1 against the keys k_idx (k_part, v_part: the key
  block's first len(k_idx)) added."""
  dq, dk_blk, dv_blk, dtables = carry
  tables, q_offset, seed = call.tables, call.q_offset, call.seed
  q_idx = qs + jnp.arange(rows)
  q_blk = jax.lax.dynamic_slice_in_dim(grads.q, qs, rows, axis=1)
  s, pull_s = jax.vjp(lambda q_, k_, t_: _block_scores(terms, q_, k_, t_, q_idx, k_idx, q_offset),
                      q_blk, k_part, tables)
  lse_blk = jax.lax.dynamic_slice_in_dim(grads.lse, qs, rows, axis=2)
  p = jnp.exp(s - lse_blk[..., None])
  if visible is not None:
    p = jnp.where(visible, p, 0.0)
  _, pull_v = jax.vjp(
      lambda p_, v_, t_: _block_values(terms, p_, v_, t_, q_idx, k_idx, q_offset),
      _dropped(blocks, p, seed, q_idx, k_idx), v_part, tables)
  d_out_blk = jax.lax.dynamic_slice_in_dim(grads.d_out, qs, rows, axis=1).transpose(0, 2, 1, 3)
  dp, dv_part, dtables_v = pull_v(d_out_blk)
  dp = _dropped(blocks, dp, seed, q_idx, k_idx)
  ds = p * (dp - jax.lax.dynamic_slice_in_dim(grads.delta, qs, rows, axis=2)[..., None])
  dq_part, dk_part, dtables_s = pull_s(ds)
  dtables = jax.tree.map(
      lambda a, x, y: a + x.astype(jnp.float32) + y.astype(jnp.float32),
      dtables, dtables_v, dtables_s)
  return (_add_at(dq, dq_part, qs), _add_at(dk_blk, dk_part, 0),
          _add_at(dv_blk, dv_part, 0), dtables)


# ---------------------------------------------------------------------------
# The mask's block map: which blocks each block row and column visits.


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=('states', 'by_query', 'by_key', 'consts'),
                   meta_fields=('jaxpr',))
@dataclasses.dataclass(frozen=True)
class MaskBlocks:
  """A Mask as the kernel reads it (mask_blocks). states int8 [nq, nk]: each
  block's masks.block_mask state for the whole call (EMPTY or FULL where it
  is so for every row and head, DIAGONAL where it is so for every row and
  head that sees a pair of it, else PARTIAL). by_query: per state of
  Blocks.visited, (blocks int32 [nq, nk], count int32 [nq]): each query block's key
  blocks in that state first, in order, and how many; by_key the same per
  key block [nk, nq], [nk]. jaxpr: the mask on one block's query and key
  indices; consts: the arrays it reads, data of the custom_vjp, since a
  closure over traced arrays would leak out of a scan's or a remat's trace
  into the backward."""
  states: Any
  by_query: Any
  by_key: Any
  consts: Any
  jaxpr: Any

  def block(self, q_start, k_start, bq: int, bk: int, q_offset=0):
    """Queries q_start .. q_start + bq - 1 (query i at q_offset + i) against
    keys k_start .. k_start + bk - 1 -> bool broadcastable to [b, h, bq, bk]."""
    q = (q_offset + q_start + jnp.arange(bq)).astype(jnp.int32)
    k = (k_start + jnp.arange(bk)).astype(jnp.int32)
    evaluate = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(self.jaxpr, self.consts))
    return evaluate(q, k)[0]


def mask_blocks(mask: masks.Mask, q_offset, b: int, h: int, blocks: Blocks) -> MaskBlocks:
  """A call's MaskBlocks: b rows and h query heads, query i at q_offset + i
  (may be traced). masks.block_mask classifies the blocks of every row and
  head; the control flow reads one state a block, for the whole call.
  Without blocks.split, FULL blocks are PARTIAL ones; without blocks.rise,
  so are DIAGONAL ones."""
  per_row = masks.block_mask(mask, b, h, blocks.n, blocks.m, blocks.bq, blocks.bk, q_offset,
                             diagonal=blocks.rise is not None)
  empty = jnp.all(per_row == masks.EMPTY, axis=(0, 1))
  full = jnp.all(per_row == masks.FULL, axis=(0, 1))
  diagonal = jnp.all((per_row == masks.DIAGONAL) | (per_row == masks.EMPTY), axis=(0, 1))
  states = jnp.where(empty, masks.EMPTY, jnp.where(
      full & blocks.split, masks.FULL, jnp.where(diagonal, masks.DIAGONAL, masks.PARTIAL)))
  states = states.astype(jnp.int8)
  indices = (jax.ShapeDtypeStruct((blocks.bq,), jnp.int32),
             jax.ShapeDtypeStruct((blocks.bk,), jnp.int32))
  traced = jax.make_jaxpr(functools.partial(masks.at, mask, b, h))(*indices)
  return MaskBlocks(states, _listed(blocks, states), _listed(blocks, states.T), traced.consts,
                    traced.jaxpr)


def _listed(blocks: Blocks, states):
  """states int8 [rows, cols] -> per state of blocks.visited, (int32 [rows, cols]:
  each row's columns in that state first, in order; int32 [rows]: how many)."""
  columns = jnp.arange(states.shape[1], dtype=jnp.int32)
  out = []
  for state in blocks.visited:
    chosen = states == state
    order = jnp.argsort(jnp.where(chosen, columns, columns + states.shape[1]), axis=1)
    out.append((order.astype(jnp.int32), chosen.sum(1, dtype=jnp.int32)))
  return tuple(out)


def _each_listed(blocks: Blocks, lists, row, body, carry):
  """body(col, carry, state) for every column of block row `row` in each
  state of blocks.visited (lists: MaskBlocks.by_query or by_key), a loop per
  state."""
  for state, (cols, count) in zip(blocks.visited, lists):
    carry = jax.lax.fori_loop(0, count[row], lambda t, c, s=state: body(cols[row, t], c, s),
                              carry)
  return carry


def _visible(blocks: Blocks, call: Call, qs, ks):
  """bool [b | 1, h | 1, bq, bk]: the pairs of the block at (qs, ks) that may
  attend, real keys (< m) and real queries (< n) only."""
  bq, bk = blocks.bq, blocks.bk
  real = ((qs + jnp.arange(bq))[:, None] < blocks.n) & ((ks + jnp.arange(bk))[None, :] < blocks.m)
  return call.mask.block(qs, ks, bq, bk, call.q_offset) & real[None, None]


def _report(pass_name: str, state: int, qb, kb):
  if VISIT_HOOK is not None:
    jax.debug.callback(functools.partial(VISIT_HOOK, pass_name, state != masks.FULL), qb, kb)


# ---------------------------------------------------------------------------
# Block layout.


def _heads_first(x):
  """[b, L, h, d] <-> [b, h, L, d]. Heads first, the key block that every
  query block slices again is one contiguous piece a head, which the block's
  einsums read as it is (the terms' [b, bk, h, d] view of it, _block, is a
  transpose that XLA folds into them), at the cost of a copy of the keys
  and values. The backward keeps [b, L, h, d], where heads first is slower
  (benchmarks/chunked_attention.py)."""
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
