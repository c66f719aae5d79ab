"""Luong et al. 2015's scores and local attention against python loops; every
classic variant (this file and additive, location, hard, local) in the layer.

`_loop` walks batch, head, query and key in python floats: a score per
(b, h, i, j), softmax over the visible keys of the query's window (uniform
over the window when none is visible, over all keys without a window), then
an optional factor per key. Scores, window positions and S are written out
with `math` per element.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.alignment import luong
from flaxformer_lite.layers import MultiHeadAttention


def _qkv(seed, b=2, n=4, m=5, h=2, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


def _loop(q, k, v, score, mask=None, in_window=None, factor=None):
  """Returns out [b, n, h, d], weights [b, h, n, m] (float64)."""
  b, n, h, _ = q.shape
  m = k.shape[1]
  mask = np.ones((b, h, n, m), bool) if mask is None else np.broadcast_to(mask, (b, h, n, m))
  out, weights = np.zeros(q.shape[:3] + v.shape[3:]), np.zeros((b, h, n, m))
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        window = [j for j in range(m) if in_window is None or in_window(bi, hi, i, j)]
        visible = [j for j in window if mask[bi, hi, i, j]]
        if visible:
          logits = {j: score(bi, hi, i, j) for j in visible}
          top = max(logits.values())
          exps = {j: math.exp(x - top) for j, x in logits.items()}
          row = {j: e / sum(exps.values()) for j, e in exps.items()}
        else:
          row = {j: 1 / len(window) for j in window}
        for j, w in row.items():
          if factor is not None:
            w *= factor(bi, hi, i, j)
          weights[bi, hi, i, j] = w
          out[bi, i, hi] += w * v[bi, j, hi].astype(np.float64)
  return out, weights


def _dot(a, c):
  return sum(float(x) * float(y) for x, y in zip(a, c))


def _general(q, k, w):
  """q_i^T W_h k_j, element by element."""
  d = q.shape[-1]
  return lambda b, h, i, j: sum(float(q[b, i, h, x]) * float(w[h, x, y]) * float(k[b, j, h, y])
                                for x in range(d) for y in range(d))


def _masks(b, n, m):
  rng = np.random.default_rng(11)
  lengths = np.array([m, max(1, m - 2)])[:b]
  padding = (np.arange(m)[None] < lengths[:, None])[:, None, None]  # [b, 1, 1, m]
  random = rng.random((b, 2, n, m)) < 0.6
  random[..., 0] = True
  return {'none': None, 'padding': padding, 'random': random}


_dot_attention = jax.jit(luong.luong_dot_attention, static_argnames='return_weights')
_general_attention = jax.jit(luong.luong_general_attention, static_argnames='return_weights')
_local_p = jax.jit(luong.luong_local_p_attention,
                   static_argnames=('half_window', 'return_weights'))
_local_m = jax.jit(luong.luong_local_m_attention,
                   static_argnames=('half_window', 'return_weights'))

# ---- dot and general -------------------------------------------------------------


@pytest.mark.parametrize('mask_name', ['none', 'padding', 'random'])
@pytest.mark.parametrize('n,m', [(4, 5), (1, 3)])
def test_dot_and_general_match_loop(mask_name, n, m):
  q, k, v = _qkv(0, n=n, m=m)
  w = np.random.default_rng(1).normal(size=(2, 4, 4)).astype(np.float32) * 0.5
  bias = np.random.default_rng(2).normal(size=(1, 2, n, m)).astype(np.float32)
  mask = _masks(2, n, m)[mask_name]
  jmask = None if mask is None else jnp.asarray(mask)
  with_bias = lambda f: lambda b, h, i, j: f(b, h, i, j) + float(bias[0, h, i, j])

  got, weights = _dot_attention(q, k, v, mask=jmask, bias=bias, return_weights=True)
  want, want_w = _loop(q, k, v, with_bias(lambda b, h, i, j: _dot(q[b, i, h], k[b, j, h])),
                       mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)

  got, weights = _general_attention(q, k, v, w, mask=jmask, bias=bias, return_weights=True)
  want, want_w = _loop(q, k, v, with_bias(_general(q, k, w)), mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)


def test_dot_is_unscaled():
  # One visible pair of keys: the weight ratio is exp(q.k1 - q.k2), not exp((.)/sqrt(d)).
  q = np.zeros((1, 1, 1, 4), np.float32)
  q[..., 0] = 1.0
  k = np.zeros((1, 2, 1, 4), np.float32)
  k[0, 0, 0, 0] = 2.0
  _, weights = _dot_attention(q, k, k, return_weights=True)
  np.testing.assert_allclose(np.asarray(weights)[0, 0, 0], [1 / (1 + math.exp(-2)),
                                                             1 / (1 + math.exp(2))], rtol=1e-6)


def test_general_starts_as_identity_and_equals_dot():
  shape, init, _ = luong._general_params(2, 4, {})['general_w']
  w = init(jax.random.PRNGKey(0), shape)
  assert shape == (2, 4, 4)
  np.testing.assert_array_equal(np.asarray(w), np.stack([np.eye(4)] * 2))
  q, k, v = _qkv(3)
  np.testing.assert_allclose(np.asarray(_general_attention(q, k, v, w)),
                             np.asarray(_dot_attention(q, k, v)), atol=1e-6)


# ---- local-p ---------------------------------------------------------------------


def _local_p_loop(q, k, v, w, wp, vp, half_window, mask):
  b, n, h, d = q.shape
  m = k.shape[1]
  full = np.ones((b, h, n, m), bool) if mask is None else np.broadcast_to(mask, (b, h, n, m))

  def position(bi, hi, i):
    s = sum(bool(x) for x in full[bi, hi, i])
    hidden = [math.tanh(sum(float(q[bi, i, hi, x]) * float(wp[hi, x, y]) for x in range(d)))
              for y in range(d)]
    return s / (1 + math.exp(-sum(float(vp[hi, y]) * hidden[y] for y in range(d))))

  sigma = half_window / 2
  return _loop(q, k, v, _general(q, k, w), mask,
               in_window=lambda bi, hi, i, j: abs(j - position(bi, hi, i)) <= half_window,
               factor=lambda bi, hi, i, j: math.exp(-(j - position(bi, hi, i)) ** 2
                                                    / (2 * sigma ** 2)))


@pytest.mark.parametrize('mask_name,half_window', [('none', 1), ('padding', 2), ('random', 1),
                                                   ('causal', 2)])
def test_local_p_matches_loop(mask_name, half_window):
  n, m = 5, 9
  q, k, v = _qkv(4, n=n, m=m)
  rng = np.random.default_rng(5)
  w = rng.normal(size=(2, 4, 4)).astype(np.float32) * 0.5
  wp = rng.normal(size=(2, 4, 4)).astype(np.float32)
  vp = rng.normal(size=(2, 4)).astype(np.float32) * 3  # p spread over [0, S]
  mask = (np.tril(np.ones((n, m), bool), k=m - n)[None, None] if mask_name == 'causal'
          else _masks(2, n, m)[mask_name])
  got, weights = _local_p(q, k, v, w, wp, vp, half_window=half_window,
                          mask=None if mask is None else jnp.asarray(mask), return_weights=True)
  want, want_w = _local_p_loop(q, k, v, w, wp, vp, half_window, mask)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('length', [8, 6])
def test_local_p_window_and_gaussian_closed_form(length):
  # vp = 0: sigmoid(0) = 1/2, p = S/2 with S = length. Zero queries: equal scores,
  # 1/5 on each of the 2D+1 = 5 keys of the window, times exp(-(j-p)^2 / (2 (D/2)^2)).
  m, half_window = 8, 2
  p = length / 2
  q = np.zeros((1, 1, 1, 4), np.float32)
  k = np.random.default_rng(6).normal(size=(1, m, 1, 4)).astype(np.float32)
  mask = (np.arange(m) < length)[None, None, None]
  _, weights = _local_p(q, k, k, np.ones((1, 4, 4), np.float32), np.ones((1, 4, 4), np.float32),
                        np.zeros((1, 4), np.float32), half_window=half_window, mask=mask,
                        return_weights=True)
  want = np.zeros(m)
  for offset, gauss in [(-2, math.exp(-2)), (-1, math.exp(-0.5)), (0, 1.0),
                        (1, math.exp(-0.5)), (2, math.exp(-2))]:
    want[int(p) + offset] = 0.2 * gauss
  np.testing.assert_allclose(np.asarray(weights)[0, 0, 0], want, atol=1e-7)


def test_local_p_position_reaches_the_ends():
  # vp . tanh(.) -> +-inf: p -> S or 0, the window's centre follows.
  m, half_window = 10, 1
  q = np.ones((1, 1, 1, 2), np.float32)
  k = np.zeros((1, m, 1, 2), np.float32)
  eye = np.eye(2, dtype=np.float32)[None]
  for sign, keys in [(1.0, [9]), (-1.0, [0, 1])]:
    _, weights = _local_p(q, k, k, eye, eye * 10, np.full((1, 2), 50.0 * sign, np.float32),
                          half_window=half_window, return_weights=True)
    assert list(np.flatnonzero(np.asarray(weights)[0, 0, 0])) == keys


def test_local_p_position_gets_gradients():
  q, k, v = _qkv(7, n=3, m=8)
  rng = np.random.default_rng(8)
  w, wp = (rng.normal(size=(2, 4, 4)).astype(np.float32) for _ in range(2))
  vp = rng.normal(size=(2, 4)).astype(np.float32)
  grads = jax.grad(lambda wp, vp: jnp.sum(_local_p(q, k, v, w, wp, vp, half_window=2) ** 2),
                   argnums=(0, 1))(wp, vp)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g))) and np.abs(np.asarray(g)).max() > 1e-4


# ---- local-m ---------------------------------------------------------------------


def _local_m_loop(q, k, v, w, half_window, q_offset, mask):
  b, n, h, _ = q.shape
  m = k.shape[1]
  full = np.ones((b, h, n, m), bool) if mask is None else np.broadcast_to(mask, (b, h, n, m))
  position = lambda bi, hi, i: min(q_offset + i, max(int(full[bi, hi, i].sum()) - 1, 0))
  return _loop(q, k, v, _general(q, k, w), mask,
               in_window=lambda bi, hi, i, j: abs(j - position(bi, hi, i)) <= half_window)


@pytest.mark.parametrize('mask_name', ['none', 'padding', 'random'])
@pytest.mark.parametrize('n,m,q_offset,half_window',
                         [(4, 9, 0, 1), (2, 9, 5, 3), (3, 6, 7, 1)])
def test_local_m_matches_loop(mask_name, n, m, q_offset, half_window):
  q, k, v = _qkv(9, n=n, m=m)
  w = np.random.default_rng(10).normal(size=(2, 4, 4)).astype(np.float32) * 0.5
  mask = _masks(2, n, m)[mask_name]
  got, weights = _local_m(q, k, v, w, half_window=half_window, q_offset=q_offset,
                          mask=None if mask is None else jnp.asarray(mask), return_weights=True)
  want, want_w = _local_m_loop(q, k, v, w, half_window, q_offset, mask)
  np.testing.assert_allclose(np.asarray(weights), want_w, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_local_m_window_by_hand():
  # Equal scores: uniform over |j - p| <= 1 for p = 3, 4; p = 12 is clipped to
  # the last key 9, and p = 7 to the last unpadded key 5.
  q = np.zeros((1, 2, 1, 2), np.float32)
  k = np.zeros((1, 10, 1, 2), np.float32)
  eye = np.eye(2, dtype=np.float32)[None]
  rows = lambda **kw: np.asarray(_local_m(q, k, k, eye, half_window=1, return_weights=True,
                                          **kw)[1])[0, 0]
  np.testing.assert_allclose(rows(q_offset=3)[0], [0, 0, 1/3, 1/3, 1/3, 0, 0, 0, 0, 0])
  np.testing.assert_allclose(rows(q_offset=3)[1], [0, 0, 0, 1/3, 1/3, 1/3, 0, 0, 0, 0])
  np.testing.assert_allclose(rows(q_offset=12)[0], [0] * 8 + [0.5, 0.5])
  padded = rows(q_offset=7, mask=(np.arange(10) < 6)[None, None, None])[0]
  np.testing.assert_allclose(padded, [0, 0, 0, 0, 0.5, 0.5, 0, 0, 0, 0])


@pytest.mark.parametrize('name', ['luong_local_p', 'luong_local_m'])
@pytest.mark.parametrize('half_window', [0, -1, 2.0, True, '3'])
def test_bad_half_window_raises_naming_it(name, half_window):
  with pytest.raises(ValueError, match='half_window'):
    registry.resolve_kwargs(name, {'half_window': half_window})


# ---- every classic variant: registry and layer -------------------------------------

CLASSIC = ['bahdanau', 'luong_concat', 'luong_dot', 'luong_general', 'luong_local_p',
           'luong_local_m', 'location_sensitive', 'hard', 'local']


@pytest.mark.parametrize('name,models,flags', [
    ('bahdanau', registry.ALL_MODELS, ()),
    ('luong_concat', registry.ALL_MODELS, ()),
    ('luong_dot', registry.ALL_MODELS, ()),
    ('luong_general', registry.ALL_MODELS, ()),
    ('luong_local_p', registry.ALL_MODELS, ()),
    ('luong_local_m', registry.ALL_MODELS, ('uses_positions',)),
    ('location_sensitive', ('rnn_seq2seq',), ('uses_alignment',)),
    ('hard', registry.ALL_MODELS, ('stochastic',)),
    ('local', registry.TRANSFORMER_MODELS, ('uses_positions',)),
])
def test_models_and_flags(name, models, flags):
  variant = registry.get(name)
  assert variant.models == models
  for flag in ('uses_positions', 'stochastic', 'uses_alignment'):
    assert getattr(variant, flag) == (flag in flags), flag


def _layer_inputs(n=6):
  x = jnp.asarray(np.random.default_rng(14).normal(size=(2, n, 8)).astype(np.float32))
  valid = jnp.asarray(np.arange(n)[None] < np.array([[n], [n - 2]]))  # [2, n]
  mask = valid[:, None, None, :] & jnp.tril(jnp.ones((n, n), bool))[None, None]
  prev = jax.nn.softmax(jnp.asarray(np.random.default_rng(15).normal(size=(2, 2, n, n))), -1)
  return x, mask, prev * 2.0  # as if two earlier steps


def _apply(layer, variables, x, mask, prev, **kw):
  y, state = layer.apply(variables, x, mask=mask, prev_alignment=prev,
                         mutable=['intermediates'], **kw)
  return y, state['intermediates']['attention_weights'][0]


@pytest.mark.parametrize('name', CLASSIC)
def test_layer_runs_weights_respect_mask_and_rows_bfloat16_close(name):
  x, mask, prev = _layer_inputs()
  layer = MultiHeadAttention(num_heads=2, attention=name, sow_weights=True)
  variables = nn.unbox(layer.init(jax.random.PRNGKey(0), x))
  want, want_w = _apply(layer, variables, x, mask, prev)
  training = _apply(layer, variables, x, mask, prev, deterministic=False,
                    rngs={'dropout': jax.random.PRNGKey(1)})
  for y, weights in ((want, want_w), training):
    weights = np.asarray(weights)
    assert y.shape == x.shape and weights.shape == (2, 2, 6, 6)
    assert np.all(np.isfinite(np.asarray(y)))
    assert np.all(weights[~np.broadcast_to(np.asarray(mask), weights.shape)] == 0)
    sums = weights.sum(-1)
    if name == 'luong_local_p':  # the Gaussian is not renormalised
      assert np.all(sums <= 1 + 1e-6) and np.all(sums > 0.1)
    else:
      np.testing.assert_allclose(sums, 1.0, atol=1e-6)
    if name == 'hard':  # exactly one key per query
      assert set(np.unique(weights)) <= {0.0, 1.0}

  got, got_w = _apply(layer.clone(dtype=jnp.bfloat16), variables, x, mask, prev)
  assert got.dtype == jnp.bfloat16 and got_w.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  if name == 'hard':
    # An argmax may flip between near-equal logits: compare the rows that agree.
    same = np.all(np.asarray(got_w, np.float32) == np.asarray(want_w), axis=(1, 3))  # [b, n]
    assert same.mean() > 0.5
    np.testing.assert_allclose(np.asarray(got, np.float32)[same], np.asarray(want)[same],
                               atol=0.05, rtol=0.05)
  else:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want),
                               atol=0.05, rtol=0.05)
