"""Causal attention of each query to its k nearest keys only, pair by pair.

Query i meets keys i, i-1, .., i-k+1 (lag t = i - j in 0..k-1; keys before 0
are hidden), in O(n k) time and memory: the scores are k lagged dot
products, never an [n, m] block. Shaw's relative attention on the chunked
kernel (relative.shaw_chunked) runs its causal calls as this band, where the
table rows differ pair by pair, merged (chunked.merge) with the chunked
kernel over the keys at lag >= k, where every pair has the same row.

The lagged weighted sums are one sum of k shifted slices each (one fused
pass on CPU), the lagged dot products small matmuls over windows of keys,
and their gradients are written out as the same two: autodiff would
transpose each slice into a padded copy, k arrays of [b, n, h, d].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dropout


def _lagged(x, k: int):
  """[b, n, ...] -> k views of it, the t-th row i holding x[i - t] (0 for i < t)."""
  n = x.shape[1]
  x = jax.lax.optimization_barrier(x)
  padded = jnp.pad(x, [(0, 0), (k - 1, 0)] + [(0, 0)] * (x.ndim - 2))
  return [padded[:, k - 1 - t:k - 1 - t + n] for t in range(k)]


def _led(x, k: int):
  """[b, n, ...] -> k views of it, the t-th row i holding x[i + t] (0 for i >= n - t)."""
  n = x.shape[1]
  x = jax.lax.optimization_barrier(x)
  padded = jnp.pad(x, [(0, 0), (0, k - 1)] + [(0, 0)] * (x.ndim - 2))
  return [padded[:, t:t + n] for t in range(k)]


def _lagged_sum(p, x):
  """out[i] = sum_t p[i, t] x[i - t]: p [b, n, h, k], x [b, n, h, d] -> [b, n, h, d]."""
  return sum(p[..., t, None] * x_t for t, x_t in enumerate(_lagged(x, p.shape[-1])))


def _led_sum(p, x):
  """out[j] = sum_t p[j + t, t] x[j + t], the transpose of _lagged_sum in x:
  p [b, n, h, k], x [b, n, h, d] -> [b, n, h, d]."""
  k = p.shape[-1]
  return sum(p_t[..., t, None] * x_t for t, (p_t, x_t) in enumerate(zip(_led(p, k), _led(x, k))))


# lagged_dots' rows per product: queries rB .. rB + B - 1 meet the B + k - 1
# keys from rB - k + 1 in one small matmul, of which each row keeps its k
# lags. On CPU this takes half the time of k multiply-and-reduce passes,
# which XLA gives a copy each.
_ROWS = 16


def _diagonals(x, k: int):
  """x [..., B, W] -> [..., B, k]: out[i, c] = x[i, i + c] (k <= W)."""
  rows, width = x.shape[-2:]
  lead = x.shape[:-2]
  flat = jnp.pad(x.reshape(lead + (rows * width,)), [(0, 0)] * len(lead) + [(0, rows)])
  return flat.reshape(lead + (rows, width + 1))[..., :k]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lagged_dots(q, x, k: int):
  """s[i, t] = q[i] . x[i - t] (0 for i < t): q, x [b, n, h, d] -> float32 [b, n, h, k]."""
  b, n, h, d = q.shape
  rows = max(k, _ROWS)
  blocks = -(-n // rows)
  length = blocks * rows
  padded = jnp.pad(x, [(0, 0), (k - 1, length - n + rows), (0, 0), (0, 0)])
  ahead = padded[:, rows:rows + length].reshape(b, blocks, rows, h, d)[:, :, :k - 1]
  window = jnp.concatenate([padded[:, :length].reshape(b, blocks, rows, h, d), ahead], axis=2)
  q = jnp.pad(q, [(0, 0), (0, length - n), (0, 0), (0, 0)]).reshape(b, blocks, rows, h, d)
  s = jnp.einsum('brqhd,brchd->brhqc', q, window, preferred_element_type=jnp.float32)
  # window column c holds key rB - k + 1 + c, at lag i + k - 1 - c from query rB + i
  s = _diagonals(s, k)[..., ::-1]  # [b, blocks, h, rows, k]
  return s.transpose(0, 1, 3, 2, 4).reshape(b, length, h, k)[:, :n]


def _lagged_dots_fwd(q, x, k):
  return lagged_dots(q, x, k), (q, x)


def _lagged_dots_bwd(k, res, ds):
  q, x = res
  return _lagged_sum(ds, x), _led_sum(ds, q)


lagged_dots.defvjp(_lagged_dots_fwd, _lagged_dots_bwd)


@jax.custom_vjp
def lagged_sum(p, x):
  """out[i] = sum_t p[i, t] x[i - t]: p [b, n, h, k], x [b, n, h, d] -> [b, n, h, d]."""
  return _lagged_sum(p, x)


def _lagged_sum_fwd(p, x):
  return _lagged_sum(p, x), (p, x)


def _lagged_sum_bwd(res, d_out):
  p, x = res
  return lagged_dots(d_out, x, p.shape[-1]), _led_sum(p, d_out)


lagged_sum.defvjp(_lagged_sum_fwd, _lagged_sum_bwd)


def causal_band(q, key, value, k: int, key_rows=None, value_rows=None, *, seed=None,
                rate: float = 0.0):
  """Attention of query i to keys i-k+1 .. i, each pair's score and value
  given its lag's table row, normalised over those keys alone.

  Args:
    q: [b, n, h, d], already scaled; key [b, n, h, d], value [b, n, h, dv]
      (as many heads as q).
    k: keys per query (lags 0 .. k-1), 1 <= k.
    key_rows, value_rows: [k, d] and [k, dv], or None: row k - 1 - t is added
      to the key (value) at lag t, so row k - 1 is lag 0's.
    seed, rate: attention dropout by dropout.py's hash of (row, head, query
      i, key i - t), the bits every kernel draws for that pair.
  Returns:
    (out float32 [b, n, h, dv], lse float32 [b, h, n]) for chunked.merge.
  """
  n = q.shape[1]
  q, key, value = (x.astype(jnp.float32) for x in (q, key, value))
  s = lagged_dots(q, key, k)  # [b, n, h, k]
  if key_rows is not None:
    s = s + jnp.einsum('bnhd,td->bnht', q, key_rows[::-1].astype(jnp.float32))
  lag = jnp.arange(k)[None, :]
  i = jnp.arange(n)[:, None]
  s = jnp.where((lag <= i)[None, :, None, :], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, -1)  # lag 0 is always seen
  p = jnp.exp(s - lse[..., None])
  if rate:
    kept = dropout.keep(seed, rate, (p.shape[0], p.shape[2]), i, i - lag)  # [b, h, n, k]
    p = jnp.where(kept.transpose(0, 2, 1, 3), p / (1.0 - rate), 0.0)
  out = lagged_sum(p, value)
  if value_rows is not None:
    out = out + jnp.einsum('bnht,td->bnhd', p, value_rows[::-1].astype(jnp.float32))
  return out, lse.transpose(0, 2, 1)
