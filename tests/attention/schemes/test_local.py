"""Sliding-window attention: the window by hand; the dense kernel and the
blocked one (local_blocked) against a python loop and each other.

`_loop` lists each query's window from its absolute position with python
ints, then softmax(q.k/sqrt(d) + bias) over the window's visible keys in
python floats (uniform over the window when none is visible).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import entry, registry
from flaxformer_lite.attention.schemes import local
from flaxformer_lite.layers import MultiHeadAttention


def _qkv(seed, b=2, n=12, m=12, h=2, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


def _window(p, m, window, causal):
  if causal:
    return [j for j in range(m) if p - window < j <= p]
  return [j for j in range(m) if abs(j - p) < window]


def _loop(q, k, v, window, causal, q_offset=0, mask=None, bias=None):
  b, n, h, d = q.shape
  m = k.shape[1]
  mask = np.ones((b, h, n, m), bool) if mask is None else np.broadcast_to(mask, (b, h, n, m))
  bias = np.zeros((b, h, n, m)) if bias is None else np.broadcast_to(bias, (b, h, n, m))
  out, weights = np.zeros((b, n, h, d)), np.zeros((b, h, n, m))
  for bi, hi, i in np.ndindex(b, h, n):
    keys = _window(q_offset + i, m, window, causal)
    visible = [j for j in keys if mask[bi, hi, i, j]]
    if visible:
      logits = [sum(float(q[bi, i, hi, x]) * float(k[bi, j, hi, x]) for x in range(d))
                / math.sqrt(d) + float(bias[bi, hi, i, j]) for j in visible]
      exps = [math.exp(x - max(logits)) for x in logits]
      row = {j: e / sum(exps) for j, e in zip(visible, exps)}
    else:
      row = {j: 1 / len(keys) for j in keys}
    for j, w in row.items():
      weights[bi, hi, i, j] = w
      out[bi, i, hi] += w * v[bi, j, hi]
  return out, weights


def test_window_convention_by_hand():
  assert _window(5, 12, 3, True) == [3, 4, 5]
  assert _window(5, 12, 3, False) == [3, 4, 5, 6, 7]
  assert _window(1, 12, 3, True) == [0, 1]
  in_window = np.asarray(local.band(jnp.arange(4)[:, None], jnp.arange(4)[None], 2, True))
  np.testing.assert_array_equal(in_window, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0],
                                            [0, 0, 1, 1]])
  in_window = np.asarray(local.band(jnp.arange(4)[:, None], jnp.arange(4)[None], 2, False))
  np.testing.assert_array_equal(in_window, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1],
                                            [0, 0, 1, 1]])


def _masks(b, h, n, m):
  rng = np.random.default_rng(20)
  padding = np.arange(m)[None] < np.array([m, m - 3])[:, None]  # [b, m]
  full = padding[:, None, None, :] & padding[:, None, :, None]  # padding queries fully masked
  heads = rng.random((1, h, n, m)) < 0.6
  return {'keys': padding[:, None, None, :], 'full': full, 'heads': heads,
          'rank2': rng.random((n, m)) < 0.6}


_attention = jax.jit(local.local_attention,
                     static_argnames=('window', 'causal', 'return_weights'))
_plain = jax.jit(lambda *a, **kw: local.local_attention(*a, return_weights=True, **kw)[0],
                 static_argnames=('window', 'causal'))


def _on(kernel, q, k, v, *, window, causal, mask=None, bias=None):
  """local through attend on `kernel` ('dense', 'local_blocked')."""
  return entry.attend(q, k, v, scheme='local', kernel=kernel, mask=mask, bias=bias,
                      options={'window': window, 'causal': causal})


def test_auto_takes_the_blocked_kernel_only_where_it_pays():
  """select.LOCAL_BLOCKED_MIN_RATIO: m = 8 keys against a context of 2 or
  3 windows of 2 (4 or 6 keys): blocked where m >= 2x the context (causal),
  dense where not, and dense where the lengths do not fit the blocks."""
  def plan(n, causal):
    x = jax.ShapeDtypeStruct((2, n, 2, 4), jnp.float32)
    return entry.plan(x, x, scheme='local', options={'window': 2, 'causal': causal}).kernel.name
  assert plan(8, causal=True) == 'local_blocked'
  assert plan(8, causal=False) == 'dense'
  assert plan(9, causal=True) == 'dense'


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('mask_name', ['keys', 'full', 'heads', 'rank2'])
def test_blocked_equals_plain_equals_loop(causal, mask_name):
  q, k, v = _qkv(0, n=8, m=8)
  mask = jnp.asarray(_masks(2, 2, 8, 8)[mask_name])
  bias = np.random.default_rng(1).normal(size=(1, 2, 8, 8)).astype(np.float32)
  plain = _plain(q, k, v, window=2, causal=causal, mask=mask, bias=bias)
  blocked = jax.jit(functools.partial(_on, 'local_blocked', window=2, causal=causal))(
      q, k, v, mask=mask, bias=bias)
  want, _ = _loop(q, k, v, 2, causal, mask=mask, bias=bias)
  np.testing.assert_allclose(np.asarray(plain), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(blocked), np.asarray(plain), atol=1e-6)


@pytest.mark.parametrize('causal', [True, False])
def test_blocked_without_mask_with_key_padding_bias(causal):
  q, k, v = _qkv(2, n=8, m=8)
  bias = np.random.default_rng(3).normal(size=(2, 1, 1, 8)).astype(np.float32)
  got = jax.jit(functools.partial(_on, 'local_blocked', window=2, causal=causal))(
      q, k, v, bias=bias)
  want, _ = _loop(q, k, v, 2, causal, bias=bias)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('n,m,q_offset,window', [(5, 7, 0, 2), (3, 9, 4, 3), (1, 9, 8, 4),
                                                 (7, 7, 0, 7), (4, 3, 0, 1)])
def test_plain_form_matches_loop(causal, n, m, q_offset, window):
  q, k, v = _qkv(4, n=n, m=m)
  mask = np.random.default_rng(5).random((2, 1, n, m)) < 0.7
  out, weights = _attention(q, k, v, window=window, causal=causal, q_offset=q_offset,
                            mask=jnp.asarray(mask), return_weights=True)
  want, want_w = _loop(q, k, v, window, causal, q_offset, mask)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_uniform_over_the_window_in_both_forms():
  q, k, v = _qkv(6)
  mask = np.ones((2, 1, 12, 12), bool)
  mask[0, 0, 7] = False
  mask[1, 0, 0] = False
  blocked = np.asarray(_attention(q, k, v, window=3, causal=True, mask=jnp.asarray(mask)))
  out, weights = _attention(q, k, v, window=3, causal=True, mask=jnp.asarray(mask),
                            return_weights=True)
  np.testing.assert_allclose(np.asarray(weights)[0, :, 7], [[0] * 5 + [1 / 3] * 3 + [0] * 4] * 2)
  np.testing.assert_allclose(np.asarray(weights)[1, :, 0], [[1] + [0] * 11] * 2)
  np.testing.assert_allclose(blocked, np.asarray(out), atol=1e-6)
  assert np.all(np.isfinite(blocked))


def test_decoding_rows_equal_full_causal_pass():
  n = 12
  q, k, v = _qkv(7, n=n, m=n)
  causal = np.tril(np.ones((n, n), bool))[None, None]
  full = _attention(q, k, v, window=3, causal=True)  # blocked
  for t, size in [(0, 1), (4, 3), (11, 1)]:
    # The cached step sees causal=False's window and-ed with the causal mask.
    got = _attention(q[:, t:t + size], k, v, window=3, causal=False, q_offset=jnp.int32(t),
                     mask=causal[:, :, t:t + size])
    np.testing.assert_allclose(np.asarray(got), np.asarray(full[:, t:t + size]), atol=1e-6)


@pytest.mark.parametrize('causal', [True, False])
def test_gradients_finite_in_both_forms(causal):
  q, k, v = _qkv(8)
  mask = jnp.asarray(_masks(2, 2, 12, 12)['full'])
  for return_weights in (False, True):  # blocked, plain
    def loss(q, k, v):
      out = local.local_attention(q, k, v, window=3, causal=causal, mask=mask,
                                  return_weights=return_weights)
      return jnp.sum((out[0] if return_weights else out) ** 2)
    for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
      assert np.all(np.isfinite(np.asarray(g))) and np.abs(np.asarray(g)).max() > 0


def test_bfloat16_close_to_float32_in_both_forms():
  q, k, v = _qkv(9)
  for return_weights in (False, True):
    want = _attention(q, k, v, window=3, return_weights=return_weights)
    got = _attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), window=3,
                     return_weights=return_weights)
    if return_weights:
      want, got = want[0], got[0]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05)


def test_layer_cached_decode_matches_full_pass():
  b, n, f = 2, 6, 8
  x = jnp.asarray(np.random.default_rng(10).normal(size=(b, n, f)).astype(np.float32))
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]
  decoder = MultiHeadAttention(num_heads=2, attention='local', decode=True,
                               attention_kwargs={'window': 2})
  variables = jax.jit(decoder.init)(jax.random.PRNGKey(0), x)
  params, cache = variables['params'], variables['cache']
  want = jax.jit(decoder.clone(decode=False).apply)({'params': params}, x, mask=causal)
  step = jax.jit(lambda variables, x: decoder.apply(variables, x, mutable=['cache']))
  got, mutated = step({'params': params, 'cache': cache}, x[:, :3])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, :3]), atol=1e-5)
  for t in range(3, n):
    got, mutated = step({'params': params, 'cache': mutated['cache']}, x[:, t:t + 1])
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, t]), atol=1e-5)


def test_registered():
  variant = registry.get('local')
  assert dict(variant.kwargs) == {'window': 8, 'causal': False} and variant.uses_positions
  assert registry.resolve_kwargs('local', {'window': 4, 'causal': False}) == {
      'window': 4, 'causal': False}


@pytest.mark.parametrize('given,option', [
    ({'window': 0}, 'window'), ({'window': 2.0}, 'window'), ({'causal': 'yes'}, 'causal'),
    ({'temperature': 1.0}, 'temperature')])
def test_bad_kwargs_raise_naming_option(given, option):
  with pytest.raises(ValueError, match=option):
    registry.resolve_kwargs('local', given)
