"""Attention masks described, not built: each kernel builds what it needs.

A `MaskSpec` says which keys a query may see. Query i sits at absolute
position p = q_offset + i, key j at position j:
  causal:      j <= p;
  window w:    |j - p| < w (window_causal: p - w < j <= p), local attention's band;
  key_valid:   bool [b, m], False for padding keys;
  query_valid: bool [b, n], False for padding queries (they see nothing);
  segments:    query_segments int [b, n] and key_segments int [b, m]: packed
               examples, a query sees the keys of its own segment only;
  dense:       an explicit boolean mask broadcastable to [b, h, n, m].
A query may attend to a key where every given part allows it.

The dense path asks for the whole [b, 1, n, m] array (`to_dense`); the chunked
path asks for one block at a time (`block`) and for the range of key blocks
a query block can see at all (`key_block_range`), so it never holds the
[b, 1, n, m] boolean array that `nn.make_attention_mask` would build.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


def band(q_pos, k_pos, window: int, causal: bool):
  """Whether the query at q_pos sees the key at k_pos inside a window
  (broadcasting int arrays): |j - p| < window, or p - window < j <= p."""
  rel = k_pos - q_pos
  if causal:
    return (rel > -window) & (rel <= 0)
  return jnp.abs(rel) < window


@flax.struct.dataclass
class MaskSpec:
  """A described attention mask (module docstring). Arrays are pytree leaves;
  `causal`, `window` and `window_causal` are static."""
  key_valid: Any = None  # bool [b, m]
  query_valid: Any = None  # bool [b, n]
  query_segments: Any = None  # int [b, n]; with key_segments
  key_segments: Any = None  # int [b, m]
  dense: Any = None  # bool, broadcastable to [b, h, n, m]
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  window: int | None = flax.struct.field(pytree_node=False, default=None)
  window_causal: bool = flax.struct.field(pytree_node=False, default=False)

  def has_arrays(self) -> bool:
    """Whether a part of the mask is data (padding, segments, an explicit
    mask), not only the causal and window rules."""
    return any(x is not None for x in (self.key_valid, self.query_valid, self.dense,
                                       self.query_segments))

  def may_hide_rows(self, n: int, m: int, q_offset=0) -> bool:
    """Whether some of n queries (query i at q_offset + i) may see none of m
    keys. Without padding or an explicit mask none can: causally every query
    sees key 0, and inside a window a query at p < m sees key p, which a
    python-int q_offset with q_offset + n <= m guarantees."""
    if self.has_arrays():
      return True
    if self.window is None:
      return False
    return not (isinstance(q_offset, int) and q_offset + n <= m)

  def structural(self, q_pos, k_pos):
    """Causal and window parts for positions q_pos [.., 1] and k_pos [1, ..]
    (broadcasting int arrays) -> bool, or None if neither is set."""
    ok = None
    if self.causal:
      ok = k_pos <= q_pos
    if self.window is not None:
      inside = band(q_pos, k_pos, self.window, self.window_causal)
      ok = inside if ok is None else ok & inside
    return ok

  def to_dense(self, n: int, m: int, q_offset=0):
    """The boolean mask [b | 1, h | 1, n, m], or None when nothing is masked."""
    parts = []
    q_pos = q_offset + jnp.arange(n)[:, None]
    structural = self.structural(q_pos, jnp.arange(m)[None, :])
    if structural is not None:
      parts.append(structural[None, None])
    if self.key_valid is not None:
      parts.append(self.key_valid.astype(bool)[:, None, None, :])
    if self.query_valid is not None:
      parts.append(self.query_valid.astype(bool)[:, None, :, None])
    if self.query_segments is not None:
      parts.append(self.query_segments[:, None, :, None] == self.key_segments[:, None, None, :])
    if self.dense is not None:
      parts.append(jnp.asarray(self.dense).astype(bool))
    if not parts:
      return None
    out = parts[0]
    for part in parts[1:]:
      out = jnp.logical_and(out, part)
    return jnp.broadcast_to(out, jnp.broadcast_shapes(out.shape, (1, 1, n, m)))

  def block(self, q_start, k_start, bq: int, bk: int, q_offset=0):
    """The mask of queries q_start .. q_start+bq-1 and keys k_start ..
    k_start+bk-1 (indices, may be traced; the arrays must already be padded
    to cover them) -> bool broadcastable to [b, h, bq, bk], or None."""
    q_pos = q_offset + q_start + jnp.arange(bq)[:, None]
    k_pos = k_start + jnp.arange(bk)[None, :]
    ok = self.structural(q_pos, k_pos)
    ok = None if ok is None else ok[None, None]
    if self.key_valid is not None:
      keys = jax.lax.dynamic_slice_in_dim(self.key_valid.astype(bool), k_start, bk, axis=1)
      ok = _and(ok, keys[:, None, None, :])
    if self.query_valid is not None:
      queries = jax.lax.dynamic_slice_in_dim(self.query_valid.astype(bool), q_start, bq, 1)
      ok = _and(ok, queries[:, None, :, None])
    if self.query_segments is not None:
      q_seg = jax.lax.dynamic_slice_in_dim(self.query_segments, q_start, bq, axis=1)
      k_seg = jax.lax.dynamic_slice_in_dim(self.key_segments, k_start, bk, axis=1)
      ok = _and(ok, q_seg[:, None, :, None] == k_seg[:, None, None, :])
    if self.dense is not None:
      dense = _dense4(self.dense)
      if dense.shape[2] > 1:
        dense = jax.lax.dynamic_slice_in_dim(dense, q_start, bq, axis=2)
      if dense.shape[3] > 1:
        dense = jax.lax.dynamic_slice_in_dim(dense, k_start, bk, axis=3)
      ok = _and(ok, dense)
    return ok

  def padded(self, n_pad: int, m_pad: int) -> MaskSpec:
    """The same mask for n_pad >= n queries and m_pad >= m keys: the arrays
    padded with False (nothing sees or is seen there), so `block` can slice
    whole blocks."""
    dense = self.dense
    if dense is not None:
      dense = _dense4(dense)
      if dense.shape[2] > 1:
        dense = pad_to(dense, 2, n_pad)
      if dense.shape[3] > 1:
        dense = pad_to(dense, 3, m_pad)
    return self.replace(
        key_valid=None if self.key_valid is None else pad_to(
            self.key_valid.astype(bool), 1, m_pad),
        query_valid=None if self.query_valid is None else pad_to(
            self.query_valid.astype(bool), 1, n_pad),
        query_segments=None if self.query_segments is None else pad_to(
            self.query_segments, 1, n_pad),
        key_segments=None if self.key_segments is None else pad_to(self.key_segments, 1, m_pad),
        dense=dense)

  def to_mask(self) -> Mask:
    """The same rules as a Mask (a function of indices; query i at q_offset + i)."""
    parts = []
    if self.causal:
      parts.append(causal())
    if self.window is not None:
      parts.append(sliding_window(self.window, self.window_causal))
    if self.key_valid is not None:
      parts.append(key_padding(self.key_valid))
    if self.query_valid is not None:
      parts.append(query_padding(self.query_valid))
    if self.query_segments is not None:
      parts.append(segments(self.query_segments, self.key_segments))
    if self.dense is not None:
      parts.append(Mask(lambda b, h, q, k, dense: dense[b % dense.shape[0], h % dense.shape[1],
                                                        q % dense.shape[2], k % dense.shape[3]],
                        'dense', (_dense4(self.dense),)))
    if not parts:
      return Mask(lambda b, h, q, k: jnp.ones((), bool), 'everything')
    mask = parts[0]
    for part in parts[1:]:
      mask = mask & part
    return mask

  def key_block_range(self, q_first, q_last, bk: int, num_blocks: int):
    """Key blocks [lo, hi) that queries at absolute positions q_first..q_last
    may see under the causal and window parts (int32 scalars, may be traced)."""
    lo, hi = jnp.int32(0), jnp.int32(num_blocks)
    if self.causal or (self.window is not None and self.window_causal):
      hi = jnp.minimum(hi, q_last // bk + 1)
    if self.window is not None:
      lo = jnp.maximum(lo, (q_first - self.window + 1) // bk)
      if not self.window_causal:
        hi = jnp.minimum(hi, (q_last + self.window - 1) // bk + 1)
    return lo, jnp.maximum(lo, hi)

  def query_block_range(self, k_first, k_last, bq: int, num_blocks: int, q_offset=0):
    """Query blocks [lo, hi) whose queries (query i at q_offset + i) may see a
    key at positions k_first..k_last under the causal and window parts."""
    lo, hi = jnp.int32(0), jnp.int32(num_blocks)
    if self.causal or (self.window is not None and self.window_causal):
      lo = jnp.maximum(lo, (k_first - q_offset) // bq)
    if self.window is not None:
      hi = jnp.minimum(hi, (k_last + self.window - 1 - q_offset) // bq + 1)
      if not self.window_causal:
        lo = jnp.maximum(lo, (k_first - self.window + 1 - q_offset) // bq)
    return jnp.maximum(lo, 0), jnp.maximum(jnp.maximum(lo, 0), hi)


def _dense4(dense):
  """An explicit mask as bool with 4 axes ([b|1, h|1, n|1, m|1])."""
  dense = jnp.asarray(dense).astype(bool)
  return dense.reshape((1,) * (4 - dense.ndim) + dense.shape)


def pad_to(x, axis: int, size: int):
  """x padded with zeros (False for a mask) along `axis` up to `size`."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _and(a, b):
  return b if a is None else jnp.logical_and(a, b)


def as_dense(mask, batch: int, heads: int, n: int, m: int, q_offset=0):
  """A MaskSpec, a Mask, a boolean array or None -> a boolean array
  broadcastable to [batch, heads, n, m], or None (the dense path's form);
  query i sits at q_offset + i."""
  if isinstance(mask, MaskSpec):
    return mask.to_dense(n, m, q_offset)
  if isinstance(mask, Mask):
    return evaluate(mask, batch, heads, n, m, q_offset)
  return mask


# ------------------------------------------------------------ masks as functions
#
# A Mask is FlexAttention's mask_mod kept to JAX: a function of (batch, head,
# query index, key index) -> bool, True = may attend, evaluated on int arrays
# that broadcast ([B,1,1,1], [1,H,1,1], [1,1,N,1], [1,1,1,M]). A query's index
# counts from the sequence's first query (a decoding step's offset included),
# a key's from the first key. Masks combine with &, | and ~; `block_mask`
# classifies each block of a call once, for the blocked kernels.
#
# The data a mask reads (padding, segments, prefix lengths) are its explicit
# `arrays`, handed to its function after the indices, not closed over: a
# kernel passes them as its own operands and calls the mask with them
# replaced (`with_arrays`; a Pallas kernel passes refs, whose indexing by an
# int array is a gather load). So a mask's function only indexes its arrays
# (arr[b, k], arr[b]), with indices inside their shapes.

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Mask:
  """fn(b, h, q, k, *arrays) -> bool (section comment above); `name` for
  messages; `arrays` the data fn reads."""
  fn: Callable[..., Any]
  name: str = 'mask'
  arrays: tuple = ()

  def __post_init__(self):
    # Data as JAX arrays: a kernel indexes them by traced indices, which a
    # numpy array refuses (TracerArrayConversionError).
    object.__setattr__(self, 'arrays', tuple(
        jnp.asarray(x) if isinstance(x, (np.ndarray, list, tuple)) else x for x in self.arrays))

  def __call__(self, b, h, q, k):
    return self.fn(b, h, q, k, *self.arrays)

  def with_arrays(self, arrays) -> Mask:
    """The same rule reading `arrays` (one for each of self.arrays, in order)."""
    arrays = tuple(arrays)
    if len(arrays) != len(self.arrays):
      raise ValueError(f'{self.name} reads {len(self.arrays)} arrays, got {len(arrays)}')
    return dataclasses.replace(self, arrays=arrays)

  def __and__(self, other: Mask) -> Mask:
    return _combine(jnp.logical_and, self, other, f'({self.name} & {other.name})')

  def __or__(self, other: Mask) -> Mask:
    return _combine(jnp.logical_or, self, other, f'({self.name} | {other.name})')

  def __invert__(self) -> Mask:
    fn = self.fn
    return Mask(lambda b, h, q, k, *arrays: jnp.logical_not(fn(b, h, q, k, *arrays)),
                f'~{self.name}', self.arrays)


def closes_over_arrays(mask: Mask) -> bool:
  """Whether `mask`'s function reads an array it closed over instead of its
  `arrays` (a fused kernel cannot take such a mask: its data must be inputs)."""
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  closed = jax.make_jaxpr(lambda *a: mask.fn(*a[:4], *a[4:]))(
      *[scalar] * 4, *[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                      for x in mask.arrays])
  return any(jnp.ndim(c) > 0 for c in closed.consts)


def _combine(op, first: Mask, second: Mask, name: str) -> Mask:
  """op of two masks; the arrays are first's then second's."""
  split, f, g = len(first.arrays), first.fn, second.fn

  def fn(b, h, q, k, *arrays):
    return op(f(b, h, q, k, *arrays[:split]), g(b, h, q, k, *arrays[split:]))
  return Mask(fn, name, first.arrays + second.arrays)


def causal() -> Mask:
  return Mask(lambda b, h, q, k: k <= q, 'causal')


def sliding_window(window: int, causal_: bool = False) -> Mask:
  """|k - q| < window; causal_: q - window < k <= q (local attention's band)."""
  return Mask(lambda b, h, q, k: band(q, k, window, causal_), f'window({window})')


def key_padding(key_valid) -> Mask:
  """key_valid bool [B, M]: False keys are seen by no query."""
  return Mask(lambda b, h, q, k, valid: valid[b, k], 'key_padding',
              (jnp.asarray(key_valid, bool),))


def query_padding(query_valid) -> Mask:
  """query_valid bool [B, N]: False queries see no key."""
  return Mask(lambda b, h, q, k, valid: valid[b, q], 'query_padding',
              (jnp.asarray(query_valid, bool),))


def segments(query_segments, key_segments) -> Mask:
  """int [B, N] and [B, M]: a query sees the keys of its own segment
  (packed examples, documents)."""
  return Mask(lambda b, h, q, k, q_seg, k_seg: q_seg[b, q] == k_seg[b, k], 'segments',
              (jnp.asarray(query_segments), jnp.asarray(key_segments)))


def prefix_lm(prefix_len) -> Mask:
  """int [B]: every query sees the first prefix_len[b] keys (the prompt,
  attended bidirectionally), and the keys before it causally."""
  return Mask(lambda b, h, q, k, prefix: (k <= q) | (k < prefix[b]), 'prefix_lm',
              (jnp.asarray(prefix_len),))


def chunked_causal(chunk: int) -> Mask:
  """Causal inside chunks of `chunk` positions, nothing across them."""
  return Mask(lambda b, h, q, k: (k <= q) & (k // chunk == q // chunk), f'chunked_causal({chunk})')


def _indices(batch: int, heads: int, q, k):
  b = jnp.arange(batch)[:, None, None, None]
  h = jnp.arange(heads)[None, :, None, None]
  return b, h, q[None, None, :, None], k[None, None, None, :]


def at(mask: Mask, batch: int, heads: int, q, k):
  """The mask at query indices q int [n] and key indices k int [m], for
  every row and head -> bool broadcastable to [batch, heads, n, m]."""
  return jnp.asarray(mask(*_indices(batch, heads, q, k)), bool)


def evaluate(mask: Mask, batch: int, heads: int, n: int, m: int, q_offset=0):
  """The mask as a boolean array broadcastable to [batch, heads, n, m]
  (queries at indices q_offset .. q_offset + n - 1)."""
  return at(mask, batch, heads, q_offset + jnp.arange(n), jnp.arange(m))


def rows_seeing_a_key(mask: Mask, batch: int, heads: int, n: int, m: int, q_offset=0,
                      rows: int = 128):
  """Whether each query (query i at index q_offset + i) sees any of the m
  keys -> bool [batch | 1, heads | 1, n]; `rows` queries at a time, so the
  memory is rows * m, not n * m."""
  rows = min(rows, n)
  k = jnp.arange(m)

  def block(i):
    seen = at(mask, batch, heads, q_offset + i * rows + jnp.arange(rows), k)
    seen = jnp.broadcast_to(seen, jnp.broadcast_shapes(seen.shape, (1, 1, rows, m)))
    return jnp.any(seen, axis=-1)  # [b | 1, h | 1, rows]

  out = jax.lax.map(block, jnp.arange(-(-n // rows)))  # [blocks, b | 1, h | 1, rows]
  return jnp.moveaxis(out, 0, 2).reshape(out.shape[1:3] + (-1,))[..., :n]


def block_mask(mask: Mask, batch: int, heads: int, n: int, m: int, bq: int, bk: int,
               q_offset=0):
  """Each block's state, computed once per call -> int8 [batch | 1, heads | 1,
  ceil(n / bq), ceil(m / bk)]: EMPTY (no pair visible: skip it), FULL (every
  pair visible: no select needed) or PARTIAL. Keys past m are hidden, queries
  past n do not count. One query block at a time: the memory is a block row's,
  as broadcast as the mask's own arrays."""
  nq, nk = -(-n // bq), -(-m // bk)
  k = jnp.arange(nk * bk)
  k_real = (k < m)[None, None, None, :]

  def row(qb):
    q = q_offset + qb * bq + jnp.arange(bq)
    q_real = (qb * bq + jnp.arange(bq) < n)[None, None, :, None]
    seen = jnp.logical_and(at(mask, batch, heads, q, k), k_real)  # [.., bq, nk * bk]
    shape = jnp.broadcast_shapes(seen.shape, (1, 1, bq, nk * bk))
    seen = jnp.broadcast_to(seen, shape).reshape(shape[:2] + (bq, nk, bk))
    real = q_real[..., None]
    any_ = jnp.any(seen & real, axis=(2, 4))
    all_ = jnp.all(seen | ~real, axis=(2, 4))
    return jnp.where(any_, jnp.where(all_, FULL, PARTIAL), EMPTY).astype(jnp.int8)

  # Indices past the arrays' ends (the last blocks' tails) read clamped
  # values; k_real and q_real leave those pairs out.
  rows = jax.lax.map(row, jnp.arange(nq))  # [nq, b | 1, h | 1, nk]
  return jnp.moveaxis(rows, 0, 2)
