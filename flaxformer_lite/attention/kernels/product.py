"""What every kernel computes for one block: the scores of its queries and
keys (`scores`: a scheme's transforms, the q.k product, the scheme's score)
and the p.v product. The blockwise kernel calls them block by block, the
dense reference (reference.dense_attention) once on the whole [n, m].

The kernel owns the q.k product (`dot_logits`) and how a bias shared by the
batch joins the scores (`Block.add`): a scheme changes what they give
through its scheme.Terms (its `transform_q`/`transform_k` before, its
`score` after), never computes them.

The products of the blocks take dO and ds in the inputs' dtype in the
backward, as FlashAttention-2 does: bf16 matmuls, float32 accumulation.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention.scheme import Tables


class Block(NamedTuple):
  """One block as a scheme's `block_score` sees it."""
  q: Any  # [b, bq, h, d]: scaled and transformed
  k: Any  # [b, bk, h, d]: transformed, g key heads copied to the h query heads
  q_pos: Any  # int [bq]: each query's position
  k_pos: Any  # int [bk]: each key's position
  tables: Any  # what the scheme's `prepare` made of its parameters, once per call

  def add(self, s, bias):
    """s [b, h, bq, bk] + bias [h | 1, bq | 1, bk | 1], a bias shared by the
    batch, added as the kernel adds it (add_head_bias)."""
    return add_head_bias(s, bias)


def repeat_heads(x, h: int):
  """[b, L, g, d] -> [b, L, h, d]: group i's head for query heads i*h/g ..
  (i+1)*h/g - 1 (the identity when g = h)."""
  g = x.shape[2]
  return x if g == h else jnp.repeat(x, h // g, axis=2)


def heads(h: int):
  """The head index as a scheme's elementwise `score` sees it on a whole
  [b, h, bq, bk] block: int32 [h, 1, 1]."""
  return np.arange(h, dtype=np.int32)[:, None, None]


def rows(b: int):
  """The batch row as a scheme's elementwise `score` sees it on a whole
  [b, h, bq, bk] block: int32 [b, 1, 1, 1]."""
  return np.arange(b, dtype=np.int32)[:, None, None, None]


class HeadRows:
  """A per-head table [h, ...] as an elementwise `score` reads it on a whole
  [b, h, bq, bk] block: table[heads] -> [b, h, 1, 1, ...] and table[heads,
  index] (index int [bq, bk]) -> [h, bq, bk] (a one-hot product), so that
  neither the value nor its gradient holds a gather or a scatter (XLA:GPU's
  scatter-add sums in a varying order). A row per head comes as b copies,
  not a broadcast over the batch: its gradient then sums the batch by adds of
  slices, not by XLA:CPU's slow reduction over the leading axis (as Block.add)."""

  def __init__(self, table, batch: int):
    self.table, self.batch = jnp.asarray(table), batch

  @property
  def shape(self):
    return self.table.shape

  def __getitem__(self, key):
    head, index = (key, None) if not isinstance(key, tuple) else (key + (None,))[:2]
    x = self.table
    whole_block_head = (isinstance(head, np.ndarray) and head.shape == (x.shape[0], 1, 1)
                        and not (isinstance(key, tuple) and len(key) > 2))
    if not whole_block_head:  # a batch row, a position, a scalar head: plain indexing
      return x[key]
    if index is None:
      rows = x.reshape((1, x.shape[0], 1, 1) + x.shape[1:])
      return jnp.concatenate([rows] * self.batch, axis=0) if self.batch > 1 else rows
    one_hot = jax.nn.one_hot(index, x.shape[1], dtype=jnp.float32)  # [bq, bk, rows]
    return jnp.einsum('hr,qkr->hqk', x.astype(jnp.float32), one_hot)


def scores(terms, q, k, tables, q_pos, k_pos, transformed_keys=False, reference=False):
  """The scores of queries q [b, bq, h, d] (scaled) at q_pos [bq] against keys
  k [b, bk, g, d] at k_pos [bk] -> float32 [b, h, bq, bk]: `terms`'
  transforms, measured from the block's first key (scheme.py), the product
  (the kernel's q.k, or terms.product), then terms.block_score, or
  terms.score where the scheme has no block form or `reference` asks for the
  elementwise one (the dense reference: the form every kernel derives from).
  transformed_keys: k went through terms.transform_k already (once for the
  whole call)."""
  origin = k_pos[0]
  if terms.transform_q is not None:
    q = terms.transform_q(q, tables, q_pos, origin)
  if terms.transform_k is not None and not transformed_keys:  # on the g heads, before the copies
    k = terms.transform_k(k, tables, k_pos, origin)
  k = repeat_heads(k, q.shape[2])
  s = dot_logits(q, k) if terms.product is None else terms.product(q, k, tables)
  if terms.block_score is not None and not (reference and terms.score is not None):
    return terms.block_score(s, Block(q, k, q_pos, k_pos, tables))
  if terms.score is None:
    return s
  h = q.shape[2]
  if terms.additive:  # the bias once for the batch, added as Block.add adds
    bias = terms.score(jnp.zeros((1, h, 1, 1), jnp.float32), rows(1), heads(h), q_pos[:, None],
                       k_pos[None, :], head_tables(tables, 1))
    return add_head_bias(s, jnp.broadcast_to(bias, (1,) + s.shape[1:])[0])
  return terms.score(s, rows(s.shape[0]), heads(h), q_pos[:, None], k_pos[None, :],
                     head_tables(tables, s.shape[0]))


def head_tables(tables, batch: int) -> Tables:
  """A call's tables as an elementwise score reads them on a whole block of
  `batch` rows: each a HeadRows, in a Tables (a missing name says which)."""
  return Tables({name: HeadRows(table, batch) for name, table in (tables or {}).items()})


@jax.custom_jvp
def add_head_bias(s, bias):
  """s [b, h, bq, bk] + bias [h | 1, bq | 1, bk | 1], a bias shared by the
  batch. The tangent adds the bias's tangent as b copies, not a broadcast,
  so that its transpose sums the batch by adds of slices, not by XLA:CPU's
  slow reduction over the leading axis; the value stays a broadcast, which
  XLA fuses into the add."""
  return s + bias.astype(s.dtype)


@add_head_bias.defjvp
def _add_head_bias_jvp(primals, tangents):
  s, bias = primals
  ds, d_bias = tangents
  copies = jnp.concatenate([d_bias.astype(s.dtype)[None]] * s.shape[0], axis=0)
  return add_head_bias(s, bias), ds + copies


# _one_query: a single query row against a block of keys is a matrix-vector
# product, bound by reading the block. As a product and a sum, XLA reads the
# block where it lies in the cache; as a dot, XLA:CPU first copies it out of
# the cache and transposes it to [b, h, bk, d] (benchmarks/decode_step.py).


@jax.custom_vjp
def dot_logits_(q, k):
  """q . k -> float32 [b, h, bq, bk], accumulated in float32; its gradient
  takes ds in the inputs' dtype, as FlashAttention-2's backward does: in
  bfloat16 the backward's matmuls run at the bfloat16 rate and accumulate
  in float32 (preferred_element_type), and the gradients are as accurate
  as the dense bfloat16 path's (tests/attention/kernels/test_blockwise.py)."""
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
  which a custom_vjp refuses: the dense path registry.py derives runs the
  same block terms and is linearised by tests and users."""
  return jnp.dtype(x.dtype).itemsize < 4


def dot_logits(q, k):
  """q [b, bq, h, d] . k [b, bk, h, d] -> float32 [b, h, bq, bk]."""
  return dot_logits_(q, k) if _bf16_backward(q) else dot_logits_.fun(q, k)


def dot_values(p, v, tables, q_pos, k_pos):
  """sum_j p_ij v_j: p [b, h, bq, bk] -> float32 [b, h, bq, dv] (the values
  term of a scheme that has none of its own)."""
  del tables, q_pos, k_pos
  return dot_values_(p, v) if _bf16_backward(v) else dot_values_.fun(p, v)
