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

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


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


def as_dense(mask, n: int, m: int, q_offset=0):
  """A MaskSpec, a boolean array or None -> a boolean array or None (the dense path's form)."""
  if isinstance(mask, MaskSpec):
    return mask.to_dense(n, m, q_offset)
  return mask
