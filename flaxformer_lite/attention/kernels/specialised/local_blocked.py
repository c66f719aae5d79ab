"""Local attention's blocked form: queries in blocks of `window`; each block
attends to its own key block and the previous one (and the next one if not
causal): logits [b, h, n/w, w, 2w or 3w], so time and memory grow with
n * window, where local's dense form (schemes/local.py) costs n * m. The same
numbers, attention dropout included (dropout.py's keep mask is a function of
the query and key indices).
"""
from __future__ import annotations

import jax.numpy as jnp

from flaxformer_lite.attention.masks import band
from flaxformer_lite.attention.softmax import window_softmax


def fits(n: int, m: int, window: int, q_offset) -> str | None:
  """None where the blocked form runs a call: q_offset a Python 0 (not a
  decoding step), n = m and n a multiple of the window; else why not."""
  if not (isinstance(q_offset, int) and q_offset == 0):
    return 'it needs the queries at 0..n-1 (no decoding offset)'
  if n != m or n % window:
    return f'lengths {n} and {m}: it needs n = m, a multiple of the window ({window})'
  return None


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


def blocked_attention(query, key, value, *, window, causal, mask, bias, dtype, **drop):
  """local_attention (schemes/local.py) in blocks: query [b, n, h, d], key
  and value [b, n, h, d], queries at 0..n-1 (fits) -> [b, n, h, d]."""
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
