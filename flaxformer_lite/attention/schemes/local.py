"""Sliding-window (local) self-attention for the Transformer.

Query i sits at absolute position p = q_offset + i, key j at position j.
  causal=True:  p sees the `window` keys p - window < j <= p (itself included).
  causal=False: p sees the 2*window - 1 keys |j - p| < window.
Inside the window the logits are dot_product's, q.k / sqrt(d) + bias.
The mask is and-ed with the window, so causal=False (the default) is right in every model
(decoders pass their causal mask); causal=True also makes an encoder causal,
and saves the blocked form a third of its work in decoders.

Two forms give the same numbers (attention dropout included: dropout.py's
keep mask is a function of the query and key indices):
  blocked: queries in blocks of `window`; each block attends to its own key
    block and the previous one (and the next one if not causal): logits
    [b, h, n/w, w, 2w or 3w], so time and memory grow with n * window.
    Needs q_offset == 0 (a python int), n == m, n % window == 0; taken when
    that context is at most half of m: with more, it saves too little of the
    [n, m] work to pay for the blocking (benchmarks/local_attention.py).
  plain: [b, h, n, m] logits under an explicit band mask; for decoding with
    a cache (traced q_offset), ragged lengths, and return_weights (whose
    [b, h, n, m] result costs O(nm) anyway).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks, registry, scheme
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.attention.softmax import window_softmax


# The blocked form is taken when m is at least this many times its context
# (2 or 3 windows; the module docstring says why).
_BLOCKED_MIN_RATIO = 2


band = masks.band  # the window's rule, one definition for every kernel


def _plain(query, key, value, *, window, causal, q_offset, mask, bias, dtype, **drop):
  n, m = query.shape[1], key.shape[1]
  scaled = query.astype(dtype) / jnp.sqrt(query.shape[-1]).astype(dtype)
  logits = jnp.einsum('bnhd,bmhd->bhnm', scaled, key.astype(dtype),
                      preferred_element_type=jnp.float32)  # [b, h, n, m]
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  in_window = band((q_offset + jnp.arange(n))[:, None], jnp.arange(m)[None, :],
                   window, causal)  # [n, m]
  weights = window_softmax(logits, in_window, mask, dtype=dtype, **drop)
  return jnp.einsum('bhnm,bmhd->bnhd', weights, value.astype(dtype)), weights


def _key_blocks(x, num_blocks, w, ctx):
  """[b, n, ...] -> [b, n/w, ctx*w, ...]: for query block c, keys (c-1)w .. (c-1+ctx)w - 1.

  Zero rows stand in for keys before 0 and after n - 1.
  """
  pad = [(0, 0)] * x.ndim
  pad[1] = (w, (ctx - 2) * w)  # one block before, ctx-2 blocks after
  blocks = jnp.pad(x, pad).reshape((x.shape[0], num_blocks + ctx - 1, w) + x.shape[2:])
  return jnp.concatenate([blocks[:, s:s + num_blocks] for s in range(ctx)], axis=2)


def _gather_blocks(x, num_blocks, w, ctx, fill):
  """A mask or bias broadcastable to [b, h, n, m] (n = m) -> [B, H, n/w | 1, w | 1, ctx*w].

  Row c*w + r, columns (c-1)w .. (c-1+ctx)w - 1 (`fill` outside 0..m-1):
  O(n * ctx * w) elements, whatever the input's size.
  """
  x = jnp.asarray(x)
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  m = num_blocks * w
  x = jnp.broadcast_to(x, x.shape[:3] + (m,))  # [B, H, n|1, m]
  x = jnp.pad(x, [(0, 0)] * 3 + [(w, (ctx - 2) * w)], constant_values=fill)  # key j at j + w
  rows = (x.reshape(x.shape[:2] + (num_blocks, w, -1)) if x.shape[2] > 1
          else x[:, :, None])  # [B, H, nb|1, w|1, m + (ctx-1)w]
  cols = jnp.arange(num_blocks)[:, None, None] * w + jnp.arange(ctx * w)  # [nb, 1, ctx*w]
  return jnp.take_along_axis(rows, cols[None, None], axis=-1)


def _blocked(query, key, value, *, window, causal, mask, bias, dtype, **drop):
  b, n, h, d = query.shape
  w, nb, ctx = window, n // window, 2 if causal else 3
  q = (query.astype(dtype) / jnp.sqrt(d).astype(dtype)).reshape(b, nb, w, h, d)
  k = _key_blocks(key.astype(dtype), nb, w, ctx)  # [b, nb, ctx*w, h, d]
  v = _key_blocks(value.astype(dtype), nb, w, ctx)  # [b, nb, ctx*w, h, d]
  logits = jnp.einsum('bcqhd,bckhd->bhcqk', q, k,
                      preferred_element_type=jnp.float32)  # [b, h, nb, w, ctx*w]
  if bias is not None:
    logits = logits + _gather_blocks(bias, nb, w, ctx, 0).astype(jnp.float32)
  q_pos = jnp.arange(nb)[:, None, None] * w + jnp.arange(w)[:, None]  # [nb, w, 1]
  k_pos = (jnp.arange(nb)[:, None, None] - 1) * w + jnp.arange(ctx * w)  # [nb, 1, ctx*w]
  # The zero blocks before key 0 and after key n-1 are not keys.
  in_window = band(q_pos, k_pos, w, causal) & (k_pos >= 0) & (k_pos < n)  # [nb, w, ctx*w]
  if mask is not None:
    mask = _gather_blocks(mask.astype(bool), nb, w, ctx, False)
  weights = window_softmax(logits, in_window, mask, dtype=dtype, q_idx=q_pos, k_idx=k_pos,
                           **drop)
  out = jnp.einsum('bhcqk,bckhd->bcqhd', weights, v)  # [b, nb, w, h, d]
  return out.reshape(b, n, h, d)


def local_attention(query, key, value, *, window=8, causal=False, q_offset=0,
                    mask=None, bias=None, dropout_rate=0.0, dropout_rng=None,
                    deterministic=True, dtype=None, return_weights=False):
  """Sliding-window attention (module docstring for the window).

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i.
    key, value: [b, m, h, d], key j at position j.
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend; and-ed
      with the window.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype); with return_weights,
    (that, weights [b, h, n, m]).
  """
  dtype = dtype or query.dtype
  n, m = query.shape[1], key.shape[1]
  common = dict(window=window, causal=causal, mask=mask, bias=bias, dtype=dtype,
                dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                deterministic=deterministic)
  blocked = (isinstance(q_offset, int) and q_offset == 0 and n == m and n % window == 0
             and _BLOCKED_MIN_RATIO * (2 if causal else 3) * window <= m)
  if blocked and not return_weights:
    return _blocked(query, key, value, **common)
  out, weights = _plain(query, key, value, q_offset=q_offset, **common)
  return (out, weights) if return_weights else out


def _window_mean(window, causal, value, tables, q_pos, m):
  """Uniform weights over each query's window (window_softmax's rule for a
  query that sees none of its keys): the mean of the window's values by
  prefix sums over the keys that the n queries' windows can reach (n + 2
  windows of them, so a decoding step costs O(window), not O(cache))
  -> [b, n, h, d] float32, zero for an empty window."""
  del tables
  span = min(m, q_pos.shape[0] + 2 * window)
  start = jnp.clip(q_pos[0] - window + 1, 0, m - span)
  near = jax.lax.dynamic_slice_in_dim(value.astype(jnp.float32), start, span, axis=1)
  sums = jnp.cumsum(near, axis=1)
  sums = jnp.concatenate([jnp.zeros_like(sums[:, :1]), sums], axis=1)  # [b, span + 1, h, d]
  lo = jnp.clip(q_pos - window + 1, 0, m)  # first key in the window
  hi = jnp.clip(q_pos + (1 if causal else window), 0, m)  # one past the last
  count = jnp.maximum(hi - lo, 0)
  lo, hi = lo - start, jnp.maximum(hi, lo) - start
  total = jnp.take(sums, hi, axis=1) - jnp.take(sums, lo, axis=1)
  return total / jnp.maximum(count, 1).astype(jnp.float32)[None, :, None, None]


def local_chunked(query, key, value, *, window=8, causal=False, q_offset=0, mask=None,
                  chunk_size=None, dtype=None, **dropout):
  """local_attention block by block: the window joins the mask description,
  so only the key blocks that meet a query block's window are computed,
  O(n * window). Blocks are at most max(32, 4 * window) wide: wider ones
  mostly compute pairs outside the window."""
  chunk_size = min(chunk_size or blockwise.DEFAULT_CHUNK_SIZE, max(32, 4 * window))
  window_mask = masks.sliding_window(window, causal)  # the kernel skips the blocks outside it
  mask = window_mask if mask is None else masks.as_mask(mask, q_offset) & window_mask
  terms = scheme.Terms(uniform=functools.partial(_window_mean, window, causal))
  return blockwise.dot_product(query, key, value, terms, mask=mask, q_offset=q_offset,
                               chunk_size=chunk_size, dtype=dtype, **dropout)


@dataclasses.dataclass(frozen=True)
class LocalOptions:
  """Sliding-window attention's options.

  window: the keys query p sees: |j - p| < window, or with causal
    p - window < j <= p; >= 1.
  causal: see only the window's keys up to the query's position.
  """
  window: int = 8
  causal: bool = False

  def __post_init__(self):
    registry.check_int(self, 'window', 1)
    registry.check_bool(self, 'causal')


registry.register(registry.AttentionVariant(
    name='local',
    models=registry.TRANSFORMER_MODELS,
    fn=local_attention,
    chunked=local_chunked,
    options=LocalOptions,
    uses_positions=True,
    doc='sliding-window softmax(q.k/sqrt(d)): causal=True sees the window keys '
        'p-window < j <= p, causal=False |j-p| < window; blocked O(n*window) form'))
