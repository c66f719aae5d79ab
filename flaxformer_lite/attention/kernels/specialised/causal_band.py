"""Causal attention of each query to its k nearest keys only, pair by pair.

Query i meets keys i, i-1, .., i-k+1 (lag t = i - j in 0..k-1; keys before 0
are hidden), in O(n k) time and memory: the scores are k lagged dot
products, never an [n, m] block. Shaw's relative attention on the kernel
`shaw_by_lag` (by_lag) runs causal calls as this band, where the table rows
differ pair by pair, merged (blockwise.merge) with the blockwise kernel over
the keys at lag >= k, where every pair has the same row.

Both lagged products (scores, and the weighted sum of values) are small
matmuls over windows of B + k - 1 keys for B queries, and their gradients
are written out as the same products (custom VJPs), not autodiff's
transposes of the windows' pads and slices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dropout, masks, softmax
from flaxformer_lite.attention.kernels import blockwise, product


# Rows per window: queries rB .. rB + B - 1 meet the B + k - 1 keys from
# rB - k + 1 in one small matmul, of which each row keeps its k lags. Not a
# sum of k shifted slices: XLA:CPU hands such sums to a library fusion that
# keeps the k slices as k arrays of [b, n, h, d].
_ROWS = 16


def _sizes(n: int, k: int):
  """(rows B, blocks, length = blocks * B) for n queries and k lags."""
  rows = max(k, _ROWS)
  blocks = -(-n // rows)
  return rows, blocks, blocks * rows


def _windows(x, k: int):
  """x [b, n, h, d] -> [b, blocks, B + k - 1, h, d]: window r holds rows
  rB - k + 1 .. rB + B - 1 of x (zeros outside 0..n-1)."""
  b, n, h, d = x.shape
  rows, blocks, length = _sizes(n, k)
  padded = jnp.pad(x, [(0, 0), (k - 1, length - n + rows), (0, 0), (0, 0)])
  ahead = padded[:, rows:rows + length].reshape(b, blocks, rows, h, d)[:, :, :k - 1]
  return jnp.concatenate([padded[:, :length].reshape(b, blocks, rows, h, d), ahead], axis=2)


def _blocks(x, k: int):
  """x [b, n, h, d] -> [b, blocks, B, h, d], zero rows after n."""
  b, n, h, d = x.shape
  _, blocks, length = _sizes(n, k)
  return jnp.pad(x, [(0, 0), (0, length - n), (0, 0), (0, 0)]).reshape(b, blocks, -1, h, d)


def _scores_by_lag(s, n: int):
  """Window scores [b, blocks, h, B, B + k - 1] -> [b, n, h, k] by lag: window
  column c holds key rB - k + 1 + c, at lag i + k - 1 - c from query rB + i."""
  b, blocks, h, rows, width = s.shape
  k = width - rows + 1
  flat = jnp.pad(s.reshape(b, blocks, h, rows * width), [(0, 0)] * 3 + [(0, rows)])
  s = flat.reshape(b, blocks, h, rows, width + 1)[..., k - 1::-1]  # [.., i, t] = s[.., i, i + k - 1 - t]
  return s.transpose(0, 1, 3, 2, 4).reshape(b, blocks * rows, h, k)[:, :n]


def _weights_by_window(p):
  """p [b, n, h, k] by lag -> [b, blocks, h, B, B + k - 1] by window column
  (_scores_by_lag's transpose: zeros off the band)."""
  b, n, h, k = p.shape
  rows, blocks, length = _sizes(n, k)
  width = rows + k - 1
  p = jnp.pad(p, [(0, 0), (0, length - n), (0, 0), (0, 0)])[..., ::-1]
  p = p.reshape(b, blocks, rows, h, k).transpose(0, 1, 3, 2, 4)
  p = jnp.pad(p, [(0, 0)] * 4 + [(0, width + 1 - k)]).reshape(b, blocks, h, rows * (width + 1))
  return p[..., :rows * width].reshape(b, blocks, h, rows, width)


def _lags(valid, k: int):
  """bool [b, n] -> k arrays [b, n], the t-th holding valid[i - t] (False for i < t)."""
  n = valid.shape[1]
  padded = jnp.pad(valid.astype(bool), [(0, 0), (k - 1, 0)])
  return [padded[:, k - 1 - t:k - 1 - t + n] for t in range(k)]


def _lagged_dots(q, x, k: int):
  s = jnp.einsum('brqhd,brchd->brhqc', _blocks(q, k), _windows(x, k),
                 preferred_element_type=jnp.float32)
  return _scores_by_lag(s, q.shape[1])


def _lagged_sum(p, x):
  out = jnp.einsum('brhqc,brchd->brqhd', _weights_by_window(p), _windows(x, p.shape[-1]),
                   preferred_element_type=jnp.float32)
  return out.reshape((x.shape[0], -1) + x.shape[2:])[:, :x.shape[1]]


def _led_sum(p, y):
  """out[j] = sum_t p[j + t, t] y[j + t], the transpose of _lagged_sum in x:
  p [b, n, h, k], y [b, n, h, d] -> [b, n, h, d]."""
  k = p.shape[-1]
  per_window = jnp.einsum('brhqc,brqhd->brchd', _weights_by_window(p), _blocks(y, k),
                          preferred_element_type=jnp.float32)
  fold, = jax.linear_transpose(lambda x: _windows(x, k), y.astype(jnp.float32))(per_window)
  return fold


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lagged_dots(q, x, k: int):
  """s[i, t] = q[i] . x[i - t] (0 for i < t): q, x [b, n, h, d] -> float32 [b, n, h, k]."""
  return _lagged_dots(q, x, k)


def _lagged_dots_fwd(q, x, k):
  return _lagged_dots(q, x, k), (q, x)


def _lagged_dots_bwd(k, res, ds):
  q, x = res
  return _lagged_sum(ds, x).astype(q.dtype), _led_sum(ds, q).astype(x.dtype)


lagged_dots.defvjp(_lagged_dots_fwd, _lagged_dots_bwd)


@jax.custom_vjp
def lagged_sum(p, x):
  """out[i] = sum_t p[i, t] x[i - t]: p [b, n, h, k], x [b, n, h, d] -> float32 [b, n, h, d]."""
  return _lagged_sum(p, x)


def _lagged_sum_fwd(p, x):
  return _lagged_sum(p, x), (p, x)


def _lagged_sum_bwd(res, d_out):
  p, x = res
  return _lagged_dots(d_out, x, p.shape[-1]).astype(p.dtype), _led_sum(p, d_out).astype(x.dtype)


lagged_sum.defvjp(_lagged_sum_fwd, _lagged_sum_bwd)


def causal_band(q, key, value, k: int, key_rows=None, value_rows=None, *, key_valid=None,
                query_valid=None, seed=None, rate: float = 0.0):
  """Attention of query i to keys i-k+1 .. i, each pair's score and value
  given its lag's table row, normalised over those keys alone.

  Args:
    q: [b, n, h, d], already scaled; key [b, n, h, d], value [b, n, h, dv]
      (as many heads as q).
    k: keys per query (lags 0 .. k-1), 1 <= k.
    key_rows, value_rows: [k, d] and [k, dv], or None: row k - 1 - t is added
      to the key (value) at lag t, so row k - 1 is lag 0's.
    key_valid, query_valid: bool [b, n] or None: padding, hidden.
    seed, rate: attention dropout by dropout.py's hash of (row, head, query
      i, key i - t), the bits every kernel draws for that pair.
  Returns:
    (out float32 [b, n, h, dv], lse float32 [b, h, n]) for blockwise.merge;
    a row that sees none of its keys has out 0 and lse -inf.
  """
  n = q.shape[1]
  q, key, value = (x.astype(jnp.float32) for x in (q, key, value))
  s = lagged_dots(q, key, k)  # [b, n, h, k]
  if key_rows is not None:
    s = s + jnp.einsum('bnhd,td->bnht', q, key_rows[::-1].astype(jnp.float32))
  lag = jnp.arange(k)[None, :]
  i = jnp.arange(n)[:, None]
  seen = (lag <= i)[None, :, None, :]  # [1 | b, n, 1, k]
  if key_valid is not None:  # key i - t of row i
    seen = seen & jnp.stack(_lags(key_valid, k), -1)[:, :, None, :]
  if query_valid is not None:
    seen = seen & query_valid[:, :, None, None]
  # A row that sees no key (padding) is given finite scores, and then lse
  # -inf: logsumexp over nothing has a NaN gradient.
  some = jnp.any(seen, -1)
  lse = jax.nn.logsumexp(jnp.where(seen, s, jnp.where(some[..., None], -jnp.inf, 0.0)), -1)
  p = jnp.where(seen, jnp.exp(s - lse[..., None]), 0.0)
  lse = jnp.where(some, lse, -jnp.inf)
  if rate:
    kept = dropout.keep(seed, rate, (p.shape[0], p.shape[2]), i, i - lag)  # [b, h, n, k]
    p = jnp.where(kept.transpose(0, 2, 1, 3), p / (1.0 - rate), 0.0)
  out = lagged_sum(p, value)
  if value_rows is not None:
    out = out + jnp.einsum('bnht,td->bnhd', p, value_rows[::-1].astype(jnp.float32))
  return out, lse.transpose(0, 2, 1)


def by_lag(query, key, value, tables, *, mask, uniform, chunk_size=None, dtype=None,
           dropout_rate=0.0, dropout_rng=None):
  """Shaw et al.'s causal self-attention with the pairs split by lag i - j
  (`fits`): query [b, n, h, d] (unscaled), key and value [b, n, g, d];
  tables {'rel_key_table', 'rel_value_table'} [2k+1, d] (one or both);
  mask a masks.Mask of the causal rule and padding; uniform(value, tables,
  q_pos, k_pos), the output of a query that sees no key (the scheme's
  Terms.uniform) -> [b, n, h, d] in `dtype`.

  At lag >= k every pair has table row 0: those run as the blockwise
  kernel's plain attention, with the queries moved k rows up so that its
  causal diagonal is lag k, and row 0 added to its rows' log-sum-exps and
  outputs. The k nearest keys of each query run as causal_band's O(n k)
  band. The two are merged by their log-sum-exps (blockwise.merge)."""
  dtype = dtype or query.dtype
  b, n, h, d = query.shape
  key_table, value_table = tables.get('rel_key_table'), tables.get('rel_value_table')
  k = ((key_table if key_table is not None else value_table).shape[0] - 1) // 2
  q = query.astype(dtype) / jnp.sqrt(d).astype(dtype)
  key, value = key.astype(dtype), value.astype(dtype)
  rate = dropout_rate if dropout_rng is not None else 0.0
  # Row 0 on every far pair. q_i . a^K_0 is the same for all of a row's far
  # keys: it moves their log-sum-exp only. Their weights sum to one, so
  # they add a^V_0, except under dropout, where the kept weights' sum is
  # the kernel's to take: then a^V_0 rides on the values.
  v_row0 = value_table is not None and bool(rate)
  far_value = value + value_table[0].astype(dtype) if v_row0 else value
  # Query i + k in row i: the kernel's causal diagonal is then lag k. The
  # last k rows are zeros whose outputs are dropped.
  moved = jnp.concatenate([q[:, k:], jnp.zeros_like(q[:, :k])], axis=1)
  rules = masks.rules_of(mask)
  far_mask = masks.causal()
  if rules.key_valid is not None:
    far_mask = far_mask & masks.key_padding(rules.key_valid)
  if rules.query_valid is not None:
    far_mask = far_mask & masks.query_padding(
        jnp.pad(rules.query_valid[:, k:], [(0, 0), (0, k)]))
  far, far_lse = blockwise.attend(moved, key, far_value, mask=far_mask, chunk_size=chunk_size,
                                  dtype=dtype, return_lse=True, dropout_first_query=k,
                                  dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  far = far.astype(jnp.float32)
  if value_table is not None and not v_row0:
    far = far + value_table[0].astype(jnp.float32)
  if key_table is not None:
    far_lse = far_lse + jnp.einsum('bnhd,d->bhn', moved.astype(jnp.float32),
                                   key_table[0].astype(jnp.float32))
  far = jnp.concatenate([jnp.zeros_like(far[:, :k]), far[:, :n - k]], axis=1)
  far_lse = jnp.concatenate([jnp.full_like(far_lse[:, :, :k], -jnp.inf), far_lse[:, :, :n - k]],
                            axis=2)
  rows = lambda t: None if t is None else t[1:k + 1]  # noqa: E731  (lags k-1 .. 0)
  near, near_lse = causal_band(
      q, product.repeat_heads(key, h), product.repeat_heads(value, h), k, rows(key_table),
      rows(value_table), key_valid=rules.key_valid, query_valid=rules.query_valid,
      seed=dropout.seed(dropout_rng) if rate else None, rate=rate)
  out = blockwise.merge(far, far_lse, near, near_lse)
  rule = None if masks.hides_no_row(mask) else lambda: product.repeat_heads(
      uniform(value, tables, jnp.arange(n), jnp.arange(n)), h)
  return softmax.where_no_key(out, jnp.logaddexp(far_lse, near_lse), rule).astype(dtype)


def fits(mask, q_offset, n: int, m: int, tables) -> str | None:
  """None where by_lag runs a call: causal self-attention (n = m, the
  queries at 0..n-1, padding allowed, no segments or window) with keys
  beyond lag k (0 < k < n); else why not."""
  rules = masks.rules_of(mask)
  if rules is None or not rules.causal or rules.window is not None or rules.segments is not None:
    return 'it takes the causal rule with padding only'
  if not (type(q_offset) is int and q_offset == 0 and n == m):
    return 'it takes self-attention with the queries at 0..n-1 (no decoding offset)'
  table = next((t for t in tables.values() if t is not None), None)
  k = 0 if table is None else (table.shape[0] - 1) // 2
  if not 0 < k < n:
    return f'clipping distance {k}: it needs 0 < k < n = {n}'
  return None

