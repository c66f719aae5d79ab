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
`table[head, idx]` reads the entries by a gather load from the row's ref
in every kernel; its gradient (`_read`) sums the cotangent per entry, one
select pass per entry between the block's least and greatest index:
Triton lowers neither a gather from a loaded value nor its transpose, a
scatter-add, and a block past T5's last bucket, whose pairs all read one
entry, costs one pass.

Lookups: tables indexed by a query (or a key) position, [b, h, n, R] (or
[b, h, m, R]), made once per call before the kernel (Shaw's q . a^K_r as
q @ table^T, DeBERTa's c2p and p2c): the scores, before the score
function, gain rows[i, index(q_pos, k_pos)_ij] (or rows[j, ..]), index a
function of the block's positions. A program reads its block's rows by
BlockSpec (the other side's rows whole) and the entries by a gather load
(a block whose pairs all read one entry, wholly past a clip, loads it once
per row);
their gradients are each row's ds summed per entry, in the dq kernel for
per-query tables and in the dk/dv kernel for per-key ones (`_bucket_sum`:
one select pass per entry between a block's least and greatest index, so a
block wholly past a clip costs one; a table wider than CARRIED_ENTRIES,
DeBERTa's, sums them in the kernel's output, in aligned windows of entries,
except a block wholly past a clip, whose one entry's sums stay in
registers), and reach q, k and the position tables through the product
that made them (autodiff, outside). A value
lookup (index, table [R, dv]) adds sum_j p_ij table[index_ij] to the
output (Shaw's a^V): the forward sums each row's weights per entry beside
the output, rescaled with it, multiplies by the table once at the end and
saves the normalised sums P [b, h, n, R]; the backward's dp_ij gains
dO_i . table[index_ij] (the rows dO @ table^T, made before the kernels,
read as a lookup's) and the table's gradient is P^T dO.

Mask: `causal` by index (query i at q_offset + i sees keys j <= q_offset +
i; key blocks past the diagonal are not visited, and those wholly at or
before a block's first query run without the select), keys past m hidden, and
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

# The tiles' rows and columns, and Triton's warps per program and software
# pipeline stages, where a call names none (select.py gives measured ones).
BLOCK = 64
WARPS = 4
STAGES = 2


class Tiles(NamedTuple):
  """How a call is cut for the GPU: query and key rows per block, Triton's
  warps per program and pipeline stages (flash_attention's arguments)."""
  block_q: int = BLOCK
  block_k: int = BLOCK
  num_warps: int = WARPS
  num_stages: int = STAGES

NEG_INF = -1e30  # finite: a fully hidden block must not make exp(NaN)
# A lookup table of more entries than this gathers its gradient rows in the
# kernel's output ref, this many entries at a time, not in the loop's carry:
# [block, entries] float32 there would take the registers the products need
# (DeBERTa's 512 entries: 256 a thread at 4 warps).
CARRIED_ENTRIES = 64
# The running row maximum starts above NEG_INF, so that hidden scores weigh
# exp(NEG_INF / 2) = 0 even in a row that has seen no key yet.
ROW_MAX_START = NEG_INF / 2

# None, or a function(kernel, masked, b, head, program_block, loop_block) that
# interpret-mode calls report each block they compute to (jax.debug.callback;
# kernel 'forward', 'dkdv' or 'dq'; masked False for a FULL block): read
# while tracing; tests count the blocks visited.
VISIT_HOOK = None
# None, or a function(kind, first entry, ref's width) that interpret-mode
# calls report each read and write (kind 'read', 'write') of a wide table's
# gradient window to.
WINDOW_HOOK = None


@dataclasses.dataclass(frozen=True)
class Settings:
  """A call's static settings: block sizes, causal, the real query and key
  counts n and m (past them: padding), the score scale, how the call runs,
  the score, the tables' names and shapes [h, ...] (sorted by name), the
  mask (its arrays as shapes; None: no Mask), the tables whose gradient
  the dq kernel takes, each lookup table's (side, index) and the value
  lookup's index (None: none)."""
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
  lookups: tuple[tuple[str, Callable[..., Any]], ...] = ()
  values: Callable[..., Any] | None = None
  num_warps: int = WARPS
  num_stages: int = STAGES

  def sides(self, side: str) -> tuple[int, ...]:
    """The positions in `lookups` of the tables on `side` ('query', 'key')."""
    return tuple(i for i, (s, _) in enumerate(self.lookups) if s == side)

  def compiler_params(self):
    # Triton's parameters choose the Triton lowering (the default GPU lowering
    # is Mosaic GPU's, which takes no elementwise score this way).
    return pl_triton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


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
  docstring): `ref` its row's ref, and `value` the row loaded where a
  gradient asks for it (None elsewhere); table[head] is the row,
  table[head, *idx] the row at idx. Indexed first by anything but the
  program's `head` (a batch row, a position) it refuses: the BlockSpec gave
  this program one head's row only."""

  def __init__(self, ref, shape: tuple[int, ...], head, value=None):
    self.ref, self.shape, self.head, self.value = ref, shape, head, value
    self.ndim, self.dtype = len(shape), ref.dtype

  def __getitem__(self, key):
    if (key[0] if isinstance(key, tuple) else key) is not self.head:
      raise ValueError('the fused Pallas kernel reads a table per head, as tables[name][h] or '
                       'tables[name][h, ...]; this score indexes one first by something else '
                       "(a batch row, a position): run it with kernel='dense' or 'chunked'")
    rest = key[1:] if isinstance(key, tuple) else ()
    if rest:
      one_array = len(rest) == 1 and getattr(rest[0], 'ndim', 0) > 0  # T5's buckets
      gathered = _gathered_once(self.ref, (), rest[0]) if one_array else self.ref[rest]
      return gathered if self.value is None else _read(self.value, _flat(self.value, rest),
                                                       gathered)
    row = self.ref if self.value is None else self.value
    if self.ndim == 1:  # a [h] table's row, [1]
      return row[...]
    return row[tuple(slice(0, size) for size in self.shape[1:])]  # without its padding


def _flat(row, idx):
  """The flat index into row [r0, ..] of int arrays idx (one per axis)."""
  flat = idx[0]
  for i, size in zip(idx[1:], row.shape[1:]):
    flat = flat * size + i
  return jnp.asarray(flat, jnp.int32)


@jax.custom_vjp
def _read(row, flat, gathered):
  """row.reshape(-1)[flat] for a differentiated row [r0, ..], its value
  `gathered` read from the row's ref by a gather load (Triton has no gather
  from a loaded value, nor its transpose, a scatter-add)."""
  del row, flat
  return gathered


def _read_fwd(row, flat, gathered):
  return gathered, (row, flat)


def _read_bwd(res, ct):
  """The row's gradient: the cotangent summed per entry (_bucket_sum: a
  block whose pairs all read one entry, past T5's last bucket, costs one
  pass)."""
  row, flat = res
  d_row = _bucket_sum(jnp.broadcast_to(ct, flat.shape).astype(jnp.float32), flat, row.size)
  return d_row.reshape(row.shape).astype(row.dtype), None, None


_read.defvjp(_read_fwd, _read_bwd)


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
  d_values: Any  # the backward's dO . a^V rows [.., R] under a value lookup, else None
  tables: dict  # name -> the head's row ref
  lookups: tuple  # each lookup table's rows [.., R] (Settings.lookups' order)
  value_table: Any  # the value lookup's table [R, dv], or None
  mask: tuple  # the mask's arrays, whole
  states: Any  # Blocks.states, or None without a Mask
  ranges: Any  # Blocks.by_query or by_key, or None
  out: tuple


def _unpack(st: Settings, refs, backward: bool) -> _Refs:
  refs = list(refs)
  take = lambda count: [refs.pop(0) for _ in range(count)]
  head = take(6)
  grads_in = tuple(take(3 if backward else 0))
  d_values = take(1)[0] if backward and st.values is not None else None
  tables = dict(zip((name for name, _ in st.tables), take(len(st.tables))))
  lookups = tuple(take(len(st.lookups)))
  value_table = take(1)[0] if st.values is not None else None
  mask = tuple(take(0 if st.mask is None else len(st.mask.arrays)))
  states, ranges = take(2) if st.mask is not None else (None, None)
  return _Refs(*head, grads_in, d_values, tables, lookups, value_table, mask, states, ranges,
               tuple(refs))


def _head_rows(st: Settings, r: _Refs, head):
  """The score's `tables`: a _HeadRow over each head row's ref."""
  shapes = dict(st.tables)
  return Tables({name: _HeadRow(ref, shapes[name], head) for name, ref in r.tables.items()})


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


def _gathered(ref, side: str, starts, idx):
  """ref[row, idx[i, j]] for a block's pairs, row the block's query i (side
  'query') or key j ('key'): a gather load (Triton has no gather from a
  loaded value). starts: (first query row, first key row) of the block in
  the ref, 0 on the side the BlockSpec blocked."""
  bq, bk = idx.shape
  if side == 'query':
    rows = starts[0] + jnp.arange(bq)[:, None]
  else:
    rows = starts[1] + jnp.arange(bk)[None, :]
  return _gathered_once(ref, (rows,), idx).astype(jnp.float32)


def _gathered_once(ref, lead: tuple, idx):
  """ref[*lead, idx] (idx int [bq, bk]) by a gather load per pair, or, in a
  block whose pairs all read one entry (wholly past Shaw's clip or T5's
  last bucket), that entry loaded once per row and broadcast."""
  lo = jnp.min(idx)
  return jax.lax.cond(lo == jnp.max(idx),
                      lambda: jnp.broadcast_to(ref[(*lead, lo)], idx.shape),
                      lambda: ref[(*lead, idx)])


def _with_lookups(st: Settings, r: _Refs, s, q_pos, k_pos, starts):
  """(s [bq, bk] plus every lookup table's entries, their indices int32
  [bq, bk] in Settings.lookups' order)."""
  indices = []
  for (side, index), ref in zip(st.lookups, r.lookups):
    idx = jnp.broadcast_to(index(q_pos, k_pos), s.shape).astype(jnp.int32)
    s = s + _gathered(ref, side, starts, idx)
    indices.append(idx)
  return s, tuple(indices)


def _bucket_sum(x, idx, size: int, axis: int | None = None, first=None, last=None):
  """x float32 summed per entry idx (int, x's shape) in [0, size): over
  everything -> [size] (axis None), or for x [bq, bk] over `axis` -> [bq,
  size] (axis 1: per query) or [bk, size] (axis 0: per key). One select
  pass per entry between the block's least and greatest index (or over
  [first, last)): a block wholly past a clip, where every pair reads one
  entry, costs one pass."""
  entries = jnp.arange(size)
  kept = () if axis is None else (x.shape[1 - axis],)

  def add(e, acc):
    part = jnp.sum(jnp.where(idx == e, x, 0.0), axis=axis)
    return jnp.where(entries == e, acc + part[..., None], acc)
  first = jnp.min(idx) if first is None else first
  last = jnp.max(idx) + 1 if last is None else last
  return jax.lax.fori_loop(first, last, add, jnp.zeros(kept + (size,), jnp.float32))


def _bucket_add(ref, x, idx, axis: int):
  """ref [rows, width] += x [bq, bk] summed per entry idx over `axis`
  (_bucket_sum's), for a table too wide to carry (width a power of two, a
  multiple of CARRIED_ENTRIES): the block's entries CARRIED_ENTRIES at a
  time, in the ref's aligned windows that hold them, each summed in
  registers and added once. Every read and write of the ref is one whole
  aligned window, so an entry's element belongs to the same thread in each:
  a Triton program orders a load after a store to one address only within
  a thread, and a window at another offset (or a row's single column, held
  by several threads) could read a sum before another thread's store."""
  width = CARRIED_ENTRIES
  lo, hi = jnp.min(idx), jnp.max(idx) + 1

  def window(w, carry):
    base = w * width
    part = _bucket_sum(x, idx - base, width, axis, jnp.maximum(lo, base) - base,
                       jnp.minimum(hi, base + width) - base)
    _window_write(ref, base, _window_read(ref, base) + part)
    return carry
  jax.lax.fori_loop(lo // width, (hi - 1) // width + 1, window, 0)


def _window_read(ref, base):
  if WINDOW_HOOK is not None:
    jax.debug.callback(functools.partial(WINDOW_HOOK, 'read'), base, ref.shape[1])
  return ref[:, pl.ds(base, CARRIED_ENTRIES)]


def _window_write(ref, base, value):
  if WINDOW_HOOK is not None:
    jax.debug.callback(functools.partial(WINDOW_HOOK, 'write'), base, ref.shape[1])
  ref[:, pl.ds(base, CARRIED_ENTRIES)] = value


def _column_add(ref, entry, sums):
  """ref[:, entry] += sums [rows], through the aligned window that holds it."""
  base = entry // CARRIED_ENTRIES * CARRIED_ENTRIES
  column = jnp.arange(CARRIED_ENTRIES)[None, :] == entry - base
  _window_write(ref, base, _window_read(ref, base) + jnp.where(column, sums[:, None], 0.0))


def _wide_add(ref, far, x, idx, axis: int):
  """A wide table's gradient (ref [rows, width]) gains x [bq, bk] summed per
  entry idx over `axis`; far: (sums [rows], entry), the registers' sums for
  the entry of the last block whose pairs all read one (-1: none yet). Such a
  block, wholly past a clip, adds to them; they go to the ref when a block of
  another single entry comes (under a clipped distance at most twice a
  program: the far blocks before the band, then those after it) and at the
  end (_wide_flush). Other blocks add window by window (_bucket_add). -> the
  new far."""
  sums, entry = far
  lo, hi = jnp.min(idx), jnp.max(idx) + 1
  one = hi - lo == 1
  moved = one & (entry >= 0) & (entry != lo)

  @pl.when(moved)
  def _():
    _column_add(ref, entry, sums)

  @pl.when(jnp.logical_not(one))
  def _():
    _bucket_add(ref, x, idx, axis)

  block = jnp.sum(x, axis=axis)
  return (jnp.where(one, jnp.where(moved, 0.0, sums) + block, sums), jnp.where(one, lo, entry))


def _wide_flush(ref, far):
  sums, entry = far

  @pl.when(entry >= 0)
  def _():
    _column_add(ref, entry, sums)


def _lookup_grads_init(refs) -> tuple:
  """The loop's carry for the gradients of lookup tables (refs: their output
  refs [rows, entries]): zeros for a table of at most CARRIED_ENTRIES
  entries; for a wider one, whose ref is zeroed window by window to gather
  them, _wide_add's far carry."""
  out = []
  for ref in refs:
    if ref.shape[1] <= CARRIED_ENTRIES:
      out.append(jnp.zeros(ref.shape, jnp.float32))
      continue

    def zero(w, carry, ref=ref):
      _window_write(ref, w * CARRIED_ENTRIES,
                    jnp.zeros((ref.shape[0], CARRIED_ENTRIES), jnp.float32))
      return carry
    jax.lax.fori_loop(0, ref.shape[1] // CARRIED_ENTRIES, zero, 0)
    out.append((jnp.zeros((ref.shape[0],), jnp.float32), jnp.int32(-1)))
  return tuple(out)


def _lookup_grads_add(accs, refs, ds, indices, axis: int) -> tuple:
  """The carry `accs` plus ds [bq, bk] summed per entry of each table
  (indices, theirs) over `axis`; a wide table's through _wide_add."""
  out = []
  for acc, ref, idx in zip(accs, refs, indices):
    if ref.shape[1] > CARRIED_ENTRIES:
      out.append(_wide_add(ref, acc, ds, idx, axis))
    else:
      out.append(acc + _bucket_sum(ds, idx, acc.shape[1], axis))
  return tuple(out)


def _lookup_grads_store(refs, accs):
  for ref, acc in zip(refs, accs):
    if ref.shape[1] > CARRIED_ENTRIES:
      _wide_flush(ref, acc)
    else:
      ref[...] = acc


def _value_index(st: Settings, q_pos, k_pos, shape):
  return jnp.broadcast_to(st.values(q_pos, k_pos), shape).astype(jnp.int32)


def _dp(st: Settings, r: _Refs, do, v, q_pos, k_pos, starts):
  """The scores' dp [bq, bk] = dO . v_j, plus dO . a^V_idx under a value
  lookup (the rows dO . a^V, made before the kernel, read by index)."""
  dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  if st.values is not None:
    dp = dp + _gathered(r.d_values, 'query', starts, _value_index(st, q_pos, k_pos, dp.shape))
  return dp


def _scored(st: Settings, r: _Refs, s, b, head, q_pos, k_pos, tables: dict, rows: dict):
  """(scored s, vjp: the scored s's cotangent -> (ds, d rows)); `rows` the
  differentiated rows (name -> loaded value; entries read from their refs),
  `tables` the score's other tables (_HeadRow over refs)."""
  if st.score is None:
    return s, lambda ct: (ct, {})
  shapes = dict(st.tables)

  def score(s, rows):
    values = {name: _HeadRow(r.tables[name], shapes[name], head, row)
              for name, row in rows.items()}
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


def _whole_blocks(st: Settings, r: _Refs, kernel: str, block):
  """Where, without a Mask, the blocks that program block `block` visits
  turn from wholly seen (every key real and, under causal, at or before the
  block's first query) to not: for a query block (the forward and dq
  kernels) the end of a prefix of the key blocks; for a key block (dkdv) the
  start of a suffix of the query blocks, none if it holds padding keys."""
  bq, bk = st.block_q, st.block_k
  if kernel != 'dkdv':
    end = st.m // bk
    if st.causal:
      end = jnp.minimum(end, jnp.maximum(r.offset[0] + block * bq + 1, 0) // bk)
    return end
  num_q = r.q.shape[0] // bq
  start = 0
  if st.causal:  # the first query block whose first query is at or past the key block's last
    start = jnp.clip(-((r.offset[0] - (block + 1) * bk + 1) // bq), 0, num_q)
  return jnp.where((block + 1) * bk <= st.m, start, num_q)


def _visit(st: Settings, r: _Refs, kernel: str, ids, lo, hi, body, carry):
  """body(i, carry, masked) for the blocks i in [lo, hi) of program ids (b,
  head, block), in order: without a Mask those wholly seen (_whole_blocks)
  unmasked, the others masked; with one EMPTY blocks skipped, FULL ones
  unmasked. by_query kernels read states[.., block, i], the dkdv kernel
  states[.., i, block]."""

  def run(i, carry, masked):
    if VISIT_HOOK is not None and st.interpret:
      jax.debug.callback(functools.partial(VISIT_HOOK, kernel, masked), *ids, i)
    return body(i, carry, masked)

  if r.states is None:  # two runs of blocks: the wholly seen ones first (by query) or last
    cut = jnp.clip(_whole_blocks(st, r, kernel, ids[2]), lo, hi)
    first_masked = kernel == 'dkdv'
    carry = jax.lax.fori_loop(lo, cut, lambda i, c: run(i, c, first_masked), carry)
    return jax.lax.fori_loop(cut, hi, lambda i, c: run(i, c, not first_masked), carry)
  b, head, blk = _state_index(r.states, ids)

  def step(i, carry):
    state = r.states[b, head, i, blk] if kernel == 'dkdv' else r.states[b, head, blk, i]
    branches = {masks.EMPTY: lambda c: c, masks.PARTIAL: lambda c: run(i, c, True),
                masks.FULL: lambda c: run(i, c, False)}
    return jax.lax.switch(state.astype(jnp.int32), [branches[s] for s in sorted(branches)],
                          carry)
  return jax.lax.fori_loop(lo, hi, step, carry)


def _forward_kernel(st: Settings, *refs):
  """One query block of one (batch, head): an online softmax over its key
  blocks; under a value lookup, each row's weights summed per entry beside
  the output, rescaled with it."""
  r = _unpack(st, refs, backward=False)
  o_ref, lse_ref, *sums_ref = r.out
  bk = st.block_k
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  head, qb = ids[1], ids[2]
  q = r.q[...]
  q_pos = r.q_pos[...][:, None]
  q_idx = _query_indices(st, r.offset, qb)
  tables = _head_rows(st, r, head)

  def body(kb, carry, masked):
    m_i, l_i, acc, sums = carry
    keys = pl.ds(kb * bk, bk)
    k_pos = r.k_pos[keys][None, :]
    s, _ = _with_lookups(st, r, _dot_scores(st, q, r.k[keys, :]), q_pos, k_pos, (0, kb * bk))
    if st.score is not None:
      s = st.score(s, ids[0], head, q_pos, k_pos, tables)
    if masked:
      s = jnp.where(_visible(st, r, ids[0], head, q_idx, _key_indices(st, kb)), s, NEG_INF)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    rescale = jnp.exp(m_i - m_new)
    acc = acc * rescale[:, None] + jnp.dot(p.astype(r.v.dtype), r.v[keys, :],
                                           preferred_element_type=jnp.float32)
    if st.values is not None:
      sums = sums * rescale[:, None] + _bucket_sum(
          p, _value_index(st, q_pos, k_pos, p.shape), sums.shape[1], 1)
    return m_new, l_i * rescale + p.sum(axis=1), acc, sums

  init = (jnp.full((st.block_q,), ROW_MAX_START, jnp.float32),
          jnp.zeros((st.block_q,), jnp.float32),
          jnp.zeros((st.block_q, r.v.shape[1]), jnp.float32),
          None if st.values is None else jnp.zeros((st.block_q, r.value_table.shape[0]),
                                                   jnp.float32))
  lo, hi = _block_range(r, ids, 0, _key_blocks_seen(st, r.offset, qb, r.k.shape[0] // bk))
  m_i, l_i, acc, sums = _visit(st, r, 'forward', ids, lo, hi, body, init)
  seen = l_i > 0  # a row that sees no key: output 0, and p = 0 in the backward
  norm = jnp.where(seen, l_i, 1.0)[:, None]
  if st.values is not None:
    acc = acc + jnp.dot(sums, r.value_table[...].astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    sums_ref[0][...] = sums / norm
  o_ref[...] = (acc / norm).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m_i + jnp.log(l_i), -NEG_INF)


def _dkdv_kernel(st: Settings, *refs):
  """One key block of one (batch, query head): its dk and dv over the query
  blocks that see it, and its rows of the per-key lookup tables' gradients."""
  r = _unpack(st, refs, backward=True)
  do_ref, lse_ref, delta_ref = r.grads_in
  dk_ref, dv_ref, *dlook_refs = r.out
  bq = st.block_q
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  head, kb = ids[1], ids[2]
  k, v = r.k[...], r.v[...]
  k_pos = r.k_pos[...][None, :]
  k_idx = _key_indices(st, kb)
  tables = _head_rows(st, r, head)
  by_key = st.sides('key')

  def body(qb, carry, masked):
    dk, dv, dlooks = carry
    rows = pl.ds(qb * bq, bq)
    q, do, q_pos = r.q[rows, :], do_ref[rows, :], r.q_pos[rows][:, None]
    starts = (qb * bq, 0)
    s, indices = _with_lookups(st, r, _dot_scores(st, q, k), q_pos, k_pos, starts)
    s, vjp = _scored(st, r, s, ids[0], head, q_pos, k_pos, tables, {})
    if masked:
      s = jnp.where(_visible(st, r, ids[0], head, _query_indices(st, r.offset, qb), k_idx), s,
                    NEG_INF)
    p = jnp.exp(s - lse_ref[rows][:, None])
    dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    dp = _dp(st, r, do, v, q_pos, k_pos, starts)
    ds = vjp(p * (dp - delta_ref[rows][:, None]))[0]
    dk = dk + jax.lax.dot_general((ds * st.scale).astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    dlooks = _lookup_grads_add(dlooks, dlook_refs, ds, [indices[i] for i in by_key], 0)
    return dk, dv, dlooks

  num_q = r.q.shape[0] // bq
  lo = jnp.clip((kb * st.block_k - r.offset[0]) // bq, 0, num_q) if st.causal else 0
  lo, hi = _block_range(r, ids, lo, num_q)
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32),
          _lookup_grads_init(dlook_refs))
  dk, dv, dlooks = _visit(st, r, 'dkdv', ids, lo, hi, body, init)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  _lookup_grads_store(dlook_refs, dlooks)


def _dq_kernel(st: Settings, *refs):
  """One query block of one (batch, head): its dq over the key blocks it
  sees, its share of the differentiated tables' row gradients, and its rows
  of the per-query lookup tables' gradients."""
  r = _unpack(st, refs, backward=True)
  do_ref, lse_ref, delta_ref = r.grads_in
  dq_ref, *drow_refs = r.out
  dlook_refs = drow_refs[len(st.grads):]
  bk = st.block_k
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  head, qb = ids[1], ids[2]
  q, do = r.q[...], do_ref[...]
  q_pos = r.q_pos[...][:, None]
  q_idx = _query_indices(st, r.offset, qb)
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  values = {name: r.tables[name][...] for name in st.grads}
  tables = {name: row for name, row in _head_rows(st, r, head).items() if name not in values}
  by_query = st.sides('query')

  def body(kb, carry, masked):
    dq, drows, dlooks = carry
    keys = pl.ds(kb * bk, bk)
    k, k_pos, starts = r.k[keys, :], r.k_pos[keys][None, :], (0, kb * bk)
    s, indices = _with_lookups(st, r, _dot_scores(st, q, k), q_pos, k_pos, starts)
    s, vjp = _scored(st, r, s, ids[0], head, q_pos, k_pos, tables, values)
    if masked:
      s = jnp.where(_visible(st, r, ids[0], head, q_idx, _key_indices(st, kb)), s, NEG_INF)
    p = jnp.exp(s - lse)
    ds, d_rows = vjp(p * (_dp(st, r, do, r.v[keys, :], q_pos, k_pos, starts) - delta))
    dq = dq + jnp.dot((ds * st.scale).astype(k.dtype), k, preferred_element_type=jnp.float32)
    dlooks = _lookup_grads_add(dlooks, dlook_refs, ds, [indices[i] for i in by_query], 1)
    return (dq, {name: drows[name] + d_rows[name].astype(jnp.float32) for name in drows},
            dlooks)

  init = (jnp.zeros(q.shape, jnp.float32),
          {name: jnp.zeros(value.shape, jnp.float32) for name, value in values.items()},
          _lookup_grads_init(dlook_refs))
  lo, hi = _block_range(r, ids, 0, _key_blocks_seen(st, r.offset, qb, r.k.shape[0] // bk))
  dq, drows, dlooks = _visit(st, r, 'dq', ids, lo, hi, body, init)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  for name, ref in zip(st.grads, drow_refs):
    ref[...] = drows[name]
  _lookup_grads_store(dlook_refs, dlooks)


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


class _Args(NamedTuple):
  """A call's padded arrays, as the custom_vjp carries them: q [b, n_pad, h,
  d], k and v [b, m_pad, g, d | dv], q_pos [n_pad], k_pos [m_pad], offset
  [1], tables (name -> [h, ...]), lookups (each [b, h, n_pad | m_pad, R]),
  the value lookup's table [R, dv] or None, the mask's arrays, Blocks or None."""
  q: Any
  k: Any
  v: Any
  q_pos: Any
  k_pos: Any
  offset: Any
  tables: dict
  lookups: tuple
  value_table: Any
  mask_arrays: tuple
  blocks: Blocks | None


def _lookup_spec(st: Settings, x, side: str, by_query: bool):
  """A lookup table [b, h, L, R]'s BlockSpec: the program's block of rows
  where its side is the kernel's blocked side, else its (batch, head)'s
  rows whole."""
  if (side == 'query') == by_query:
    size = st.block_q if side == 'query' else st.block_k
    return pl.BlockSpec((None, None, size, x.shape[3]), lambda i, j, t: (i, j, t, 0))
  return pl.BlockSpec((None, None, *x.shape[2:]), lambda i, j, t: (i, j, 0, 0))


def _operands(st: Settings, a: _Args, by_query: bool, d_values=None):
  """The kernels' trailing operands (_unpack's order: the backward's dO . a^V
  rows, tables by name, lookup tables, the value lookup's table, the mask's
  arrays, the block states and ranges) and their BlockSpecs: each program
  reads its head's row of every table, its (batch, head)'s rows of the
  lookup tables (_lookup_spec) and the rest whole."""
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, t, nd=x.ndim: (0,) * nd)
  row = lambda x: pl.BlockSpec((None, *x.shape[1:]),
                               lambda i, j, t, nd=x.ndim: (j,) + (0,) * (nd - 1))
  arrays, specs = [], []
  if d_values is not None:
    arrays.append(d_values)
    specs.append(_lookup_spec(st, d_values, 'query', by_query))
  arrays += [a.tables[name] for name in sorted(a.tables)]
  specs += [row(a.tables[name]) for name in sorted(a.tables)]
  arrays += list(a.lookups)
  specs += [_lookup_spec(st, x, side, by_query) for (side, _), x in zip(st.lookups, a.lookups)]
  rest = [] if a.value_table is None else [a.value_table]
  rest += list(a.mask_arrays)
  if a.blocks is not None:
    rest += [a.blocks.states, a.blocks.by_query if by_query else a.blocks.by_key]
  return arrays + rest, specs + [whole(x) for x in rest]


def _forward(st: Settings, a: _Args):
  """-> (out [b, n_pad, h, dv], lse float32 [b, h, n_pad]) and, under a value
  lookup, each row's weights summed per entry, float32 [b, h, n_pad, R]."""
  b, n_pad, h, d = a.q.shape
  m_pad, g = a.k.shape[1], a.k.shape[2]
  q_spec, kv, qpos, kpos, off = _specs(n_pad, m_pad, h, g, d, st, True)
  extra, extra_specs = _operands(st, a, True)
  dv = a.v.shape[3]
  out_specs = [pl.BlockSpec((None, st.block_q, None, dv), lambda i, j, t: (i, t, j, 0)),
               pl.BlockSpec((None, None, st.block_q), lambda i, j, t: (i, j, t))]
  out_shape = [jax.ShapeDtypeStruct((b, n_pad, h, dv), a.q.dtype),
               jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32)]
  if st.values is not None:
    entries = a.value_table.shape[0]
    out_specs.append(pl.BlockSpec((None, None, st.block_q, entries), lambda i, j, t: (i, j, t, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, h, n_pad, entries), jnp.float32))
  return pl.pallas_call(
      functools.partial(_forward_kernel, st), grid=(b, h, n_pad // st.block_q),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, *extra_specs], out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, compiler_params=st.compiler_params(),
      name='flash_score_forward',
  )(a.q, a.k, a.v, a.q_pos, a.k_pos, a.offset, *extra)


def _dkdv(st: Settings, a: _Args, d_out, lse, delta, d_values):
  """dk and dv per query head, float32 [b, m_pad, h, d] and [b, m_pad, h, dv],
  and the per-key lookup tables' gradients, float32 [b, h, m_pad, R] each."""
  b, n_pad, h, d = a.q.shape
  m_pad, g = a.k.shape[1], a.k.shape[2]
  by_rows = pl.BlockSpec((None, None, n_pad), lambda i, j, t: (i, j, 0))
  q_spec, kv, qpos, kpos, off = _specs(n_pad, m_pad, h, g, d, st, False)
  extra, extra_specs = _operands(st, a, False, d_values)
  looks = [a.lookups[i].shape[3] for i in st.sides('key')]
  return pl.pallas_call(
      functools.partial(_dkdv_kernel, st), grid=(b, h, m_pad // st.block_k),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, q_spec, by_rows, by_rows, *extra_specs],
      out_specs=[pl.BlockSpec((None, st.block_k, None, x.shape[3]), lambda i, j, t: (i, t, j, 0))
                 for x in (a.k, a.v)] + [
          pl.BlockSpec((None, None, st.block_k, r), lambda i, j, t: (i, j, t, 0)) for r in looks],
      out_shape=[jax.ShapeDtypeStruct((b, m_pad, h, x.shape[3]), jnp.float32) for x in (a.k, a.v)]
      + [jax.ShapeDtypeStruct((b, h, m_pad, r), jnp.float32) for r in looks],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_dkdv',
  )(a.q, a.k, a.v, a.q_pos, a.k_pos, a.offset, d_out, lse, delta, *extra)


def _dq(st: Settings, a: _Args, d_out, lse, delta, d_values):
  """dq [b, n_pad, h, d] in q's dtype, the row gradients of the tables
  st.grads, float32 [b, h, num_q_blocks, *row] each, and the per-query
  lookup tables' gradients, float32 [b, h, n_pad, R] each."""
  b, n_pad, h, d = a.q.shape
  m_pad, g = a.k.shape[1], a.k.shape[2]
  nq = n_pad // st.block_q
  rows = pl.BlockSpec((None, None, st.block_q), lambda i, j, t: (i, j, t))
  q_spec, kv, qpos, kpos, off = _specs(n_pad, m_pad, h, g, d, st, True)
  extra, extra_specs = _operands(st, a, True, d_values)
  row_shapes = [a.tables[name].shape[1:] for name in st.grads]
  looks = [a.lookups[i].shape[3] for i in st.sides('query')]
  return pl.pallas_call(
      functools.partial(_dq_kernel, st), grid=(b, h, nq),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, q_spec, rows, rows, *extra_specs],
      out_specs=[pl.BlockSpec((None, st.block_q, None, d), lambda i, j, t: (i, t, j, 0))] + [
          pl.BlockSpec((None, None, None, *shape),
                       lambda i, j, t, nd=len(shape): (i, j, t) + (0,) * nd)
          for shape in row_shapes] + [
          pl.BlockSpec((None, None, st.block_q, r), lambda i, j, t: (i, j, t, 0)) for r in looks],
      out_shape=[jax.ShapeDtypeStruct(a.q.shape, a.q.dtype)] + [
          jax.ShapeDtypeStruct((b, h, nq, *shape), jnp.float32) for shape in row_shapes] + [
          jax.ShapeDtypeStruct((b, h, n_pad, r), jnp.float32) for r in looks],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_dq',
  )(a.q, a.k, a.v, a.q_pos, a.k_pos, a.offset, d_out, lse, delta, *extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: Settings, a: _Args):
  """-> (out [b, n_pad, h, dv], lse float32 [b, h, n_pad], -inf where a query
  sees no key)."""
  out, lse, *_ = _forward(st, a)
  return out, _public_lse(lse)


def _public_lse(lse):
  """The kernel's lse (-NEG_INF, far above any score, where a row sees no
  key: its p = exp(s - lse) is 0 in the backward) with -inf there."""
  return jnp.where(lse == -NEG_INF, -jnp.inf, lse)


def _attention_fwd(st: Settings, primals: _Args):
  """With symbolic zeros: the tables a gradient asks for (perturbed, of a
  floating dtype) go to the backward as the residuals' structure."""
  a = jax.tree.map(lambda p: p.value, primals)
  wanted = {name: None for name, p in primals.tables.items()
            if p.perturbed and jnp.issubdtype(p.value.dtype, jnp.inexact)}
  out, lse, *sums = _forward(st, a)
  return (out, _public_lse(lse)), (a, out, lse, sums, wanted)


def _backward(st: Settings, res, cotangents):
  a, out, lse, sums, wanted = res
  d_out, d_lse = cotangents
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jnp.zeros(out.shape, out.dtype)
  st = dataclasses.replace(st, grads=tuple(sorted(wanted)))
  b, m_pad, g = a.k.shape[0], a.k.shape[1], a.k.shape[2]
  h = a.q.shape[2]
  delta = jnp.einsum('bnhd,bnhd->bhn', out.astype(jnp.float32), d_out.astype(jnp.float32))
  if not isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
    # d lse_i / d s_ij = p_ij, so ds_ij = p_ij (dp_ij - delta_i + dlse_i): dlse joins delta.
    delta = delta - d_lse.astype(jnp.float32)
  d_values = d_table_v = None
  if st.values is not None:  # dp_ij gains dO_i . a^V_idx; the table gets sum_i P_i^T dO_i
    table = a.value_table.astype(jnp.float32)
    d_values = jnp.einsum('bnhd,rd->bhnr', d_out.astype(jnp.float32), table)
    d_table_v = jnp.einsum('bhnr,bnhd->rd', sums[0], d_out.astype(jnp.float32))
    d_table_v = d_table_v.astype(a.value_table.dtype)
  dk, dv, *dkeys = _dkdv(st, a, d_out, lse, delta, d_values)
  dq, *drows = _dq(st, a, d_out, lse, delta, d_values)
  group = lambda x, like: x.reshape(b, m_pad, g, h // g, x.shape[3]).sum(axis=3).astype(like.dtype)
  d_tables = {name: None for name in a.tables}
  for name, drow in zip(st.grads, drows):
    d_tables[name] = drow.sum(axis=(0, 2)).astype(a.tables[name].dtype)
  d_lookups = [None] * len(st.lookups)
  for i, d in [*zip(st.sides('query'), drows[len(st.grads):]), *zip(st.sides('key'), dkeys)]:
    d_lookups[i] = d.astype(a.lookups[i].dtype)
  none = lambda tree: jax.tree.map(lambda _: None, tree)
  return (_Args(dq, group(dk, a.k), group(dv, a.v), None, None, None, d_tables,
                tuple(d_lookups), d_table_v, none(a.mask_arrays), none(a.blocks)),)


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


def flash_attention(q, k, v, *, score=None, tables: dict | None = None, lookups=(),
                    values=None, mask: masks.Mask | None = None, q_positions=None,
                    k_positions=None, causal: bool = False, q_offset=0,
                    block_q: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
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
    lookups: (side, index, rows) each: rows float [b, h, n, R] ('query': a
      row per query) or [b, h, m, R] ('key'), index(q_pos [bq, 1], k_pos
      [1, bk]) -> int [bq, bk] in [0, R); the scores before `score` gain
      rows[b, h, i, index_ij] (or rows[b, h, j, index_ij]). Differentiable.
    values: None, or (index, table [R, dv]): the output gains
      sum_j p_ij table[index_ij] (index as a lookup's). Differentiable.
    mask: a masks.Mask, or None; with `causal` both apply. Query i is at
      index q_offset + i; the mask's data are its arrays (Pallas refuses a
      kernel that closes over an array), covering the indices it reads
      (queries q_offset .. q_offset + n - 1, keys 0 .. m - 1).
    q_positions: int [n] (default q_offset + 0..n-1); k_positions: int [m]
      (default 0..m-1): what `score` sees as positions.
    causal: query i (index q_offset + i) sees the keys j <= q_offset + i.
    block_q, block_k: the tiles (None: BLOCK); the lengths are padded to them.
    num_warps, num_stages: Triton's (None: WARPS, STAGES); `Tiles` holds all four.
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
  block_q, block_k = (min(block or BLOCK, _round_up(length)) for block, length in
                      ((block_q, n), (block_k, m)))
  template = None if mask is None else mask.with_arrays(
      jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in mask.arrays)
  lookups, values = _checked_lookups(lookups, values, b, h, n, m, v.shape[3])
  st = Settings(block_q, block_k, causal, n, m, float(d) ** -0.5, interpret, score,
                tuple((name, originals[name]) for name in sorted(tables)), template,
                lookups=tuple((side, index) for side, index, _ in lookups),
                values=None if values is None else values[0], num_warps=num_warps or WARPS,
                num_stages=num_stages or STAGES)
  offset = jnp.asarray(q_offset, jnp.int32).reshape(1)
  blocks = None if mask is None else block_states(st, mask, b, h, offset[0])
  q_positions = (offset[0] + jnp.arange(n) if q_positions is None else q_positions)
  k_positions = jnp.arange(m) if k_positions is None else k_positions
  entries = lambda x, axis: _pad(x, axis, _round_up(x.shape[axis]))  # noqa: E731
  rows = tuple(entries(_pad(x, 2, block_q if side == 'query' else block_k), 3)
               for side, _, x in lookups)
  args = _Args(_pad(q, 1, block_q), _pad(k, 1, block_k), _pad(v, 1, block_k),
               _pad(jnp.asarray(q_positions, jnp.int32), 0, block_q),
               _pad(jnp.asarray(k_positions, jnp.int32), 0, block_k), offset, tables, rows,
               None if values is None else entries(values[1], 0),
               tuple(jnp.asarray(a) for a in (mask.arrays if mask else ())), blocks)
  out, lse = _attention(st, args)
  return (out[:, :n], lse[:, :, :n]) if return_lse else out[:, :n]


def _checked_lookups(lookups, values, b: int, h: int, n: int, m: int, dv: int):
  """flash_attention's lookups (side, index, rows) and values (index, table)
  as arrays, their shapes checked."""
  lookups = tuple((side, index, jnp.asarray(rows)) for side, index, rows in lookups)
  for side, _, rows in lookups:
    length = {'query': n, 'key': m}.get(side)
    if length is None or rows.ndim != 4 or rows.shape[:3] != (b, h, length):
      raise ValueError(f"a lookup of side {side!r} has rows of shape {rows.shape}: 'query' "
                       f"takes [b, h, n, R] = [{b}, {h}, {n}, R], 'key' [{b}, {h}, {m}, R]")
  if values is not None:
    values = (values[0], jnp.asarray(values[1]))
    if values[1].ndim != 2 or values[1].shape[1] != dv:
      raise ValueError(f'the value lookup\'s table has shape {values[1].shape}; it takes '
                       f'[R, {dv}]')
  return lookups, values


def _round_up(x: int) -> int:
  """The power of two at or above x, at least 16 (Triton's smallest dot tile)."""
  return max(16, 1 << (x - 1).bit_length())
