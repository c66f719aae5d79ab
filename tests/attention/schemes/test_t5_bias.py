"""T5 relative position bias against scalar python references.

`t5_ref_bucket` is mesh-tensorflow's `_relative_position_bucket` rewritten over
one python int with `math.log`; `loop_attention` walks batch, head, query and
key in python floats with the bias looked up per (head, query, key). Both are
fixtures of tests/attention/conftest.py.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.schemes import t5_bias as t5
from flaxformer_lite.layers import MultiHeadAttention


def _qkv(seed, b=2, n=4, m=4, h=2, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


# Jitted once per static configuration: far fewer compiles than op-by-op.
_bucket = jax.jit(t5.t5_relative_position_bucket,
                  static_argnames=('bidirectional', 'num_buckets', 'max_distance'))
_bias = jax.jit(t5.t5_bias, static_argnums=(1, 2),
                static_argnames=('bidirectional', 'num_buckets', 'max_distance'))


def _t5_attention(query, key, value, rel_embedding, *, bidirectional=True, num_buckets=32,
                  bucket_max_distance=128, **common):
  """The registered dense path (derived from the scheme's terms)."""
  return registry.get('t5_bias').fn(query, key, value, rel_embedding=rel_embedding,
                                    bidirectional=bidirectional, num_buckets=num_buckets,
                                    bucket_max_distance=bucket_max_distance, **common)


_attention = jax.jit(_t5_attention,
                     static_argnames=('bidirectional', 'num_buckets', 'bucket_max_distance'))

# ---- buckets -------------------------------------------------------------------

RELS = np.arange(-300, 301)


@pytest.mark.parametrize('bidirectional', [True, False])
@pytest.mark.parametrize('num_buckets,max_distance',
                         [(32, 128), (16, 64), (8, 20), (64, 256), (10, 50), (4, 3)])
def test_buckets_match_mesh_tensorflow(bidirectional, num_buckets, max_distance,
                                        t5_ref_bucket):
  got = np.asarray(_bucket(
      jnp.asarray(RELS), bidirectional=bidirectional, num_buckets=num_buckets,
      max_distance=max_distance))
  want = [t5_ref_bucket(int(r), bidirectional, num_buckets, max_distance) for r in RELS]
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)
  assert got.min() >= 0 and got.max() < num_buckets


@pytest.mark.parametrize('rel,bucket', [
    (0, 0), (1, 17), (-1, 1), (7, 23), (-7, 7), (-8, 8), (-15, 9), (-16, 10),
    (-127, 15), (-128, 15), (-5000, 15), (2, 18), (16, 26), (128, 31), (5000, 31)])
def test_hand_checked_buckets_bidirectional_32_128(rel, bucket, t5_ref_bucket):
  # 16 buckets per direction, 8 exact; -16 -> 8 + floor(log(16/8)/log(128/8) * 8) = 10.
  assert t5_ref_bucket(rel, True, 32, 128) == bucket
  assert int(_bucket(jnp.array(rel))) == bucket


@pytest.mark.parametrize('rel,bucket', [
    (5, 0), (1, 0), (0, 0), (-1, 1), (-15, 15), (-16, 16), (-31, 21), (-32, 21),
    (-128, 31), (-1000, 31)])
def test_hand_checked_buckets_unidirectional_32_128(rel, bucket, t5_ref_bucket):
  # Future keys share bucket 0; 16 exact; -32 -> 16 + floor(log(2)/log(8) * 16) = 21.
  assert t5_ref_bucket(rel, False, 32, 128) == bucket
  assert int(_bucket(jnp.array(rel), bidirectional=False)) == bucket


def test_bucket_keeps_shape():
  rel = jnp.arange(24).reshape(2, 3, 4) - 12
  assert _bucket(rel).shape == (2, 3, 4)


# ---- bias and attention --------------------------------------------------------


@pytest.mark.parametrize('q_len,k_len,q_offset', [(3, 5, 0), (2, 6, 3), (5, 5, 0)])
def test_bias_looks_up_bucket_of_key_minus_query(q_len, k_len, q_offset, t5_ref_bucket):
  table = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
  got = np.asarray(_bias(jnp.asarray(table), q_len, k_len, q_offset=q_offset,
                         num_buckets=8, max_distance=6))
  assert got.shape == (1, 3, q_len, k_len)
  for h in range(3):
    for i in range(q_len):
      for j in range(k_len):
        assert got[0, h, i, j] == table[t5_ref_bucket(j - (q_offset + i), True, 8, 6), h]


@pytest.mark.parametrize('bidirectional', [True, False])
@pytest.mark.parametrize('n,m,q_offset', [(4, 4, 0), (2, 5, 3), (3, 2, 0)])
def test_attention_matches_loop(bidirectional, n, m, q_offset, loop_attention, t5_ref_bucket):
  nb, md = 8, 5
  q, k, v = _qkv(1, n=n, m=m)
  table = np.random.default_rng(2).normal(size=(nb, 2)).astype(np.float32)
  extra = np.random.default_rng(3).normal(size=(1, 2, n, m)).astype(np.float32)
  mask = np.random.default_rng(4).random((2, 1, n, m)) < 0.7
  mask[..., 0] = True
  got = _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table),
                   mask=jnp.asarray(mask), bias=jnp.asarray(extra), q_offset=q_offset,
                   bidirectional=bidirectional, num_buckets=nb, bucket_max_distance=md)
  bias_fn = lambda h, i, j: (table[t5_ref_bucket(j - q_offset - i, bidirectional, nb, md), h]
                             + extra[0, h, i, j])
  np.testing.assert_allclose(np.asarray(got), loop_attention(q, k, v, bias_fn, mask),
                             atol=1e-5, rtol=1e-5)


def test_bfloat16_attention_adds_the_bias_in_float32(loop_attention, t5_ref_bucket):
  """Bucket scalars near 100 that bfloat16 cannot hold (its spacing there is
  0.5): the weights are the float64 loop's with the float32 table to bfloat16
  precision, and far from the loop's with the table rounded to bfloat16.
  One-hot values make the output the weights."""
  n, m, nb, md = 3, 4, 8, 5
  q, k, _ = _qkv(11, n=n, m=m, d=m)  # d = 4: 1/sqrt(d) exact in bfloat16
  q, k = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k))
  v = np.broadcast_to(np.eye(m)[None, :, None], (2, m, 2, m))
  table = np.random.default_rng(12).uniform(100.0, 102.0, size=(nb, 2)).astype(np.float32)
  bias_fn = lambda t: lambda h, i, j: float(t[t5_ref_bucket(j - i, True, nb, md), h])
  want = loop_attention(q, k, v, bias_fn(table))
  rounded = np.asarray(jnp.asarray(table, jnp.bfloat16), np.float32)
  assert np.abs(loop_attention(q, k, v, bias_fn(rounded)) - want).max() > 0.05
  got = _attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(table),
                   num_buckets=nb, bucket_max_distance=md)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2 ** -8)


@pytest.mark.parametrize('b', [1, 3, 4])
def test_table_and_query_gradients_match_finite_differences_of_loop(b, loop_attention,
                                                                   t5_ref_bucket):
  """d/d(table, query) of sum(out * w) against central differences of the
  float64 loop reference, for odd and even batches (the bias is broadcast to
  the batch as copies, whose transpose sums over the batch)."""
  n, m, nb, md, eps = 4, 5, 8, 5, 1e-4
  q, k, v = _qkv(5, b=b, n=n, m=m)
  table = np.random.default_rng(6).normal(size=(nb, 2)).astype(np.float32)
  w = np.random.default_rng(7).normal(size=(b, n, 2, 4))
  mask = np.random.default_rng(8).random((b, 1, n, m)) < 0.7
  mask[..., 0] = True

  def loss(q, table):
    out = _attention(q, jnp.asarray(k), jnp.asarray(v), table, mask=jnp.asarray(mask),
                     q_offset=1, num_buckets=nb, bucket_max_distance=md)
    return jnp.sum(out * w)

  k64, v64 = k.astype(np.float64), v.astype(np.float64)  # float64 all through

  def loop_loss(q, table):
    bias_fn = lambda h, i, j: table[t5_ref_bucket(j - 1 - i, True, nb, md), h]
    return float(np.sum(loop_attention(q, k64, v64, bias_fn, mask) * w))

  g_q, g_table = jax.grad(loss, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(table))
  q64, t64 = q.astype(np.float64), table.astype(np.float64)
  fd_table = np.zeros_like(t64)
  for idx in np.ndindex(*t64.shape):
    up, down = t64.copy(), t64.copy()
    up[idx] += eps
    down[idx] -= eps
    fd_table[idx] = (loop_loss(q64, up) - loop_loss(q64, down)) / (2 * eps)
  np.testing.assert_allclose(np.asarray(g_table), fd_table, atol=2e-4, rtol=1e-3)
  assert np.abs(fd_table).max() > 1e-2  # the buckets that occur get gradient
  fd_q = np.zeros_like(q64)
  for idx in [(0, 0, 0, 0), (b - 1, n - 1, 1, 3), (b // 2, 2, 0, 1)]:
    up, down = q64.copy(), q64.copy()
    up[idx] += eps
    down[idx] -= eps
    fd_q[idx] = (loop_loss(up, t64) - loop_loss(down, t64)) / (2 * eps)
    np.testing.assert_allclose(float(g_q[idx]), fd_q[idx], atol=2e-4, rtol=1e-3)


# ---- registry and layer ---------------------------------------------------------


def test_registered_with_defaults_and_params():
  assert 't5_bias' in registry.names()
  variant = registry.get('t5_bias')
  assert variant.terms is not None  # written once: every kernel from its terms
  assert dict(variant.kwargs) == {'num_buckets': 32, 'bucket_max_distance': 128,
                                  'bidirectional': True}
  assert variant.uses_positions
  kwargs = registry.resolve_kwargs('t5_bias', {'num_buckets': 16, 'bucket_max_distance': None})
  assert kwargs == {'num_buckets': 16, 'bucket_max_distance': 128, 'bidirectional': True}
  shape, init, _ = variant.params(3, 4, kwargs)['rel_embedding']
  assert shape == (16, 3)
  assert init(jax.random.PRNGKey(0), shape).shape == (16, 3)


@pytest.mark.parametrize('given,option', [
    ({'num_buckets': 6, 'bidirectional': True, 'bucket_max_distance': 1}, 'bucket_max_distance'),
    ({'num_buckets': 7}, 'num_buckets'),
    ({'num_buckets': 2}, 'num_buckets'),
    ({'num_buckets': 1, 'bidirectional': False}, 'num_buckets'),
    ({'num_buckets': 32, 'bucket_max_distance': 8}, 'bucket_max_distance'),
    ({'num_buckets': 32, 'bucket_max_distance': 16, 'bidirectional': False},
     'bucket_max_distance'),
    ({'bucket_max_distance': 2.5}, 'bucket_max_distance'),
    ({'max_distance': 64}, 'max_distance'),  # shaw's option, not this one
    ({'num_buckets': 32.0}, 'num_buckets'),
    ({'bidirectional': 'yes'}, 'bidirectional'),
    ({'window': 3}, 'window'),
])
def test_bad_kwargs_raise_naming_option(given, option):
  with pytest.raises(ValueError, match=option):
    registry.resolve_kwargs('t5_bias', given)


def test_smallest_valid_kwargs_are_accepted():
  registry.resolve_kwargs('t5_bias', {'num_buckets': 4, 'bucket_max_distance': 2})
  registry.resolve_kwargs('t5_bias', {'num_buckets': 2, 'bucket_max_distance': 2,
                                      'bidirectional': False})


def test_layer_forward_and_cached_decode():
  b, n, f = 2, 5, 6
  x = jnp.asarray(np.random.default_rng(7).normal(size=(b, n, f)).astype(np.float32))
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]
  decoder = MultiHeadAttention(num_heads=2, qkv_features=8, attention='t5_bias',
                               attention_kwargs={'num_buckets': 8, 'bucket_max_distance': 4},
                               decode=True)
  variables = nn.unbox(jax.jit(decoder.init)(jax.random.PRNGKey(0), x))
  params, cache = variables['params'], variables['cache']
  assert params['rel_embedding'].shape == (8, 2)
  # A larger table than the init's, so that a wrong position shows in the output.
  params = {**params, 'rel_embedding': jax.random.normal(jax.random.PRNGKey(1), (8, 2))}
  want = jax.jit(decoder.clone(decode=False).apply)({'params': params}, x, mask=causal)
  assert want.shape == (b, n, f)

  step = jax.jit(functools.partial(decoder.apply, mutable=['cache']))
  got, mutated = step({'params': params, 'cache': cache}, x[:, :3])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, :3]), atol=1e-5)
  for t in range(3, n):
    got, mutated = step({'params': params, 'cache': mutated['cache']}, x[:, t:t + 1])
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, t]), atol=1e-5,
                               err_msg=f'position {t}')
