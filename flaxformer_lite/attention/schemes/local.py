"""Sliding-window (local) self-attention for the Transformer.

Query i sits at absolute position p = q_offset + i, key j at position j.
  causal=True:  p sees the `window` keys p - window < j <= p (itself included).
  causal=False: p sees the 2*window - 1 keys |j - p| < window.
Inside the window the logits are dot_product's, q.k / sqrt(d) + bias.
The mask is and-ed with the window, so causal=False (the default) is right in every model
(decoders pass their causal mask); causal=True also makes an encoder causal,
and saves the blocked kernel (local_blocked) a third of its work in decoders.

Its dense form here is [b, h, n, m] logits under the band; the kernel
`local_blocked` (kernels/specialised/local_blocked.py) gives the same numbers
in O(n * window), and its terms (the plain product, the window as their
mask) run on the blockwise and fused kernels, which skip the blocks outside
the window; select.py picks among them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks, registry, scheme
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.attention.softmax import window_softmax


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
  out, weights = _plain(query, key, value, window=window, causal=causal, q_offset=q_offset,
                        mask=mask, bias=bias, dtype=dtype, dropout_rate=dropout_rate,
                        dropout_rng=dropout_rng, deterministic=deterministic)
  return (out, weights) if return_weights else out


def _window_mean(window, causal, value, tables, q_pos, k_pos):
  """Uniform weights over each query's window (window_softmax's rule for a
  query that sees none of its keys): the mean of the window's values by
  prefix sums over the keys that the n queries' windows can reach (n + 2
  windows of them, so a decoding step costs O(window), not O(cache)), keys
  at 0..m-1 -> [b, n, h, d] float32, zero for an empty window."""
  del tables
  m = k_pos.shape[0]
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


def _terms(num_heads, window=8, causal=False):
  """The plain product under the window (Terms.mask: every kernel that
  reads terms skips the blocks outside it), a query with no key in its
  window getting the window's mean value."""
  del num_heads
  return scheme.Terms(mask=masks.sliding_window(window, causal),
                      uniform=functools.partial(_window_mean, window, causal))


def local_chunked(query, key, value, *, window=8, causal=False, q_offset=0, mask=None,
                  chunk_size=None, dtype=None, **dropout):
  """local_attention block by block (the window a mask of its terms), so
  only the key blocks that meet a query block's window are computed,
  O(n * window). Blocks are at most max(32, 4 * window) wide: wider ones
  mostly compute pairs outside the window."""
  chunk_size = min(chunk_size or blockwise.DEFAULT_CHUNK_SIZE, max(32, 4 * window))
  return blockwise.dot_product(query, key, value, _terms(query.shape[2], window, causal),
                               mask=masks.as_mask(mask, q_offset), q_offset=q_offset,
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
    terms=_terms,
    chunked=local_chunked,
    options=LocalOptions,
    doc='sliding-window softmax(q.k/sqrt(d)): causal=True sees the window keys '
        'p-window < j <= p, causal=False |j-p| < window'))
