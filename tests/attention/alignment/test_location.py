"""Location-sensitive attention: the convolution by hand, the attention against python loops.

`_loop_features` slides the filter over the alignment with explicit zero
padding; `_loop` builds each score v . tanh(q + k + U f + b) feature by
feature with `math.tanh` and takes the softmax over the visible keys.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.alignment import additive, location


def test_three_tap_filter_by_hand():
  # f[j] = 1*a[j-1] + 2*a[j] + 3*a[j+1] (zeros beyond the ends), and a filter
  # (0, 0, 1) that reads the next key: f[j] = a[j+1].
  a = jnp.asarray([0.0, 0.0, 1.0, 0.0, 0.5]).reshape(1, 1, 1, 5)
  filters = jnp.asarray([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0]])  # [K=3, C=2]
  f = np.asarray(location.location_features(a, filters))
  assert f.shape == (1, 1, 1, 5, 2)
  np.testing.assert_allclose(f[0, 0, 0, :, 0], [0.0, 3.0, 2.0, 2.5, 1.0])
  np.testing.assert_allclose(f[0, 0, 0, :, 1], [0.0, 1.0, 0.0, 0.5, 0.0])


def test_one_tap_filter_scales():
  a = jnp.asarray(np.random.default_rng(0).random((2, 2, 3, 4)), jnp.float32)
  f = location.location_features(a, jnp.asarray([[2.0, -1.0]]))
  np.testing.assert_allclose(np.asarray(f), np.stack([2 * a, -a], -1), rtol=1e-6)


def _loop_features(a, filters):
  b, h, n, m = a.shape
  kernel, channels = filters.shape
  half = (kernel - 1) // 2
  f = np.zeros((b, h, n, m, channels))
  for idx in np.ndindex(b, h, n):
    for j in range(m):
      for c in range(channels):
        for t in range(kernel):
          src = j + t - half
          if 0 <= src < m:
            f[idx + (j, c)] += float(filters[t, c]) * float(a[idx + (src,)])
  return f


def test_five_tap_filters_match_loop():
  rng = np.random.default_rng(1)
  a = rng.random((2, 2, 3, 7)).astype(np.float32)
  filters = rng.normal(size=(5, 3)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(location.location_features(a, filters)),
                             _loop_features(a, filters), atol=1e-5)


def _loop(q, k, v, p, prev, mode, mask):
  b, n, h, d = q.shape
  m = k.shape[1]
  feats = _loop_features(prev, p['location_filters'])
  mask = np.broadcast_to(mask, (b, h, n, m))
  out = np.zeros((b, n, h, d))
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        logits = {}
        for j in range(m):
          if not mask[bi, hi, i, j]:
            continue
          total = 0.0
          for x in range(d):
            pre = float(q[bi, i, hi, x]) + float(p['location_b'][hi, x])
            if mode != 'location_only':
              pre += float(k[bi, j, hi, x])
            if mode != 'content_only':
              pre += sum(float(p['location_u'][hi, c, x]) * feats[bi, hi, i, j, c]
                         for c in range(feats.shape[-1]))
            total += float(p['location_v'][hi, x]) * math.tanh(pre)
          logits[j] = total
        top = max(logits.values())
        z = sum(math.exp(x - top) for x in logits.values())
        for j, x in logits.items():
          out[bi, i, hi] += math.exp(x - top) / z * v[bi, j, hi]
  return out


def _inputs(seed, b=2, n=2, m=6, h=2, d=3, kernel=3, channels=2):
  rng = np.random.default_rng(seed)
  f32 = lambda *s: rng.normal(size=s).astype(np.float32)
  q, k, v = f32(b, n, h, d), f32(b, m, h, d), f32(b, m, h, d)
  params = {'location_v': f32(h, d), 'location_b': f32(h, d) * 0.3,
            'location_filters': f32(kernel, channels), 'location_u': f32(h, channels, d)}
  prev = rng.random((b, h, n, m)).astype(np.float32) * 2
  return q, k, v, params, prev


_attention = jax.jit(location.location_sensitive_attention,
                     static_argnames=('location_mode', 'return_weights', 'dtype'))


@pytest.mark.parametrize('mode', location.MODES)
@pytest.mark.parametrize('n', [1, 3])
def test_attention_matches_loop(mode, n):
  q, k, v, params, prev = _inputs(2, n=n)
  mask = (np.arange(6)[None] < np.array([[6], [4]]))[:, None, None]  # [b, 1, 1, m]
  got = _attention(q, k, v, **params, prev_alignment=prev, location_mode=mode,
                   mask=jnp.asarray(mask))
  want = _loop(q, k, v, params, prev, mode, mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_content_only_is_bahdanau_and_ignores_the_alignment():
  q, k, v, params, prev = _inputs(3)
  params['location_b'] = np.zeros_like(params['location_b'])
  got = _attention(q, k, v, params['location_v'], params['location_b'], prev_alignment=prev,
                   location_mode='content_only')
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(additive.bahdanau_attention(q, k, v,
                                                                    params['location_v'])),
                             atol=1e-6)


@pytest.mark.parametrize('mode', ['hybrid', 'location_only'])
def test_the_alignment_moves_the_weights(mode):
  q, k, v, params, prev = _inputs(4)
  run = lambda a: np.asarray(_attention(q, k, v, **params, prev_alignment=a,
                                        location_mode=mode, return_weights=True)[1])
  assert np.abs(run(prev) - run(np.zeros_like(prev))).max() > 1e-3


def test_bfloat16_close_to_float32():
  q, k, v, params, prev = _inputs(6)
  want = _attention(q, k, v, **params, prev_alignment=prev)
  got = _attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), **params,
                   prev_alignment=prev, dtype=jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05)


def test_registered_params_follow_the_options():
  variant = registry.get('location_sensitive')
  assert variant.models == ('rnn_seq2seq',) and variant.uses_alignment
  kwargs = registry.resolve_kwargs('location_sensitive', {'location_kernel': 5})
  assert kwargs == {'location_channels': 32, 'location_kernel': 5, 'location_mode': 'hybrid'}
  shapes = {name: s for name, (s, _, _) in variant.params(2, 8, kwargs).items()}
  assert shapes == {'location_v': (2, 8), 'location_b': (2, 8), 'location_filters': (5, 32),
                    'location_u': (2, 32, 8)}
  content = registry.resolve_kwargs('location_sensitive', {'location_mode': 'content_only'})
  assert set(variant.params(2, 8, content)) == {'location_v', 'location_b'}


@pytest.mark.parametrize('given,option', [
    ({'location_kernel': 4}, 'location_kernel'), ({'location_kernel': 0}, 'location_kernel'),
    ({'location_channels': 0}, 'location_channels'),
    ({'location_channels': 2.0}, 'location_channels'),
    ({'location_mode': 'both'}, 'location_mode'), ({'window': 3}, 'window')])
def test_bad_kwargs_raise_naming_option(given, option):
  with pytest.raises(ValueError, match=option):
    registry.resolve_kwargs('location_sensitive', given)
