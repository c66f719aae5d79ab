"""RoPE against a scalar rotation loop, and its relative-position property.

`_loop_rotate` turns each feature pair (x[2i], x[2i+1]) by pos * w^(-2i/d)
with `math.cos`/`math.sin`; `loop_attention` (tests/attention/conftest.py) walks batch, head, query and
key in python floats.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.attention import rotary
from flaxformer_lite.layers import MultiHeadAttention


def _loop_rotate(x, positions, max_wavelength=10000.0):
  b, n, h, d = x.shape
  out = np.zeros((b, n, h, d))
  for bi in range(b):
    for r in range(n):
      for hi in range(h):
        for i in range(d // 2):
          angle = positions[r] * max_wavelength ** (-2 * i / d)
          x0, x1 = float(x[bi, r, hi, 2 * i]), float(x[bi, r, hi, 2 * i + 1])
          out[bi, r, hi, 2 * i] = x0 * math.cos(angle) - x1 * math.sin(angle)
          out[bi, r, hi, 2 * i + 1] = x0 * math.sin(angle) + x1 * math.cos(angle)
  return out


def _qkv(seed, b=2, n=4, m=4, h=2, d=6):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32) * 2,
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


_rotate = jax.jit(rotary.apply_rotary)
_attention = jax.jit(rotary.rotary_attention)

# ---- rotation ------------------------------------------------------------------


@pytest.mark.parametrize('positions,max_wavelength', [
    ([0, 1, 2, 3], 10000.0), ([7, 3, 40, 0], 10000.0), ([5, 6, 7, 8], 10.0)])
def test_rotation_matches_loop(positions, max_wavelength):
  x = _qkv(0, d=8)[0]
  got = _rotate(jnp.asarray(x), jnp.asarray(positions), max_wavelength=max_wavelength)
  assert got.shape == x.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _loop_rotate(x, positions, max_wavelength),
                             atol=1e-5)


def test_position_zero_is_identity_and_norm_is_preserved():
  x = _qkv(1, d=8)[0]
  got = np.asarray(_rotate(jnp.asarray(x), jnp.asarray([0, 9, 100, 2047])))
  np.testing.assert_allclose(got[:, 0], x[:, 0], atol=1e-6)
  pair_norms = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])
  np.testing.assert_allclose(pair_norms(got), pair_norms(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('shift', [1, 13, 500])
def test_scores_depend_only_on_offset(shift):
  q, k, _ = _qkv(2, n=4, m=4, d=8)
  q_pos, k_pos = np.array([0, 3, 5, 9]), np.array([2, 0, 7, 4])
  scores = lambda qp, kp: np.einsum(
      'bnhd,bmhd->bhnm', np.asarray(_rotate(jnp.asarray(q), jnp.asarray(qp))),
      np.asarray(_rotate(jnp.asarray(k), jnp.asarray(kp))))
  base = scores(q_pos, k_pos)
  np.testing.assert_allclose(scores(q_pos + shift, k_pos + shift), base, atol=2e-4)
  # ...and do depend on it.
  assert not np.allclose(scores(q_pos + shift, k_pos), base, atol=1e-2)


def test_odd_head_dim_raises_naming_it():
  with pytest.raises(ValueError, match='d=5'):
    rotary.apply_rotary(jnp.zeros((1, 2, 1, 5)), jnp.arange(2))


# ---- attention -----------------------------------------------------------------


@pytest.mark.parametrize('n,m,q_offset,max_wavelength', [
    (4, 4, 0, 10000.0), (2, 5, 3, 10000.0), (3, 2, 0, 100.0), (2, 3, 6, 100.0)])
def test_attention_matches_loop(n, m, q_offset, max_wavelength, loop_attention):
  q, k, v = _qkv(3, n=n, m=m)
  extra = np.random.default_rng(4).normal(size=(1, 2, n, m)).astype(np.float32)
  mask = np.random.default_rng(5).random((2, 1, n, m)) < 0.7
  mask[..., 0] = True
  got = _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask),
                   bias=jnp.asarray(extra), q_offset=q_offset, max_wavelength=max_wavelength)
  q_rot = _loop_rotate(q, [q_offset + i for i in range(n)], max_wavelength)
  k_rot = _loop_rotate(k, list(range(m)), max_wavelength)
  want = loop_attention(q_rot, k_rot, v, lambda h, i, j: extra[0, h, i, j], mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_decoding_rows_equal_full_causal_pass():
  # The cached decoder's call: keys 0..n-1, queries t.. at q_offset=t (traced).
  n = 5
  q, k, v = (jnp.asarray(x) for x in _qkv(6, n=n, m=n))
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]
  full = _attention(q, k, v, mask=causal, q_offset=0)
  for t, size in [(0, 1), (1, 1), (2, 3), (4, 1)]:
    got = _attention(q[:, t:t + size], k, v, mask=causal[:, :, t:t + size], q_offset=t)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full[:, t:t + size]),
                               atol=1e-6, err_msg=f'rows {t}..{t + size - 1}')


# ---- registry and layer ---------------------------------------------------------


def test_registered_with_defaults():
  assert 'rotary' in registry.names()
  variant = registry.get('rotary')
  assert variant.fn is rotary.rotary_attention
  assert dict(variant.kwargs) == {'max_wavelength': 10000.0}
  assert variant.params is None
  assert variant.uses_positions
  assert registry.resolve_kwargs('rotary', {'max_wavelength': None}) == {
      'max_wavelength': 10000.0}
  assert registry.resolve_kwargs('rotary', {'max_wavelength': 500.0}) == {
      'max_wavelength': 500.0}


@pytest.mark.parametrize('given,option', [
    ({'max_wavelength': 0.0}, 'max_wavelength'), ({'max_wavelength': -1.0}, 'max_wavelength'),
    ({'max_wavelength': 'big'}, 'max_wavelength'), ({'num_buckets': 8}, 'num_buckets')])
def test_bad_kwargs_raise_naming_option(given, option):
  with pytest.raises(ValueError, match=option):
    registry.resolve_kwargs('rotary', given)


def test_layer_forward_and_cached_decode():
  b, n, f = 2, 5, 6
  x = jnp.asarray(np.random.default_rng(7).normal(size=(b, n, f)).astype(np.float32))
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]
  decoder = MultiHeadAttention(num_heads=2, qkv_features=8, attention='rotary',
                               attention_kwargs={'max_wavelength': 100.0}, decode=True)
  variables = jax.jit(decoder.init)(jax.random.PRNGKey(0), x)
  params, cache = variables['params'], variables['cache']
  want = jax.jit(decoder.clone(decode=False).apply)({'params': params}, x, mask=causal)
  assert want.shape == (b, n, f)

  step = jax.jit(functools.partial(decoder.apply, mutable=['cache']))
  got, mutated = step({'params': params, 'cache': cache}, x[:, :3])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, :3]), atol=1e-5)
  for t in range(3, n):
    got, mutated = step({'params': params, 'cache': mutated['cache']}, x[:, t:t + 1])
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, t]), atol=1e-5,
                               err_msg=f'position {t}')
