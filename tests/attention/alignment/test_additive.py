"""Bahdanau and Luong-concat attention against python loops.

`_loop` computes each score with `math.tanh`, one (batch, head, query, key)
at a time, then a softmax over the visible keys (uniform over all keys when
none is visible, softmax_weights' rule) and the weighted sum of the values.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.alignment import additive


def _qkv(seed, b=2, n=3, m=5, h=2, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


def _loop(score, v, shape, mask=None, bias=None):
  b, h, n, m = shape
  mask = np.ones(shape, bool) if mask is None else np.broadcast_to(mask, shape)
  bias = np.zeros(shape) if bias is None else np.broadcast_to(bias, shape)
  out, weights = np.zeros((b, n, h, v.shape[-1])), np.zeros(shape)
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        visible = [j for j in range(m) if mask[bi, hi, i, j]]
        if not visible:
          weights[bi, hi, i] = 1 / m
        else:
          logits = [score(bi, hi, i, j) + float(bias[bi, hi, i, j]) for j in visible]
          exps = [math.exp(x - max(logits)) for x in logits]
          for j, e in zip(visible, exps):
            weights[bi, hi, i, j] = e / sum(exps)
        for j in range(m):
          out[bi, i, hi] += weights[bi, hi, i, j] * v[bi, j, hi].astype(np.float64)
  return out, weights


def _bahdanau_score(q, k, v_h):
  d = q.shape[-1]
  return lambda b, h, i, j: sum(float(v_h[h, x]) * math.tanh(float(q[b, i, h, x])
                                                              + float(k[b, j, h, x]))
                                for x in range(d))


def _concat_score(q, k, wq, wk, v_h):
  d = q.shape[-1]

  def score(b, h, i, j):
    total = 0.0
    for y in range(d):
      pre = sum(float(wq[h, x, y]) * float(q[b, i, h, x]) + float(wk[h, x, y]) * float(k[b, j, h, x])
                for x in range(d))
      total += float(v_h[h, y]) * math.tanh(pre)
    return total
  return score


def _masks(b, n, m):
  padding = (np.arange(m)[None] < np.array([m, 2])[:, None])[:, None, None]  # [b, 1, 1, m]
  rand = np.random.default_rng(3).random((b, 1, n, m)) < 0.5
  rand[0, 0, 0] = False  # one fully masked row
  return {'none': None, 'padding': padding, 'random': rand}


_bahdanau = jax.jit(additive.bahdanau_attention, static_argnames='return_weights')
_concat = jax.jit(additive.luong_concat_attention, static_argnames='return_weights')


@pytest.mark.parametrize('mask_name', ['none', 'padding', 'random'])
@pytest.mark.parametrize('n,m', [(3, 5), (1, 4), (4, 2)])
def test_bahdanau_matches_loop(mask_name, n, m):
  q, k, v = _qkv(0, n=n, m=m)
  v_h = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
  bias = np.random.default_rng(2).normal(size=(2, 1, n, m)).astype(np.float32)
  mask = _masks(2, n, m)[mask_name]
  got, weights = _bahdanau(q, k, v, v_h, mask=None if mask is None else jnp.asarray(mask),
                           bias=bias, return_weights=True)
  want, want_w = _loop(_bahdanau_score(q, k, v_h), v, (2, 2, n, m), mask, bias)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('mask_name', ['none', 'padding', 'random'])
@pytest.mark.parametrize('n,m', [(3, 5), (1, 4)])
def test_luong_concat_matches_loop(mask_name, n, m):
  q, k, v = _qkv(4, n=n, m=m)
  rng = np.random.default_rng(5)
  wq, wk = (rng.normal(size=(2, 4, 4)).astype(np.float32) * 0.5 for _ in range(2))
  v_h = rng.normal(size=(2, 4)).astype(np.float32)
  mask = _masks(2, n, m)[mask_name]
  got, weights = _concat(q, k, v, wq, wk, v_h, mask=None if mask is None else jnp.asarray(mask),
                         return_weights=True)
  want, want_w = _loop(_concat_score(q, k, wq, wk, v_h), v, (2, 2, n, m), mask)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_concat_with_identity_matrices_is_bahdanau():
  q, k, v = _qkv(6)
  v_h = np.random.default_rng(7).normal(size=(2, 4)).astype(np.float32)
  eye = np.stack([np.eye(4, dtype=np.float32)] * 2)
  np.testing.assert_allclose(np.asarray(_concat(q, k, v, eye, eye, v_h)),
                             np.asarray(_bahdanau(q, k, v, v_h)), atol=1e-6)


def test_masked_keys_get_no_weight_and_fully_masked_rows_are_uniform():
  q, k, v = _qkv(8, n=3, m=5)
  mask = _masks(2, 3, 5)['random']
  v_h = np.ones((2, 4), np.float32) * 3  # large logits
  _, weights = _bahdanau(q * 10, k, v, v_h, mask=jnp.asarray(mask), return_weights=True)
  weights = np.asarray(weights)
  assert np.all(np.isfinite(weights))
  hidden = ~np.broadcast_to(mask, weights.shape)
  hidden[0, :, 0] = False  # the fully masked row: uniform by rule
  assert np.all(weights[hidden] == 0)
  np.testing.assert_allclose(weights[0, :, 0], 0.2)


def test_bfloat16_inputs_give_bfloat16_close_to_float32():
  q, k, v = _qkv(11)
  v_h = np.random.default_rng(12).normal(size=(2, 4)).astype(np.float32)
  want = _bahdanau(q, k, v, v_h)
  got = _bahdanau(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), v_h)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05)


def test_params_shapes_and_scale():
  kwargs = registry.resolve_kwargs('bahdanau', None)
  assert kwargs == {}
  shape, init, _ = registry.get('bahdanau').params(3, 64, kwargs)['additive_v']
  assert shape == (3, 64)
  assert abs(float(jnp.std(init(jax.random.PRNGKey(0), shape))) - 64 ** -0.5) < 0.02
  params = registry.get('luong_concat').params(3, 64, {})
  assert {name: s for name, (s, _, _) in params.items()} == {
      'concat_wq': (3, 64, 64), 'concat_wk': (3, 64, 64), 'concat_v': (3, 64)}
  shape, init, _ = params['concat_wq']
  # lecun per head: fan-in d, not h * d.
  assert abs(float(jnp.std(init(jax.random.PRNGKey(1), shape))) - 64 ** -0.5) < 0.01
