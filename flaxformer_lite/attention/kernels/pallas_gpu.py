"""A fused attention kernel in Pallas that carries a scheme's score function
and a mask: FlashAttention-2's forward and backward (Dao 2023) with
FlexAttention's score_mod and mask_mod (PyTorch), for GPUs through Pallas's
Triton lowering and anywhere in Pallas's interpret mode (the tests run it on
CPU).

  out = flash_attention(q, k, v, score=alibi, tables={'slopes': slopes},
                        mask=masks.key_padding(valid), causal=True)

q [b, n, h, d], k and v [b, m, g, d] with g dividing h (grouped-query: query
head i reads key/value head i // (h / g), by the BlockSpec's index map, no
copies).

Score: `score(s, b, head, q_pos, k_pos, tables) -> s'` (scheme.py), elementwise
in the scaled scores s (float32), given the program's batch row and query
head, query positions [.., bq, 1] and key positions [1, bk] (int32 arrays:
decoding offsets, packing and randomized positions reach it as data) and
`tables`, a dict of per-head arrays [h, ...] (tables per batch row are the
dense and blockwise kernels' only). A score reads `tables[name][head]` (a head's
scalar or row) or `tables[name][head, idx]` (idx int arrays, e.g. a bucket
per (query, key) pair). The same function runs on whole arrays in XLA (head
= arange(h)[:, None, None], s [b, h, bq, bk]); here each program gets its
head's rows by BlockSpec, and `tables` maps each name to a `_HeadRow`,
which drops the head index (the BlockSpec already chose the row) and
indexes the row's ref: indexing a *loaded value* by a traced index is a
gather, which the Triton lowering lacks; indexing the ref is a gather load,
which it has. Triton's arrays have power-of-two sizes, so the rows are
zero-padded to them (`[head, idx]` never reads the padding) and a row read
whole, `[head]`, lowers only where its size is a power of two.

Tables of a floating dtype that a gradient asks for get one (the others
cost the backward nothing: symbolic zeros): the dq kernel takes the vjp of
the score in the head's rows (loaded values there) with the scores'
cotangent ds = p * (dp - delta), and accumulates a float32 row gradient per
program, summed over rows and query blocks outside. A lookup
`table[head, idx]` in that vjp is a chain of selects, one per entry of the
row (`_lookup`): Triton lowers neither a gather from a value nor its
transpose, a scatter-add. So the forward and every gradient lower for both
forms; a learned lookup table costs the dq kernel one select per entry per
block.

Mask: `causal` by index (query i at q_offset + i sees keys j <= q_offset +
i; key blocks past the diagonal are not visited), keys past m hidden, and
any `masks.Mask`. A Mask's blocks are classified once per call
(masks.block_mask, per row and head): the kernels loop from a program's
first non-empty block to its last, skip EMPTY blocks, run FULL ones without
a select and evaluate the mask only on PARTIAL ones, with its arrays passed
as whole-array operands (refs: a mask only indexes them, masks.py) and its
indices clamped to the real queries and keys (a ref read past its end is
not clamped on a GPU). A query that sees no key gets output 0 and
gradient 0 (its log-sum-exp is stored as -NEG_INF, so its p is 0).

The forward saves each row's log-sum-exp; the backward recomputes the
probabilities block by block in two kernels, one per key block (dk, dv) and
one per query block (dq and the tables' gradients).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from flaxformer_lite.attention import masks
from flaxformer_lite.attention.scheme import Tables

NEG_INF = -1e30  # finite: a fully hidden block must not make exp(NaN)
# The running row maximum starts above NEG_INF, so that hidden scores weigh
# exp(NEG_INF / 2) = 0 even in a row that has seen no key yet.
ROW_MAX_START = NEG_INF / 2

# None, or a function(kernel, masked, b, head, program_block, loop_block) that
# interpret-mode calls report each block they compute to (jax.debug.callback;
# kernel 'forward', 'dkdv' or 'dq'; masked False for a FULL block): read
# while tracing; tests count the blocks visited.
VISIT_HOOK = None


@dataclasses.dataclass(frozen=True)
class Settings:
  """A call's static settings: block sizes, causal, the real query and key
  counts n and m (past them: padding), the score scale, how the call runs,
  the score, the tables' names and shapes [h, ...] (sorted by name), the
  mask (its arrays as shapes; None: no Mask) and the tables whose gradient
  the dq kernel takes."""
  block_q: int
  block_k: int
  causal: bool
  n: int
  m: int
  scale: float
  interpret: bool
  score: Callable[..., Any] | None
  tables: tuple[tuple[str, tuple[int, ...]], ...] = ()
  mask: masks.Mask | None = None
  grads: tuple[str, ...] = ()

  def compiler_params(self):
    # Triton's parameters choose the Triton lowering (the default GPU lowering
    # is Mosaic GPU's, which takes no elementwise score this way).
    return pl_triton.CompilerParams(num_warps=4, num_stages=2)


class Blocks(NamedTuple):
  """A Mask's blocks for the kernels (block_states): int32 states [b | 1,
  h | 1, nq, nk] (masks.EMPTY, PARTIAL, FULL); by_query [.., nq, 2], each
  query block's non-empty key blocks [lo, hi); by_key [.., nk, 2], each key
  block's non-empty query blocks."""
  states: Any
  by_query: Any
  by_key: Any


class _HeadRow:
  """A per-head table [h, ...] as one head's program sees it (module
  docstring): `row` its row, a ref or (differentiated) a loaded value;
  table[head] is the row, table[head, *idx] the row at idx. Indexed first
  by anything but the program's `head` (a batch row, a position) it
  refuses: the BlockSpec gave this program one head's row only."""

  def __init__(self, row, shape: tuple[int, ...], is_ref: bool, head):
    self.row, self.shape, self.is_ref, self.head = row, shape, is_ref, head
    self.ndim, self.dtype = len(shape), row.dtype

  def __getitem__(self, key):
    if (key[0] if isinstance(key, tuple) else key) is not self.head:
      raise ValueError('the fused Pallas kernel reads a table per head, as tables[name][h] or '
                       'tables[name][h, ...]; this score indexes one first by something else '
                       "(a batch row, a position): run it with kernel='dense' or 'chunked'")
    rest = key[1:] if isinstance(key, tuple) else ()
    if rest:
      return self.row[rest] if self.is_ref else _lookup(self.row, rest)
    if self.ndim == 1:  # a [h] table's row, [1]
      return self.row[...] if self.is_ref else self.row
    return self.row[tuple(slice(0, size) for size in self.shape[1:])]  # without its padding


def _lookup(row, idx):
  """row[idx] of a row value [r0, ..] by int arrays idx (one per axis) as
  one select per entry, which Triton lowers, and its vjp too."""
  flat_row, flat = row.reshape(-1), idx[0]
  for i, size in zip(idx[1:], row.shape[1:]):
    flat = flat * size + i
  out = jnp.zeros(jnp.broadcast_shapes(*(jnp.shape(i) for i in idx)), row.dtype)
  entries = jnp.arange(flat_row.shape[0])
  for j in range(flat_row.shape[0]):
    out = jnp.where(flat == j, jnp.sum(jnp.where(entries == j, flat_row, 0)), out)
  return out


def _pad(x, axis: int, multiple: int):
  size = -(-x.shape[axis] // multiple) * multiple
  if size == x.shape[axis]:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


# ---------------------------------------------------------------------------
# Inside the kernels.


class _Refs(NamedTuple):
  """A kernel's operands (_operands' order) and its outputs."""
  q: Any
  k: Any
  v: Any
  q_pos: Any
  k_pos: Any
  offset: Any
  grads_in: tuple  # (d_out, lse, delta) in the backward kernels, () in the forward
  tables: dict  # name -> the head's row ref
  mask: tuple  # the mask's arrays, whole
  states: Any  # Blocks.states, or None without a Mask
  ranges: Any  # Blocks.by_query or by_key, or None
  out: tuple


def _unpack(st: Settings, refs, backward: bool) -> _Refs:
  refs = list(refs)
  take = lambda count: [refs.pop(0) for _ in range(count)]
  head = take(6)
  grads_in = tuple(take(3 if backward else 0))
  tables = dict(zip((name for name, _ in st.tables), take(len(st.tables))))
  mask = tuple(take(0 if st.mask is None else len(st.mask.arrays)))
  states, ranges = take(2) if st.mask is not None else (None, None)
  return _Refs(*head, grads_in, tables, mask, states, ranges, tuple(refs))


def _head_rows(st: Settings, r: _Refs, head):
  """The score's `tables`: a _HeadRow over each head row's ref."""
  shapes = dict(st.tables)
  return Tables({name: _HeadRow(ref, shapes[name], True, head) for name, ref in r.tables.items()})


def _query_indices(st: Settings, offset_ref, qb):
  """Query block qb's indices [bq, 1], counted from the sequence's first query."""
  return offset_ref[0] + qb * st.block_q + jnp.arange(st.block_q)[:, None]


def _key_indices(st: Settings, kb):
  """Key block kb's indices [1, bk]."""
  return kb * st.block_k + jnp.arange(st.block_k)[None, :]


def _key_blocks_seen(st: Settings, offset_ref, qb, num_k: int):
  """How many key blocks query block qb visits: under the causal mask, up to
  the one holding its last query's diagonal."""
  if not st.causal:
    return num_k
  return jnp.minimum(num_k, (offset_ref[0] + (qb + 1) * st.block_q - 1) // st.block_k + 1)


def _visible(st: Settings, r: _Refs, b, head, q_idx, k_idx):
  """Which pairs of a block [bq, bk] are seen: keys before m, causal, and
  the Mask on its arrays' refs at indices clamped to the real ones."""
  visible = k_idx < st.m
  if st.causal:
    visible = visible & (k_idx <= q_idx)
  if st.mask is not None:
    last_query = r.offset[0] + st.n - 1
    seen = st.mask.with_arrays(r.mask)(b, head, jnp.minimum(q_idx, last_query),
                                       jnp.minimum(k_idx, st.m - 1))
    visible = visible & jnp.asarray(seen).astype(bool)
  return visible


def _dot_scores(st: Settings, q, k):
  """Scaled q.k of one block [bq, bk] float32."""
  return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * st.scale


def _scored(st: Settings, s, b, head, q_pos, k_pos, tables: dict, rows: dict):
  """(scored s, vjp: the scored s's cotangent -> (ds, d rows)); `rows` the
  differentiated rows (name -> loaded value), `tables` the score's other
  tables (_HeadRow over refs)."""
  if st.score is None:
    return s, lambda ct: (ct, {})
  shapes = dict(st.tables)

  def score(s, rows):
    values = {name: _HeadRow(row, shapes[name], False, head) for name, row in rows.items()}
    return st.score(s, b, head, q_pos, k_pos, Tables({**tables, **values}))
  return jax.vjp(score, s, rows)


def _block_range(r: _Refs, ids, lo, hi):
  """[lo, hi) narrowed to the program's non-empty blocks (with a Mask)."""
  if r.ranges is None:
    return lo, hi
  b, head, blk = _state_index(r.ranges, ids)
  return jnp.maximum(lo, r.ranges[b, head, blk, 0]), jnp.minimum(hi, r.ranges[b, head, blk, 1])


def _state_index(ref, ids):
  """(b, head, block) into an array [b | 1, h | 1, ..]: 0 on a broadcast axis."""
  b, head, blk = ids
  return (b if ref.shape[0] > 1 else 0), (head if ref.shape[1] > 1 else 0), blk


def _visit(st: Settings, r: _Refs, kernel: str, ids, lo, hi, body, carry):
  """body(i, carry, masked) for the blocks i in [lo, hi) of program ids (b,
  head, block): without a Mask every block masked; with one EMPTY blocks
  skipped, FULL ones unmasked. by_query kernels read states[.., block, i],
  the dkdv kernel states[.., i, block]."""

  def run(i, carry, masked):
    if VISIT_HOOK is not None and st.interpret:
      jax.debug.callback(functools.partial(VISIT_HOOK, kernel, masked), *ids, i)
    return body(i, carry, masked)

  if r.states is None:
    return jax.lax.fori_loop(lo, hi, lambda i, c: run(i, c, True), carry)
  b, head, blk = _state_index(r.states, ids)

  def step(i, carry):
    state = r.states[b, head, i, blk] if kernel == 'dkdv' else r.states[b, head, blk, i]
    branches = {masks.EMPTY: lambda c: c, masks.PARTIAL: lambda c: run(i, c, True),
                masks.FULL: lambda c: run(i, c, False)}
    return jax.lax.switch(state.astype(jnp.int32), [branches[s] for s in sorted(branches)],
                          carry)
  return jax.lax.fori_loop(lo, hi, step, carry)


def _forward_kernel(st: Settings, *refs):
  """One query block of one (batch, head): an online softmax over its key blocks."""
  r = _unpack(st, refs, backward=False)
  o_ref, lse_ref = r.out
  bk = st.block_k
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  head, qb = ids[1], ids[2]
  q = r.q[...]
  q_pos = r.q_pos[...][:, None]
  q_idx = _query_indices(st, r.offset, qb)
  tables = _head_rows(st, r, head)

  def body(kb, carry, masked):
    m_i, l_i, acc = carry
    keys = pl.ds(kb * bk, bk)
    s = _dot_scores(st, q, r.k[keys, :])
    if st.score is not None:
      s = st.score(s, ids[0], head, q_pos, r.k_pos[keys][None, :], tables)
    if masked:
      s = jnp.where(_visible(st, r, ids[0], head, q_idx, _key_indices(st, kb)), s, NEG_INF)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    rescale = jnp.exp(m_i - m_new)
    acc = acc * rescale[:, None] + jnp.dot(p.astype(r.v.dtype), r.v[keys, :],
                                           preferred_element_type=jnp.float32)
    return m_new, l_i * rescale + p.sum(axis=1), acc

  init = (jnp.full((st.block_q,), ROW_MAX_START, jnp.float32),
          jnp.zeros((st.block_q,), jnp.float32),
          jnp.zeros((st.block_q, r.v.shape[1]), jnp.float32))
  lo, hi = _block_range(r, ids, 0, _key_blocks_seen(st, r.offset, qb, r.k.shape[0] // bk))
  m_i, l_i, acc = _visit(st, r, 'forward', ids, lo, hi, body, init)
  seen = l_i > 0  # a row that sees no key: output 0, and p = 0 in the backward
  o_ref[...] = (acc / jnp.where(seen, l_i, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m_i + jnp.log(l_i), -NEG_INF)


def _dkdv_kernel(st: Settings, *refs):
  """One key block of one (batch, query head): its dk and dv over the query
  blocks that see it."""
  r = _unpack(st, refs, backward=True)
  do_ref, lse_ref, delta_ref = r.grads_in
  dk_ref, dv_ref = r.out
  bq = st.block_q
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  head, kb = ids[1], ids[2]
  k, v = r.k[...], r.v[...]
  k_pos = r.k_pos[...][None, :]
  k_idx = _key_indices(st, kb)
  tables = _head_rows(st, r, head)

  def body(qb, carry, masked):
    dk, dv = carry
    rows = pl.ds(qb * bq, bq)
    q, do = r.q[rows, :], do_ref[rows, :]
    s, vjp = _scored(st, _dot_scores(st, q, k), ids[0], head, r.q_pos[rows][:, None], k_pos,
                     tables, {})
    if masked:
      s = jnp.where(_visible(st, r, ids[0], head, _query_indices(st, r.offset, qb), k_idx), s,
                    NEG_INF)
    p = jnp.exp(s - lse_ref[rows][:, None])
    dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = vjp(p * (dp - delta_ref[rows][:, None]))[0] * st.scale
    dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return dk, dv

  num_q = r.q.shape[0] // bq
  lo = jnp.clip((kb * st.block_k - r.offset[0]) // bq, 0, num_q) if st.causal else 0
  lo, hi = _block_range(r, ids, lo, num_q)
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = _visit(st, r, 'dkdv', ids, lo, hi, body, init)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(st: Settings, *refs):
  """One query block of one (batch, head): its dq over the key blocks it
  sees, and its share of the differentiated tables' row gradients."""
  r = _unpack(st, refs, backward=True)
  do_ref, lse_ref, delta_ref = r.grads_in
  dq_ref, *drow_refs = r.out
  bk = st.block_k
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  head, qb = ids[1], ids[2]
  q, do = r.q[...], do_ref[...]
  q_pos = r.q_pos[...][:, None]
  q_idx = _query_indices(st, r.offset, qb)
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  values = {name: r.tables[name][...] for name in st.grads}
  tables = {name: row for name, row in _head_rows(st, r, head).items() if name not in values}

  def body(kb, carry, masked):
    dq, drows = carry
    keys = pl.ds(kb * bk, bk)
    k = r.k[keys, :]
    s, vjp = _scored(st, _dot_scores(st, q, k), ids[0], head, q_pos, r.k_pos[keys][None, :],
                     tables, values)
    if masked:
      s = jnp.where(_visible(st, r, ids[0], head, q_idx, _key_indices(st, kb)), s, NEG_INF)
    p = jnp.exp(s - lse)
    dp = jax.lax.dot_general(do, r.v[keys, :], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    ds, d_rows = vjp(p * (dp - delta))
    dq = dq + jnp.dot((ds * st.scale).astype(k.dtype), k, preferred_element_type=jnp.float32)
    return dq, {name: drows[name] + d_rows[name].astype(jnp.float32) for name in drows}

  init = (jnp.zeros(q.shape, jnp.float32),
          {name: jnp.zeros(value.shape, jnp.float32) for name, value in values.items()})
  lo, hi = _block_range(r, ids, 0, _key_blocks_seen(st, r.offset, qb, r.k.shape[0] // bk))
  dq, drows = _visit(st, r, 'dq', ids, lo, hi, body, init)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  for name, ref in zip(st.grads, drow_refs):
    ref[...] = drows[name]


# ---------------------------------------------------------------------------
# The calls.


def _specs(n_pad, m_pad, h, g, d, st: Settings, by_query: bool):
  """BlockSpecs of (q, k and v, q_pos, k_pos, offset) for a grid (b, h,
  blocks): a block of the blocked side, the other side whole."""
  rep = h // g
  if by_query:
    q = pl.BlockSpec((None, st.block_q, None, d), lambda i, j, t: (i, t, j, 0))
    kv = pl.BlockSpec((None, m_pad, None, d), lambda i, j, t: (i, 0, j // rep, 0))
    qpos = pl.BlockSpec((st.block_q,), lambda i, j, t: (t,))
    kpos = pl.BlockSpec((m_pad,), lambda i, j, t: (0,))
  else:
    q = pl.BlockSpec((None, n_pad, None, d), lambda i, j, t: (i, 0, j, 0))
    kv = pl.BlockSpec((None, st.block_k, None, d), lambda i, j, t: (i, t, j // rep, 0))
    qpos = pl.BlockSpec((n_pad,), lambda i, j, t: (0,))
    kpos = pl.BlockSpec((st.block_k,), lambda i, j, t: (t,))
  offset = pl.BlockSpec((1,), lambda i, j, t: (0,))
  return q, kv, qpos, kpos, offset


def _operands(tables: dict, mask_arrays: tuple, blocks: Blocks | None, by_query: bool):
  """The kernels' trailing operands (tables by name, the mask's arrays, the
  block states and ranges) and their BlockSpecs: each program reads its
  head's row of every table and the rest whole."""
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, t, nd=x.ndim: (0,) * nd)
  row = lambda x: pl.BlockSpec((None, *x.shape[1:]),
                               lambda i, j, t, nd=x.ndim: (j,) + (0,) * (nd - 1))
  arrays = [tables[name] for name in sorted(tables)]
  specs = [row(x) for x in arrays]
  arrays += list(mask_arrays)
  if blocks is not None:
    arrays += [blocks.states, blocks.by_query if by_query else blocks.by_key]
  specs += [whole(x) for x in arrays[len(specs):]]
  return arrays, specs


def _forward(st: Settings, q, k, v, q_pos, k_pos, offset, tables, mask_arrays, blocks):
  """Padded inputs -> (out [b, n_pad, h, dv], lse float32 [b, h, n_pad])."""
  b, n_pad, h, d = q.shape
  m_pad, g = k.shape[1], k.shape[2]
  q_spec, kv, qpos, kpos, off = _specs(n_pad, m_pad, h, g, d, st, True)
  extra, extra_specs = _operands(tables, mask_arrays, blocks, True)
  return pl.pallas_call(
      functools.partial(_forward_kernel, st), grid=(b, h, n_pad // st.block_q),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, *extra_specs],
      out_specs=[pl.BlockSpec((None, st.block_q, None, v.shape[3]),
                              lambda i, j, t: (i, t, j, 0)),
                 pl.BlockSpec((None, None, st.block_q), lambda i, j, t: (i, j, t))],
      out_shape=[jax.ShapeDtypeStruct((b, n_pad, h, v.shape[3]), q.dtype),
                 jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32)],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_forward',
  )(q, k, v, q_pos, k_pos, offset, *extra)


def _dkdv(st: Settings, q, k, v, q_pos, k_pos, offset, tables, mask_arrays, blocks, d_out, lse,
          delta):
  """dk and dv per query head, float32 [b, m_pad, h, d] and [b, m_pad, h, dv]."""
  b, n_pad, h, d = q.shape
  m_pad, g = k.shape[1], k.shape[2]
  by_rows = pl.BlockSpec((None, None, n_pad), lambda i, j, t: (i, j, 0))
  q_spec, kv, qpos, kpos, off = _specs(n_pad, m_pad, h, g, d, st, False)
  extra, extra_specs = _operands(tables, mask_arrays, blocks, False)
  return pl.pallas_call(
      functools.partial(_dkdv_kernel, st), grid=(b, h, m_pad // st.block_k),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, q_spec, by_rows, by_rows, *extra_specs],
      out_specs=[pl.BlockSpec((None, st.block_k, None, x.shape[3]), lambda i, j, t: (i, t, j, 0))
                 for x in (k, v)],
      out_shape=[jax.ShapeDtypeStruct((b, m_pad, h, x.shape[3]), jnp.float32) for x in (k, v)],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_dkdv',
  )(q, k, v, q_pos, k_pos, offset, d_out, lse, delta, *extra)


def _dq(st: Settings, q, k, v, q_pos, k_pos, offset, tables, mask_arrays, blocks, d_out, lse,
        delta):
  """dq [b, n_pad, h, d] in q's dtype, and the row gradients of the tables
  st.grads, float32 [b, h, num_q_blocks, *row] each."""
  b, n_pad, h, d = q.shape
  m_pad, g = k.shape[1], k.shape[2]
  nq = n_pad // st.block_q
  rows = pl.BlockSpec((None, None, st.block_q), lambda i, j, t: (i, j, t))
  q_spec, kv, qpos, kpos, off = _specs(n_pad, m_pad, h, g, d, st, True)
  extra, extra_specs = _operands(tables, mask_arrays, blocks, True)
  row_shapes = [tables[name].shape[1:] for name in st.grads]
  return pl.pallas_call(
      functools.partial(_dq_kernel, st), grid=(b, h, nq),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, q_spec, rows, rows, *extra_specs],
      out_specs=[pl.BlockSpec((None, st.block_q, None, d), lambda i, j, t: (i, t, j, 0))] + [
          pl.BlockSpec((None, None, None, *shape),
                       lambda i, j, t, nd=len(shape): (i, j, t) + (0,) * nd)
          for shape in row_shapes],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] + [
          jax.ShapeDtypeStruct((b, h, nq, *shape), jnp.float32) for shape in row_shapes],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_dq',
  )(q, k, v, q_pos, k_pos, offset, d_out, lse, delta, *extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: Settings, q, k, v, q_pos, k_pos, offset, tables, mask_arrays, blocks):
  """-> (out [b, n_pad, h, dv], lse float32 [b, h, n_pad], -inf where a query
  sees no key)."""
  out, lse = _forward(st, q, k, v, q_pos, k_pos, offset, tables, mask_arrays, blocks)
  return out, _public_lse(lse)


def _public_lse(lse):
  """The kernel's lse (-NEG_INF, far above any score, where a row sees no
  key: its p = exp(s - lse) is 0 in the backward) with -inf there."""
  return jnp.where(lse == -NEG_INF, -jnp.inf, lse)


def _attention_fwd(st: Settings, *primals):
  """With symbolic zeros: the tables a gradient asks for (perturbed, of a
  floating dtype) go to the backward as the residuals' structure."""
  args = [jax.tree.map(lambda p: p.value, x) for x in primals]
  tables = primals[6]
  wanted = {name: None for name, p in tables.items()
            if p.perturbed and jnp.issubdtype(p.value.dtype, jnp.inexact)}
  out, lse = _forward(st, *args)
  return (out, _public_lse(lse)), (args, out, lse, wanted)


def _backward(st: Settings, res, cotangents):
  args, out, lse, wanted = res
  d_out, d_lse = cotangents
  q, k, v, q_pos, k_pos, offset, tables, mask_arrays, blocks = args
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jnp.zeros(out.shape, out.dtype)
  st = dataclasses.replace(st, grads=tuple(sorted(wanted)))
  b, m_pad, g = k.shape[0], k.shape[1], k.shape[2]
  h = q.shape[2]
  delta = jnp.einsum('bnhd,bnhd->bhn', out.astype(jnp.float32), d_out.astype(jnp.float32))
  if not isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
    # d lse_i / d s_ij = p_ij, so ds_ij = p_ij (dp_ij - delta_i + dlse_i): dlse joins delta.
    delta = delta - d_lse.astype(jnp.float32)
  dk, dv = _dkdv(st, *args, d_out, lse, delta)
  dq, *drows = _dq(st, *args, d_out, lse, delta)
  group = lambda x, like: x.reshape(b, m_pad, g, h // g, x.shape[3]).sum(axis=3).astype(like.dtype)
  d_tables = {name: None for name in tables}
  for name, drow in zip(st.grads, drows):
    d_tables[name] = drow.sum(axis=(0, 2)).astype(tables[name].dtype)
  none = lambda tree: jax.tree.map(lambda _: None, tree)
  return (dq, group(dk, k), group(dv, v), None, None, None, d_tables, none(mask_arrays),
          none(blocks))


_attention.defvjp(_attention_fwd, _backward, symbolic_zeros=True)


def block_states(st: Settings, mask: masks.Mask, b: int, h: int, q_offset) -> Blocks:
  """A Mask's Blocks for a call (with `causal`, the mask and causal): b
  rows, h query heads, st.n queries at q_offset + i and st.m keys."""
  if st.causal:
    mask = mask & masks.causal()
  states = masks.block_mask(mask, b, h, st.n, st.m, st.block_q, st.block_k,
                            q_offset).astype(jnp.int32)
  occupied = states != masks.EMPTY

  def ranges(occupied):  # [.., count] -> [.., 2]: from the first occupied to the last
    count = occupied.shape[-1]
    index = jnp.arange(count, dtype=jnp.int32)
    lo = jnp.min(jnp.where(occupied, index, count), axis=-1)
    hi = jnp.maximum(lo, jnp.max(jnp.where(occupied, index + 1, 0), axis=-1))
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)

  return Blocks(states, ranges(occupied), ranges(jnp.swapaxes(occupied, -1, -2)))


def table_problem(tables, h: int) -> str | None:
  """None where every table (name -> array) is per head, [h, ...], as the
  kernel reads them; else which one is not."""
  for name, table in (tables or {}).items():
    shape = tuple(jnp.shape(table))
    if not shape or shape[0] != h:
      return f'table {name!r} has shape {shape}: a table is per head, [{h}, ...] for {h} heads'
  return None


def _per_head_tables(tables: dict | None, h: int) -> dict:
  """The tables as the kernels read them: a [h] table as [h, 1] (a head's
  row has an axis), the rows' axes zero-padded to powers of two."""
  problem = table_problem(tables, h)
  if problem is not None:
    raise ValueError(problem)
  out = {}
  for name, table in (tables or {}).items():
    table = jnp.asarray(table)
    table = table[:, None] if table.ndim == 1 else table
    out[name] = jnp.pad(table, [(0, 0)] + [(0, (1 << (size - 1).bit_length()) - size)
                                           for size in table.shape[1:]])
  return out


def flash_attention(q, k, v, *, score=None, tables: dict | None = None,
                    mask: masks.Mask | None = None, q_positions=None, k_positions=None,
                    causal: bool = False, q_offset=0, block_q: int = 64, block_k: int = 64,
                    interpret: bool = False, return_lse: bool = False):
  """Attention with a score function and a mask in one fused kernel (module
  docstring).

  Args:
    q: [b, n, h, d]; k: [b, m, g, d]; v: [b, m, g, dv]; g divides h.
    score: (s, b, head, q_pos, k_pos, tables) -> s, elementwise; None: plain
      dot-product attention.
    tables: name -> per-head array [h, ...], read by the score as
      tables[name][head] or tables[name][head, idx]; the floating ones get
      gradients.
    mask: a masks.Mask, or None; with `causal` both apply. Query i is at
      index q_offset + i; the mask's data are its arrays (Pallas refuses a
      kernel that closes over an array), covering the indices it reads
      (queries q_offset .. q_offset + n - 1, keys 0 .. m - 1).
    q_positions: int [n] (default q_offset + 0..n-1); k_positions: int [m]
      (default 0..m-1): what `score` sees as positions.
    causal: query i (index q_offset + i) sees the keys j <= q_offset + i.
    block_q, block_k: the tiles; the lengths are padded to them.
    interpret: run in Pallas's interpreter (any backend).
    return_lse: return each row's log-sum-exp of its scores too
      (differentiable; -inf for a query that sees no key).
  Returns:
    [b, n, h, dv] in q's dtype, 0 for a query that sees no key; with
    return_lse, (that, lse float32 [b, h, n]).
  """
  b, n, h, d = q.shape
  m, g = k.shape[1], k.shape[2]
  if h % g:
    raise ValueError(f'{g} key/value heads do not divide {h} query heads')
  originals = {name: jnp.shape(t) for name, t in (tables or {}).items()}
  tables = _per_head_tables(tables, h)
  block_q, block_k = min(block_q, _round_up(n)), min(block_k, _round_up(m))
  template = None if mask is None else mask.with_arrays(
      jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in mask.arrays)
  st = Settings(block_q, block_k, causal, n, m, float(d) ** -0.5, interpret, score,
                tuple((name, originals[name]) for name in sorted(tables)), template)
  offset = jnp.asarray(q_offset, jnp.int32).reshape(1)
  blocks = None if mask is None else block_states(st, mask, b, h, offset[0])
  q_positions = (offset[0] + jnp.arange(n) if q_positions is None else q_positions)
  k_positions = jnp.arange(m) if k_positions is None else k_positions
  out, lse = _attention(st, _pad(q, 1, block_q), _pad(k, 1, block_k), _pad(v, 1, block_k),
                        _pad(jnp.asarray(q_positions, jnp.int32), 0, block_q),
                        _pad(jnp.asarray(k_positions, jnp.int32), 0, block_k), offset, tables,
                        tuple(jnp.asarray(a) for a in (mask.arrays if mask else ())), blocks)
  return (out[:, :n], lse[:, :, :n]) if return_lse else out[:, :n]


def _round_up(x: int) -> int:
  """The power of two at or above x, at least 16 (Triton's smallest dot tile)."""
  return max(16, 1 << (x - 1).bit_length())
