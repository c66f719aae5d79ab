"""ALiBi against the paper's numbers and scalar python references.

`_paper_slopes` is the recursive `get_slopes` of the paper's reference code
(ofirpress/attention_with_linear_biases); `loop_attention` (tests/attention/conftest.py) walks batch,
head, query and key in python floats with the bias given per (head, query, key).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention.schemes import alibi
from flaxformer_lite.attention import registry
from flaxformer_lite.layers import MultiHeadAttention


def _paper_slopes(n):
  def power_of_2(n):
    start = 2 ** (-2 ** -(math.log2(n) - 3))
    return [start * start ** i for i in range(n)]
  if math.log2(n).is_integer():
    return power_of_2(n)
  closest = 2 ** math.floor(math.log2(n))
  return power_of_2(closest) + _paper_slopes(2 * closest)[0::2][:n - closest]


def _qkv(seed, b=2, n=4, m=4, h=3, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


_bias = jax.jit(alibi.alibi_bias, static_argnums=(0, 1, 2))
_attention = jax.jit(registry.get('alibi').fn)  # the dense path derived from its score

# ---- slopes --------------------------------------------------------------------


def test_slopes_8_heads_are_the_papers():
  np.testing.assert_array_equal(np.asarray(alibi.alibi_slopes(8)),
                                [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
  assert alibi.alibi_slopes(8).dtype == jnp.float32


def test_slopes_6_heads_by_hand():
  # The 4-head sequence 2^-2 .. 2^-8, then every other 8-head slope: 2^-1, 2^-3.
  np.testing.assert_array_equal(np.asarray(alibi.alibi_slopes(6)),
                                [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])


@pytest.mark.parametrize('num_heads', range(1, 34))
def test_slopes_match_reference_code(num_heads):
  np.testing.assert_allclose(np.asarray(alibi.alibi_slopes(num_heads)),
                             _paper_slopes(num_heads), rtol=1e-6)


@pytest.mark.parametrize('num_heads', [0, -1, 2.0])
def test_bad_head_count_raises(num_heads):
  with pytest.raises(ValueError, match='num_heads'):
    alibi.alibi_slopes(num_heads)


# ---- bias and attention --------------------------------------------------------


@pytest.mark.parametrize('q_len,k_len,q_offset', [(3, 5, 0), (2, 6, 3), (5, 5, 0)])
def test_bias_is_minus_slope_times_distance(q_len, k_len, q_offset):
  slopes = _paper_slopes(3)
  got = np.asarray(_bias(3, q_len, k_len, q_offset=q_offset))
  assert got.shape == (1, 3, q_len, k_len)
  for h in range(3):
    for i in range(q_len):
      for j in range(k_len):
        assert got[0, h, i, j] == pytest.approx(-slopes[h] * abs(j - q_offset - i))
        if j <= q_offset + i:  # the paper's causal form: m * [-(i-1), ..., -1, 0]
          assert got[0, h, i, j] == pytest.approx(slopes[h] * (j - (q_offset + i)))


@pytest.mark.parametrize('n,m,q_offset', [(4, 4, 0), (2, 5, 3), (3, 2, 0)])
def test_attention_matches_loop(n, m, q_offset, loop_attention):
  q, k, v = _qkv(1, n=n, m=m)
  extra = np.random.default_rng(3).normal(size=(1, 3, n, m)).astype(np.float32)
  mask = np.random.default_rng(4).random((2, 1, n, m)) < 0.7
  mask[..., 0] = True
  got = _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask),
                   bias=jnp.asarray(extra), q_offset=q_offset)
  slopes = _paper_slopes(3)
  bias_fn = lambda h, i, j: -slopes[h] * abs(j - q_offset - i) + extra[0, h, i, j]
  np.testing.assert_allclose(np.asarray(got), loop_attention(q, k, v, bias_fn, mask),
                             atol=1e-5, rtol=1e-5)


def test_bfloat16_attention_adds_the_bias_in_float32(loop_attention):
  """12 heads: the slopes 2^(-k/2), k odd, are not bfloat16 numbers, and
  queries at positions near 200 put the bias where bfloat16's spacing is 1.
  The weights are the float64 loop's with the paper's bias to bfloat16
  precision, and far from the loop's with the bias rounded to bfloat16.
  One-hot values make the output the weights."""
  h, n, m, q_offset = 12, 2, 4, 200
  q, k, _ = _qkv(20, b=1, n=n, m=m, h=h, d=m)  # d = 4: 1/sqrt(d) exact in bfloat16
  q, k = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k))
  v = np.broadcast_to(np.eye(m)[None, :, None], (1, m, h, m))
  slopes = _paper_slopes(h)
  bias_fn = lambda hi, i, j: -slopes[hi] * abs(j - q_offset - i)
  want = loop_attention(q, k, v, bias_fn)
  rounded = lambda hi, i, j: float(jnp.asarray(bias_fn(hi, i, j), jnp.bfloat16))
  assert np.abs(loop_attention(q, k, v, rounded) - want).max() > 0.05
  got = _attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), q_offset=q_offset)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2 ** -8)


# ---- registry and layer ---------------------------------------------------------


def test_registered_without_options_or_params():
  assert 'alibi' in registry.names()
  variant = registry.get('alibi')
  assert variant.terms is not None  # written once: every kernel from its score
  assert dict(variant.kwargs) == {}
  assert variant.params is None
  assert variant.uses_positions
  assert registry.resolve_kwargs('alibi', {'max_distance': None}) == {}


def test_layer_forward_and_cached_decode():
  b, n, f = 2, 5, 6
  x = jnp.asarray(np.random.default_rng(7).normal(size=(b, n, f)).astype(np.float32))
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]
  decoder = MultiHeadAttention(num_heads=2, qkv_features=8, attention='alibi', decode=True)
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
