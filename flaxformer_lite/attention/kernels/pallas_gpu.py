"""A fused attention kernel in Pallas that carries a scheme's score function:
FlashAttention-2's forward and backward (Dao 2023) with FlexAttention's
score_mod (PyTorch), for GPUs through Pallas's Triton lowering and anywhere
in Pallas's interpret mode (the tests run it on CPU).

  out = flash_attention(q, k, v, score=alibi_score, tables=(slopes,), causal=True)

q [b, n, h, d], k and v [b, m, g, d] with g dividing h (grouped-query: query
head i reads key/value head i // (h / g), by the BlockSpec's index map, no
copies). `score(s, q_pos, k_pos, head, tables)` changes a block of scaled
scores s [bq, bk] float32 elementwise, given the block's query positions
[bq, 1] and key positions [1, bk] (int32 arrays: decoding offsets, packing
and randomized positions reach it as data), the head's index and its rows
of the per-call tables (per-head arrays [h, ...]: ALiBi's slopes [h], T5's
bucket table transposed [h, buckets]). Each program gets its head's rows as
its blocks, and `score` reads them as `row[...]` or `row[indices]` (a
gather load in Triton; the same code indexes arrays in the other kernels):
indexing a loaded value by a traced head or bucket does not lower. The
mask is causal by index (query i at q_offset + i sees keys j <= q_offset + i)
and hides the keys past m; key blocks past a causal query block's diagonal
are not visited.

The forward saves each row's log-sum-exp; the backward recomputes the
probabilities block by block in two kernels, one per key block (dk, dv) and
one per query block (dq), with ds = p * (dp - delta) times the score's
derivative in s (one forward-mode product through `score`, so any
elementwise score works). Gradients do not flow into `tables`: a scheme
with learned tables trains on the blockwise kernel (select.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

NEG_INF = -1e30  # finite: a fully hidden block must not make exp(NaN)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The kernels' static settings: block sizes, causal, the real key count
  m (keys past it are padding), the score scale, and how the call runs."""
  block_q: int
  block_k: int
  causal: bool
  m: int
  scale: float
  interpret: bool
  score: Callable[..., Any] | None

  def compiler_params(self):
    # Triton's parameters choose the Triton lowering (the default GPU lowering
    # is Mosaic GPU's, which takes no elementwise score this way).
    return pl_triton.CompilerParams(num_warps=4, num_stages=2)


def _pad(x, axis: int, multiple: int):
  size = -(-x.shape[axis] // multiple) * multiple
  if size == x.shape[axis]:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _scores(st: Settings, q, k, q_pos, k_pos, q_idx, k_idx, head, tables):
  """Scaled, scored and masked scores of one block [bq, bk] float32, and the
  score's derivative in s (ones without a score)."""
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32) * st.scale
  if st.score is None:
    scored, slope = s, jnp.ones_like(s)
  else:
    scored, slope = jax.jvp(lambda x: st.score(x, q_pos, k_pos, head, tables),
                            (s,), (jnp.ones_like(s),))
  visible = k_idx < st.m
  if st.causal:
    visible = visible & (k_idx <= q_idx)
  return jnp.where(visible, scored, NEG_INF), slope


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


def _forward_kernel(st: Settings, num_tables: int, q_ref, k_ref, v_ref, qpos_ref, kpos_ref,
                    offset_ref, *refs):
  """One query block of one (batch, head): an online softmax over its key blocks."""
  tables = refs[:num_tables]
  o_ref, lse_ref = refs[num_tables:]
  bq, bk = st.block_q, st.block_k
  head, qb = pl.program_id(1), pl.program_id(2)
  q = q_ref[...]
  q_pos = qpos_ref[...][:, None]
  q_idx = _query_indices(st, offset_ref, qb)
  num_k = k_ref.shape[0] // bk
  hi = _key_blocks_seen(st, offset_ref, qb, num_k)

  def body(kb, carry):
    m_i, l_i, acc = carry
    keys = pl.ds(kb * bk, bk)
    k_idx = _key_indices(st, kb)
    s, _ = _scores(st, q, k_ref[keys, :], q_pos, kpos_ref[keys][None, :], q_idx, k_idx, head,
                   tables)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    rescale = jnp.exp(m_i - m_new)
    acc = acc * rescale[:, None] + jnp.dot(p.astype(v_ref.dtype), v_ref[keys, :],
                                           preferred_element_type=jnp.float32)
    return m_new, l_i * rescale + p.sum(axis=1), acc

  init = (jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, v_ref.shape[1]), jnp.float32))
  m_i, l_i, acc = jax.lax.fori_loop(0, hi, body, init)
  o_ref[...] = (acc / l_i[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m_i + jnp.log(l_i)


def _specs(n_pad, m_pad, h, g, d, st: Settings, tables, by_query: bool):
  """BlockSpecs of (q, k and v, q_pos, k_pos, offset, *tables) for a grid
  (b, h, blocks): a block of the blocked side, the other side whole."""
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
  # Each program reads its head's row of every table.
  table_specs = [pl.BlockSpec((None, *x.shape[1:]), lambda i, j, t, nd=x.ndim: (j,) + (0,) * (nd - 1))
                 for x in tables]
  offset = pl.BlockSpec((1,), lambda i, j, t: (0,))
  return q, kv, qpos, kpos, offset, table_specs


def _forward(st: Settings, q, k, v, q_pos, k_pos, offset, tables):
  """Padded inputs -> (out [b, n_pad, h, dv], lse float32 [b, h, n_pad])."""
  b, n_pad, h, d = q.shape
  m_pad, g = k.shape[1], k.shape[2]
  q_spec, kv, qpos, kpos, off, table_specs = _specs(n_pad, m_pad, h, g, d, st, tables, True)
  kernel = functools.partial(_forward_kernel, st, len(tables))
  return pl.pallas_call(
      kernel, grid=(b, h, n_pad // st.block_q),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, *table_specs],
      out_specs=[pl.BlockSpec((None, st.block_q, None, v.shape[3]),
                              lambda i, j, t: (i, t, j, 0)),
                 pl.BlockSpec((None, None, st.block_q), lambda i, j, t: (i, j, t))],
      out_shape=[jax.ShapeDtypeStruct((b, n_pad, h, v.shape[3]), q.dtype),
                 jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32)],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_forward',
  )(q, k, v, q_pos, k_pos, offset, *tables)


def _dkdv_kernel(st: Settings, num_tables: int, q_ref, k_ref, v_ref, qpos_ref, kpos_ref,
                 offset_ref, do_ref, lse_ref, delta_ref, *refs):
  """One key block of one (batch, query head): its dk and dv over the query
  blocks that see it."""
  tables = refs[:num_tables]
  dk_ref, dv_ref = refs[num_tables:]
  bq, bk = st.block_q, st.block_k
  head, kb = pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  k_pos = kpos_ref[...][None, :]
  k_idx = _key_indices(st, kb)
  num_q = q_ref.shape[0] // bq
  lo = jnp.clip((kb * bk - offset_ref[0]) // bq, 0, num_q) if st.causal else 0

  def body(qb, carry):
    dk, dv = carry
    rows = pl.ds(qb * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    q_idx = _query_indices(st, offset_ref, qb)
    s, slope = _scores(st, q, k, qpos_ref[rows][:, None], k_pos, q_idx, k_idx, head, tables)
    p = jnp.exp(s - lse_ref[rows][:, None])
    dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta_ref[rows][:, None]) * slope * st.scale
    dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return dk, dv

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = jax.lax.fori_loop(lo, num_q, body, init)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(st: Settings, num_tables: int, q_ref, k_ref, v_ref, qpos_ref, kpos_ref,
               offset_ref, do_ref, lse_ref, delta_ref, *refs):
  """One query block of one (batch, head): its dq over the key blocks it sees."""
  tables = refs[:num_tables]
  (dq_ref,) = refs[num_tables:]
  bq, bk = st.block_q, st.block_k
  head, qb = pl.program_id(1), pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  q_pos = qpos_ref[...][:, None]
  q_idx = _query_indices(st, offset_ref, qb)
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  num_k = k_ref.shape[0] // bk
  hi = _key_blocks_seen(st, offset_ref, qb, num_k)

  def body(kb, dq):
    keys = pl.ds(kb * bk, bk)
    k = k_ref[keys, :]
    k_idx = _key_indices(st, kb)
    s, slope = _scores(st, q, k, q_pos, kpos_ref[keys][None, :], q_idx, k_idx, head, tables)
    p = jnp.exp(s - lse)
    dp = jax.lax.dot_general(do, v_ref[keys, :], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    ds = p * (dp - delta) * slope * st.scale
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq = jax.lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _backward(st: Settings, res, d_out):
  q, k, v, q_pos, k_pos, offset, tables, out, lse = res
  b, n_pad, h, d = q.shape
  m_pad, g = k.shape[1], k.shape[2]
  delta = jnp.einsum('bnhd,bnhd->bhn', out.astype(jnp.float32), d_out.astype(jnp.float32))
  by_rows = lambda length: pl.BlockSpec((None, None, length), lambda i, j, t: (i, j, 0))
  q_spec, kv, qpos, kpos, off, table_specs = _specs(n_pad, m_pad, h, g, d, st, tables, False)
  # dk, dv per query head, summed over each key/value head's group after.
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, st, len(tables)), grid=(b, h, m_pad // st.block_k),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, q_spec,
                by_rows(n_pad), by_rows(n_pad), *table_specs],
      out_specs=[pl.BlockSpec((None, st.block_k, None, x.shape[3]), lambda i, j, t: (i, t, j, 0))
                 for x in (k, v)],
      out_shape=[jax.ShapeDtypeStruct((b, m_pad, h, x.shape[3]), jnp.float32) for x in (k, v)],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_dkdv',
  )(q, k, v, q_pos, k_pos, offset, d_out, lse, delta, *tables)
  q_spec, kv, qpos, kpos, off, table_specs = _specs(n_pad, m_pad, h, g, d, st, tables, True)
  rows = pl.BlockSpec((None, None, st.block_q), lambda i, j, t: (i, j, t))
  (dq,) = pl.pallas_call(
      functools.partial(_dq_kernel, st, len(tables)), grid=(b, h, n_pad // st.block_q),
      in_specs=[q_spec, kv, kv, qpos, kpos, off, q_spec, rows, rows,
                *table_specs],
      out_specs=[pl.BlockSpec((None, st.block_q, None, d), lambda i, j, t: (i, t, j, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
      interpret=st.interpret, compiler_params=st.compiler_params(), name='flash_score_dq',
  )(q, k, v, q_pos, k_pos, offset, d_out, lse, delta, *tables)
  group = lambda x, like: x.reshape(b, m_pad, g, h // g, x.shape[3]).sum(axis=3).astype(like.dtype)
  zeros = lambda x: jnp.zeros(x.shape, jax.dtypes.float0) if jnp.issubdtype(
      x.dtype, jnp.integer) else jnp.zeros_like(x)
  return (dq, group(dk, k), group(dv, v), zeros(q_pos), zeros(k_pos), zeros(offset),
          tuple(jnp.zeros_like(t) for t in tables))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: Settings, q, k, v, q_pos, k_pos, offset, tables):
  return _forward(st, q, k, v, q_pos, k_pos, offset, tables)[0]


def _attention_fwd(st: Settings, q, k, v, q_pos, k_pos, offset, tables):
  out, lse = _forward(st, q, k, v, q_pos, k_pos, offset, tables)
  return out, (q, k, v, q_pos, k_pos, offset, tables, out, lse)


_attention.defvjp(_attention_fwd, _backward)


def flash_attention(q, k, v, *, score=None, tables=(), q_positions=None, k_positions=None,
                    causal: bool = False, q_offset=0, block_q: int = 64, block_k: int = 64,
                    interpret: bool = False):
  """Attention with a score function in one fused kernel (module docstring).

  Args:
    q: [b, n, h, d]; k: [b, m, g, d]; v: [b, m, g, dv]; g divides h.
    score: (s [bq, bk], q_pos [bq, 1], k_pos [1, bk], head, head's tables) -> s,
      elementwise; None: plain dot-product attention.
    tables: a tuple of per-head arrays [h, ...]; `score` gets its head's rows
      ([1] for a [h] table) to read by `[...]` or `[indices]`; no gradient
      flows into them.
    q_positions: int [n] (default q_offset + 0..n-1); k_positions: int [m]
      (default 0..m-1): what `score` sees as positions.
    causal: query i (index q_offset + i) sees the keys j <= q_offset + i.
    block_q, block_k: the tiles; the lengths are padded to them.
    interpret: run in Pallas's interpreter (any backend).
  Returns:
    [b, n, h, dv] in q's dtype.
  """
  b, n, h, d = q.shape
  m, g = k.shape[1], k.shape[2]
  if h % g:
    raise ValueError(f'{g} key/value heads do not divide {h} query heads')
  tables = tuple(jnp.asarray(t) for t in tables)
  for i, table in enumerate(tables):
    if table.ndim < 1 or table.shape[0] != h:
      raise ValueError(f'tables[{i}] has shape {table.shape}: a table is per head, '
                       f'[{h}, ...] for {h} heads')
  tables = tuple(t[:, None] if t.ndim == 1 else t for t in tables)  # a head's row: [1] at least
  block_q, block_k = min(block_q, _round_up(n)), min(block_k, _round_up(m))
  st = Settings(block_q, block_k, causal, m, float(d) ** -0.5, interpret, score)
  offset = jnp.asarray(q_offset, jnp.int32).reshape(1)
  q_positions = (offset[0] + jnp.arange(n) if q_positions is None else q_positions)
  k_positions = jnp.arange(m) if k_positions is None else k_positions
  out = _attention(st, _pad(q, 1, block_q), _pad(k, 1, block_k), _pad(v, 1, block_k),
                   _pad(jnp.asarray(q_positions, jnp.int32), 0, block_q),
                   _pad(jnp.asarray(k_positions, jnp.int32), 0, block_k), offset,
                   tuple(jax.lax.stop_gradient(t) for t in tables))
  return out[:, :n]


def _round_up(x: int) -> int:
  """The power of two at or above x, at least 16 (Triton's smallest dot tile)."""
  return max(16, 1 << (x - 1).bit_length())
