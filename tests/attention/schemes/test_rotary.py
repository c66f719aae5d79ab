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
from flaxformer_lite.attention import masks
from flaxformer_lite.attention.schemes import rotary
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


# ---- registry and layer ---------------------------------------------------------


def test_registered_with_defaults():
  assert 'rotary' in registry.names()
  variant = registry.get('rotary')
  assert variant.fn is rotary.rotary_attention
  defaults = {'max_wavelength': 10000.0, 'rope_scaling': 'none', 'rope_factor': 1.0,
              'rope_original_max_len': 0, 'rotary_fraction': 1.0, 'rotary_layout': 'interleaved'}
  assert dict(variant.kwargs) == defaults
  assert variant.params is None
  assert variant.uses_positions
  assert registry.resolve_kwargs('rotary', {'max_wavelength': None}) == defaults
  assert registry.resolve_kwargs('rotary', {'max_wavelength': 500.0}) == {
      **defaults, 'max_wavelength': 500.0}


@pytest.mark.parametrize('given,option', [
    ({'max_wavelength': 0.0}, 'max_wavelength'), ({'max_wavelength': -1.0}, 'max_wavelength'),
    ({'max_wavelength': 'big'}, 'max_wavelength'), ({'num_buckets': 8}, 'num_buckets'),
    ({'rope_scaling': 'dynamic'}, 'rope_scaling'), ({'rope_factor': 0.5}, 'rope_factor'),
    ({'rope_scaling': 'yarn', 'rope_factor': 4.0}, 'rope_original_max_len'),
    ({'rotary_fraction': 0.0}, 'rotary_fraction'), ({'rotary_fraction': 1.5}, 'rotary_fraction')])
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


# ---- context extension: each paper's formula ------------------------------------

def _paper_frequencies(d, scaling, s, L, base=10000.0):
  """theta_i pair by pair in python floats, as each paper writes it."""
  out = []
  for i in range(d // 2):
    if scaling == 'ntk':  # bloc97: base b * s^(d / (d - 2))
      out.append((base * s ** (d / (d - 2))) ** (-2 * i / d))
      continue
    theta = base ** (-2 * i / d)
    if scaling == 'linear':  # Chen et al. 2023: positions m / s
      theta /= s
    elif scaling == 'yarn':  # Peng et al. 2023, eq. 17-18: r = L / lambda, alpha 1, beta 32
      r = L / (2 * math.pi / theta)
      gamma = 0.0 if r < 1 else 1.0 if r > 32 else (r - 1) / 31
      theta = (1 - gamma) * theta / s + gamma * theta
    out.append(theta)
  return np.array(out)


@pytest.mark.parametrize('scaling', ['none', 'linear', 'ntk', 'yarn'])
def test_frequencies_follow_each_paper(scaling):
  d, s, L = 64, 4.0, 4096
  got = np.asarray(rotary.frequencies(d, scaling=scaling, factor=s, original_max_len=L))
  np.testing.assert_allclose(got, _paper_frequencies(d, scaling, s, L), rtol=1e-6)
  plain = _paper_frequencies(d, 'none', s, L)
  if scaling == 'ntk':  # the fastest pair is kept, the slowest interpolated by exactly s
    np.testing.assert_allclose([got[0], got[-1]], [1.0, plain[-1] / s], rtol=1e-6)
  if scaling == 'yarn':  # all three regimes occur at d=64, L=4096
    kept, squeezed = np.isclose(got, plain), np.isclose(got, plain / s)
    assert kept.any() and squeezed.any() and (~kept & ~squeezed).any()


def test_linear_scaling_is_position_interpolation():
  """Position Interpolation: position s * p rotates as p did unscaled."""
  x = jnp.asarray(_qkv(11, d=8)[0])
  p = jnp.arange(4) * 3 + 1
  got = rotary.apply_rotary(x, 2.5 * p, rope_scaling='linear', rope_factor=2.5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(rotary.apply_rotary(x, p)), atol=1e-5)


def test_yarn_temperature_scales_the_logits_by_its_square():
  """At equal positions the rotations cancel in q . k: only YaRN's sqrt(1/t) =
  0.1 ln s + 1 on q and on k is left."""
  q, k, _ = (jnp.asarray(x) for x in _qkv(12, d=8))
  pos = jnp.full((4,), 1000)
  rope = dict(rope_scaling='yarn', rope_factor=8.0, rope_original_max_len=512)
  logits = jnp.einsum('bnhd,bnhd->bnh', rotary.apply_rotary(q, pos, **rope),
                      rotary.apply_rotary(k, pos, **rope))
  want = (0.1 * math.log(8.0) + 1) ** 2 * np.einsum('bnhd,bnhd->bnh', q, k)
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)


def test_partial_rotary_turns_the_first_features_only():
  x = _qkv(13, d=10)[0]
  got = np.asarray(rotary.apply_rotary(jnp.asarray(x), jnp.arange(4) + 7, rotary_fraction=0.5))
  assert rotary.rotated_dims(10, 0.5) == 4  # an even count: 2 pairs of 10 features
  np.testing.assert_allclose(got[..., :4], _loop_rotate(x[..., :4], list(range(7, 11))), atol=1e-5)
  np.testing.assert_array_equal(got[..., 4:], x[..., 4:])


def test_scaled_rope_on_the_chunked_kernel_equals_dense():
  q, k, v = (jnp.asarray(x) for x in _qkv(14, n=9, m=9, d=8))
  rope = dict(max_wavelength=100.0, rope_scaling='yarn', rope_factor=4.0,
              rope_original_max_len=16, rotary_fraction=0.75)
  causal = jnp.tril(jnp.ones((9, 9), bool))[None, None]
  dense = rotary.rotary_attention(q, k, v, mask=causal, q_offset=0, **rope)
  blocks = registry.get('rotary').chunked(q, k, v, mask=masks.causal(),
                                           chunk_size=4, **rope)
  np.testing.assert_allclose(np.asarray(blocks), np.asarray(dense), atol=1e-5)
