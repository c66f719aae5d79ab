"""Scaled dot-product attention against an explicit loop reference.

The reference (`_loop_weights`, `_loop_attention`) walks batch, head, query
and key one at a time in python floats: logit = q.k / sqrt(d) + bias, masked
keys excluded from the softmax, a query with no visible key gets uniform
weights over all keys (the documented rule), output = sum_j w_j v_j.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import dot_product_attention
from flaxformer_lite.attention import dot_product_attention_weights
from flaxformer_lite.attention import entry, registry

IMPLEMENTATIONS = [None, 'dense', 'xla']
B, N, M, H, D = 2, 4, 5, 2, 3


def _loop_weights(q, k, mask=None, bias=None, keep=None, rate=0.0):
  """q [b, n, h, d], k [b, m, h, d] -> weights [b, h, n, m], one entry at a time."""
  b, n, h, d = q.shape
  m = k.shape[1]
  mask = np.ones((b, h, n, m), bool) if mask is None else np.broadcast_to(mask, (b, h, n, m))
  bias = np.zeros((b, h, n, m)) if bias is None else np.broadcast_to(bias, (b, h, n, m))
  w = np.zeros((b, h, n, m), np.float64)
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        logits = []
        for j in range(m):
          dot = 0.0
          for c in range(d):
            dot += float(q[bi, i, hi, c]) * float(k[bi, j, hi, c])
          logits.append(dot / math.sqrt(d) + float(bias[bi, hi, i, j]))
        visible = [j for j in range(m) if mask[bi, hi, i, j]]
        if not visible:
          for j in range(m):
            w[bi, hi, i, j] = 1.0 / m
          continue
        top = max(logits[j] for j in visible)
        exps = {j: math.exp(logits[j] - top) for j in visible}
        total = sum(exps.values())
        for j in visible:
          w[bi, hi, i, j] = exps[j] / total
        if keep is not None:
          for j in range(m):
            w[bi, hi, i, j] = w[bi, hi, i, j] / (1.0 - rate) if keep[bi, hi, i, j] else 0.0
  return w


def _loop_attention(q, k, v, mask=None, bias=None, keep=None, rate=0.0):
  """-> [b, n, h, d]: out[b, i, h, :] = sum_j w[b, h, i, j] v[b, j, h, :]."""
  w = _loop_weights(q, k, mask, bias, keep, rate)
  b, n, h, d = q.shape
  m = k.shape[1]
  out = np.zeros((b, n, h, v.shape[-1]), np.float64)
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        for j in range(m):
          out[bi, i, hi, :] += w[bi, hi, i, j] * np.asarray(v[bi, j, hi, :], np.float64)
  return out


def _qkv(seed, n=N, m=M, b=B, h=H, d=D):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, n, h, d)).astype(np.float32)
  k = rng.normal(size=(b, m, h, d)).astype(np.float32)
  v = rng.normal(size=(b, m, h, d)).astype(np.float32)
  return q, k, v


def _check(q, k, v, *, mask=None, bias=None, implementation=None):
  j = lambda x: None if x is None else jnp.asarray(x)
  got_w = dot_product_attention_weights(j(q), j(k), mask=j(mask), bias=j(bias))
  np.testing.assert_allclose(np.asarray(got_w), _loop_weights(q, k, mask, bias),
                             atol=1e-5, rtol=1e-5)
  got = dot_product_attention(j(q), j(k), j(v), mask=j(mask), bias=j(bias),
                              implementation=implementation)
  assert got.shape == q.shape[:3] + v.shape[-1:]
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _loop_attention(q, k, v, mask, bias),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('seed', [0, 1])
def test_no_mask(implementation, seed):
  q, k, v = _qkv(seed)
  _check(q, k, v, implementation=implementation)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('n,m', [(1, 5), (6, 3)])
def test_cross_attention_lengths(implementation, n, m):
  q, k, v = _qkv(2, n=n, m=m)
  _check(q, k, v, implementation=implementation)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_key_padding_mask_differs_per_example(implementation):
  q, k, v = _qkv(3)
  lengths = [2, 5]  # example 0 sees keys 0..1, example 1 sees all keys
  valid = np.array([[j < n for j in range(M)] for n in lengths])  # [b, m]
  mask = valid[:, None, None, :]  # [b, 1, 1, m]
  _check(q, k, v, mask=mask, implementation=implementation)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_causal_mask(implementation):
  q, k, v = _qkv(4, n=5, m=5)
  causal = np.array([[j <= i for j in range(5)] for i in range(5)])
  _check(q, k, v, mask=causal[None, None], implementation=implementation)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('shape', [(B, H, N, M), (B, 1, N, M), (1, 1, N, M),
                                   (1, H, N, M), (B, 1, 1, M), (N, M)])
def test_random_mask_broadcast_shapes(implementation, shape):
  q, k, v = _qkv(5)
  rng = np.random.default_rng(sum(shape))
  mask = rng.random(shape) < 0.6
  _check(q, k, v, mask=mask, implementation=implementation)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('shape', [(B, H, N, M), (1, H, N, M), (N, M)])
def test_bias_added_to_scaled_logits(implementation, shape):
  q, k, v = _qkv(6)
  bias = np.random.default_rng(7).normal(size=shape).astype(np.float32) * 2
  mask = np.random.default_rng(8).random((B, 1, N, M)) < 0.7
  _check(q, k, v, bias=bias, implementation=implementation)
  _check(q, k, v, bias=bias, mask=mask, implementation=implementation)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_bfloat16_compute_adds_the_bias_in_float32(implementation):
  """q, k bfloat16 numbers, the bias float32 values near 100 that bfloat16
  cannot hold (its spacing there is 0.5): the weights are the float64 loop's
  with the float32 bias to bfloat16 precision, and far from the loop's with
  the bias rounded to bfloat16. One-hot values make the output the weights."""
  n, m = 3, 4
  rng = np.random.default_rng(30)
  q, k = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
          for x in _qkv(30, n=n, m=m, d=m)[:2])  # d = 4: 1/sqrt(d) exact in bfloat16
  bias = rng.uniform(100.0, 102.0, size=(1, H, n, m)).astype(np.float32)
  v = np.broadcast_to(np.eye(m, dtype=np.float32)[None, :, None], (B, m, H, m))
  want = _loop_weights(q, k, bias=bias)
  rounded = np.asarray(jnp.asarray(bias, jnp.bfloat16), np.float32)
  assert np.abs(_loop_weights(q, k, bias=rounded) - want).max() > 0.05
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  got_w = dot_product_attention_weights(bf16(q), bf16(k), bias=jnp.asarray(bias))
  got = dot_product_attention(bf16(q), bf16(k), bf16(v), bias=jnp.asarray(bias),
                              implementation=implementation)
  assert got_w.dtype == got.dtype == jnp.bfloat16
  # bfloat16 weights: 8 significant bits.
  np.testing.assert_allclose(np.asarray(got_w, np.float32), want, atol=2 ** -8)
  np.testing.assert_allclose(np.asarray(got, np.float32), want.transpose(0, 2, 1, 3),
                             atol=2 ** -8)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_fully_masked_query_row_is_uniform_and_finite(implementation):
  q, k, v = _qkv(9)
  mask = np.ones((B, 1, N, M), bool)
  mask[0, 0, 1, :] = False  # query 1 of example 0 sees nothing
  mask[1, 0, 3, :] = False
  bias = np.random.default_rng(10).normal(size=(1, H, N, M)).astype(np.float32)
  for b in (None, bias):
    got = np.asarray(dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                           mask=jnp.asarray(mask),
                                           bias=None if b is None else jnp.asarray(b),
                                           implementation=implementation))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[0, 1], v[0].mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(got[1, 3], v[1].mean(axis=0), atol=1e-5)
    _check(q, k, v, mask=mask, bias=b, implementation=implementation)


def _numeric_grad(f, args, eps=1e-6):
  """Central differences of scalar f(*args) in float64, one element at a time."""
  grads = []
  for a in range(len(args)):
    g = np.zeros(args[a].shape)
    for idx in np.ndindex(args[a].shape):
      hi = [np.array(x, np.float64) for x in args]
      lo = [np.array(x, np.float64) for x in args]
      hi[a][idx] += eps
      lo[a][idx] -= eps
      g[idx] = (f(*hi) - f(*lo)) / (2 * eps)
    grads.append(g)
  return grads


def test_gradients_and_jvp_match_finite_differences_of_the_loop():
  # The softmax's derivative is written by hand (softmax._softmax):
  # check reverse and forward mode against central differences of the loop
  # reference, with a random mask, a fully masked row and a bias.
  q, k, v = _qkv(11, n=3, m=4, h=2, d=2)
  rng = np.random.default_rng(12)
  mask = rng.random((B, 1, 3, 4)) < 0.7
  mask[0, 0, 2, :] = False
  bias = rng.normal(size=(1, 2, 3, 4)).astype(np.float32)
  r = rng.normal(size=q.shape[:3] + v.shape[-1:])  # output weights: loss = sum(out * r)

  def loop_loss(q, k, v, bias):
    return float(np.sum(_loop_attention(q, k, v, mask, bias) * r))

  def loss(q, k, v, bias):
    out = dot_product_attention(q, k, v, mask=jnp.asarray(mask), bias=bias)
    return jnp.sum(out * r)

  args = [jnp.asarray(x) for x in (q, k, v, bias)]
  want = _numeric_grad(loop_loss, (q, k, v, bias))
  got = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
  for name, g, w in zip('q k v bias'.split(), got, want):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-4, rtol=1e-3, err_msg=name)
  tangents = [jnp.asarray(rng.normal(size=x.shape).astype(np.float32)) for x in args]
  _, directional = jax.jvp(loss, args, tangents)
  want_dir = sum(float(np.sum(w * np.asarray(t))) for w, t in zip(want, tangents))
  np.testing.assert_allclose(float(directional), want_dir, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize('seed', range(4))
def test_weights_are_a_distribution_over_visible_keys(seed):
  q, k, _ = _qkv(seed)
  mask = np.random.default_rng(seed).random((B, H, N, M)) < 0.5
  mask[..., 0] = True  # every row sees at least one key
  w = np.asarray(dot_product_attention_weights(jnp.asarray(q), jnp.asarray(k),
                                               mask=jnp.asarray(mask)))
  assert np.all(w >= 0)
  np.testing.assert_array_equal(w[~mask], 0.0)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('seed', range(3))
def test_permuting_keys_and_values_together_is_invariant(implementation, seed):
  q, k, v = _qkv(seed)
  mask = np.random.default_rng(seed + 100).random((B, 1, N, M)) < 0.7
  perm = np.random.default_rng(seed + 200).permutation(M)
  a = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                            mask=jnp.asarray(mask), implementation=implementation)
  p = dot_product_attention(jnp.asarray(q), jnp.asarray(k[:, perm]), jnp.asarray(v[:, perm]),
                            mask=jnp.asarray(mask[..., perm]),
                            implementation=implementation)
  np.testing.assert_allclose(np.asarray(a), np.asarray(p), atol=1e-5)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_masked_keys_do_not_influence_output(implementation):
  q, k, v = _qkv(11)
  mask = np.random.default_rng(12).random((B, 1, N, M)) < 0.6
  mask[..., 0] = True
  mask[..., -1] = False  # at least one key hidden from every query
  hidden = ~mask.any(axis=(1, 2))  # [b, m]: keys no query may see
  k2, v2 = k.copy(), v.copy()
  k2[hidden] = 100.0
  v2[hidden] = -100.0
  a = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                            mask=jnp.asarray(mask), implementation=implementation)
  b = dot_product_attention(jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v2),
                            mask=jnp.asarray(mask), implementation=implementation)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


# ---- dropout -----------------------------------------------------------------

RATE = 0.4


def test_deterministic_ignores_dropout():
  q, k, v = _qkv(13)
  rng = jax.random.PRNGKey(0)
  for implementation in IMPLEMENTATIONS:
    got = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                dropout_rate=RATE, dropout_rng=rng, deterministic=True,
                                implementation=implementation)
    np.testing.assert_allclose(np.asarray(got), _loop_attention(q, k, v), atol=1e-5)
  w = dot_product_attention_weights(jnp.asarray(q), jnp.asarray(k), dropout_rate=RATE,
                                    dropout_rng=rng, deterministic=True)
  np.testing.assert_allclose(np.asarray(w), _loop_weights(q, k), atol=1e-5)


@pytest.mark.parametrize('implementation', [None, 'dense'])
@pytest.mark.parametrize('seed', [0, 1])
def test_dropout_matches_loop_with_same_keep_mask(implementation, seed, loop_keep):
  q, k, v = _qkv(14 + seed)
  mask = np.random.default_rng(seed).random((B, 1, N, M)) < 0.7
  mask[0, 0, 1] = False  # a row that sees no key keeps its uniform weights whole
  rng = jax.random.PRNGKey(seed)
  # The documented algorithm: the hash of (row, head, query, key) and a seed
  # drawn from the key (attention/dropout.py).
  keep = loop_keep(int(jax.random.bits(rng, (), jnp.uint32)), RATE, B, H, N, M)
  assert 0 < keep.sum() < keep.size
  w = dot_product_attention_weights(jnp.asarray(q), jnp.asarray(k), mask=jnp.asarray(mask),
                                    dropout_rate=RATE, dropout_rng=rng, deterministic=False)
  np.testing.assert_allclose(np.asarray(w), _loop_weights(q, k, mask, keep=keep, rate=RATE),
                             atol=1e-5)
  got = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                              mask=jnp.asarray(mask), dropout_rate=RATE, dropout_rng=rng,
                              deterministic=False, implementation=implementation)
  np.testing.assert_allclose(np.asarray(got),
                             _loop_attention(q, k, v, mask, keep=keep, rate=RATE), atol=1e-5)
  no_drop = _loop_attention(q, k, v, mask)
  assert not np.allclose(np.asarray(got), no_drop, atol=1e-3)


def test_dropout_without_rng_raises():
  q, k, v = _qkv(16)
  with pytest.raises(ValueError, match='dropout_rng'):
    dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                          dropout_rate=RATE, deterministic=False)


def test_dropout_with_fused_implementation_raises_naming_it():
  q, k, v = _qkv(17)
  with pytest.raises(ValueError, match="'xla'"):
    dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                          dropout_rate=RATE, dropout_rng=jax.random.PRNGKey(0),
                          deterministic=False, implementation='xla')


@pytest.mark.parametrize('deterministic', [True, False])
def test_bad_implementation_name_raises_naming_it(deterministic):
  q, k, v = _qkv(18)
  with pytest.raises(ValueError, match='flashy'):
    dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                          dropout_rate=RATE, dropout_rng=jax.random.PRNGKey(0),
                          deterministic=deterministic, implementation='flashy')


# ---- registry ----------------------------------------------------------------


def test_registry_unknown_name_lists_valid_names():
  with pytest.raises(ValueError) as e:
    registry.get('nope')
  message = str(e.value)
  assert "'nope'" in message
  assert registry.names()
  for name in registry.names():
    assert name in message


def test_registry_dot_product_is_the_dot_product_function():
  q, k, v = _qkv(19)
  variant = registry.get('dot_product')
  kwargs = registry.resolve_kwargs('dot_product', None)
  got = variant.fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=None, bias=None,
                   dropout_rate=0.0, dropout_rng=None, deterministic=True,
                   dtype=jnp.float32, **kwargs)
  np.testing.assert_allclose(np.asarray(got), _loop_attention(q, k, v), atol=1e-5)


def test_resolve_kwargs_ignores_none_values_and_keeps_the_kernel_apart():
  assert registry.get('dot_product').kwargs == {}  # the kernel options are every variant's
  assert registry.resolve_kwargs('dot_product', {'max_distance': None}) == {}
  assert registry.resolve_kwargs('dot_product', {'kernel': 'dense'}) == {}
  # chunk_size and dense_max_mib unset (None): the platform's (select.py)
  assert registry.resolve_kernel('dot_product', {'kernel': None}) == (
      'auto', None, None)
  assert registry.resolve_kernel(
      'dot_product', {'kernel': 'xla', 'chunk_size': 64}) == ('xla', 64, None)


def test_resolve_kwargs_validates_values():
  with pytest.raises(ValueError, match='warp'):
    registry.resolve_kwargs('dot_product', {'kernel': 'warp'})
  with pytest.raises(ValueError, match="'xla'"):  # dot_product's own kernels, no other's
    registry.resolve_kwargs('alibi', {'kernel': 'xla'})
  with pytest.raises(ValueError, match='chunk_size=0'):
    registry.resolve_kwargs('alibi', {'chunk_size': 0})


def test_resolve_kwargs_unknown_variant():
  with pytest.raises(ValueError, match='nope'):
    registry.resolve_kwargs('nope', {})


ON_GPU = jax.default_backend() == 'gpu'


@pytest.mark.skipif(ON_GPU, reason='checks the CPU/TPU error; on a GPU cuDNN is valid')
def test_cudnn_without_a_gpu_is_a_config_error_naming_the_backend():
  from flaxformer_lite import config as config_lib, main
  c = config_lib.base_config()
  c.model.attention_kwargs.kernel = 'cudnn'
  with pytest.raises(config_lib.ConfigError, match="'cudnn' needs an NVIDIA GPU.*'cpu'"):
    main.validate(c)
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  assert entry.plan(q, q).kernel.name == 'dense'  # 'auto' keeps the explicit path here


@pytest.mark.skipif(not ON_GPU, reason=f'cuDNN attention needs an NVIDIA GPU; the JAX '
                    f'backend here is {jax.default_backend()!r}')
def test_cudnn_matches_the_reference_on_gpu():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 4, 64)), jnp.bfloat16) for _ in range(3))
  mask = jnp.tril(jnp.ones((128, 128), bool))[None, None]
  assert entry.plan(q, k).kernel.name == 'cudnn'
  fused = registry.get('dot_product').fn(q, k, v, mask=mask, implementation='cudnn')
  reference = registry.get('dot_product').fn(q, k, v, mask=mask, implementation='dense')
  np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(reference, np.float32),
                             atol=2e-2)
