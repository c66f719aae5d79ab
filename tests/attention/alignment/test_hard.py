"""Hard (straight-through Gumbel-softmax) attention.

References: `_loop_choice` takes the argmax over visible keys of
q.k/sqrt(d) + bias (+ noise) in python floats; the gradient reference is
jax.grad through softmax((l + g) / temperature) written here with jnp.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.alignment import hard


def _qkv(seed, b=2, n=3, m=5, h=2, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, n, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32),
          rng.normal(size=(b, m, h, d)).astype(np.float32))


def _loop_choice(q, k, mask, noise=None, bias=None):
  """The chosen key per (b, h, i), -1 for a fully masked row."""
  b, n, h, d = q.shape
  m = k.shape[1]
  mask = np.broadcast_to(mask, (b, h, n, m))
  choice = np.full((b, h, n), -1)
  for bi, hi, i in np.ndindex(b, h, n):
    best = -math.inf
    for j in range(m):
      if not mask[bi, hi, i, j]:
        continue
      score = sum(float(q[bi, i, hi, x]) * float(k[bi, j, hi, x]) for x in range(d)) / math.sqrt(d)
      score += 0.0 if bias is None else float(bias[bi, hi, i, j])
      score += 0.0 if noise is None else float(noise[bi, hi, i, j])
      if score > best:
        best, choice[bi, hi, i] = score, j
  return choice


def _mask(b, n, m, seed=1):
  mask = np.random.default_rng(seed).random((b, 1, n, m)) < 0.5
  mask[0, 0, 0] = False  # a fully masked row
  mask[1, 0, 1] = [False] * (m - 1) + [True]  # one visible key, the last
  return mask


_hard = jax.jit(hard.hard_attention, static_argnames='return_weights')


def _check_choice(weights, choice, v, out):
  m = weights.shape[-1]
  for (bi, hi, i), j in np.ndenumerate(choice):
    if j < 0:
      np.testing.assert_allclose(weights[bi, hi, i], 1 / m)
    else:
      np.testing.assert_array_equal(weights[bi, hi, i], np.eye(m)[j])
      np.testing.assert_allclose(out[bi, i, hi], v[bi, j, hi], rtol=1e-6)


def test_eval_reads_the_argmax_key():
  q, k, v = _qkv(0)
  mask = _mask(2, 3, 5)
  bias = np.random.default_rng(2).normal(size=(2, 2, 3, 5)).astype(np.float32)
  out, weights = _hard(q, k, v, mask=jnp.asarray(mask), bias=bias, return_weights=True)
  _check_choice(np.asarray(weights), _loop_choice(q, k, mask, bias=bias), v, np.asarray(out))


@pytest.mark.parametrize('temperature', [1.0, 0.1])
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_training_reads_the_argmax_of_logits_plus_gumbel(seed, temperature):
  q, k, v = _qkv(3 + seed)
  mask = _mask(2, 3, 5, seed)
  rng = jax.random.PRNGKey(seed)
  noise = np.asarray(jax.random.gumbel(rng, (2, 2, 3, 5), jnp.float32))
  out, weights = _hard(q, k, v, rng=rng, temperature=temperature, mask=jnp.asarray(mask),
                       return_weights=True)
  weights = np.asarray(weights)
  assert np.all(np.isfinite(weights))
  _check_choice(weights, _loop_choice(q, k, mask, noise=noise), v, np.asarray(out))


def test_masked_keys_never_chosen_over_many_draws():
  q, k, v = _qkv(6)
  mask = _mask(2, 3, 5)
  draw = jax.jit(jax.vmap(lambda r: hard.hard_attention(
      q * 3, k, v, rng=r, mask=jnp.asarray(mask), return_weights=True)[1]))
  weights = np.asarray(draw(jax.random.split(jax.random.PRNGKey(0), 100)))  # [100, b, h, n, m]
  hidden = ~np.broadcast_to(mask, weights.shape[1:])
  hidden[0, :, 0] = False  # the fully masked row is uniform by rule
  assert np.all(weights[:, hidden] == 0)


def test_samples_follow_the_softmax():
  # Gumbel-max: argmax(l + g) is a sample from softmax(l).
  q, k, v = _qkv(7, b=1, n=1, m=4, h=1)
  draws = 4000
  rep = lambda x: jnp.broadcast_to(x, (draws,) + x.shape[1:])
  _, weights = _hard(rep(q), rep(k), rep(v), rng=jax.random.PRNGKey(1), return_weights=True)
  freq = np.asarray(weights)[:, 0, 0].mean(0)
  logits = np.einsum('d,md->m', q[0, 0, 0], k[0, :, 0]) / 2.0
  want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
  np.testing.assert_allclose(freq, want, atol=0.03)


@pytest.mark.parametrize('temperature', [1.0, 0.5])
def test_gradient_is_the_soft_samples(temperature):
  q, k, v = _qkv(8)
  mask = jnp.asarray(_mask(2, 3, 5))
  rng = jax.random.PRNGKey(3)
  noise = jax.random.gumbel(rng, (2, 2, 3, 5), jnp.float32)
  c = jnp.asarray(np.random.default_rng(9).normal(size=(2, 2, 3, 5)).astype(np.float32))

  def hard_loss(q, k):
    return jnp.sum(c * hard.hard_attention(q, k, v, rng=rng, temperature=temperature,
                                           mask=mask, return_weights=True)[1])

  def soft_loss(q, k):
    logits = jnp.einsum('bnhd,bmhd->bhnm', q, k) / 2.0
    noisy = jnp.where(mask, (logits + noise) / temperature, -1e30)
    return jnp.sum(c * jax.nn.softmax(noisy, -1))

  got = jax.grad(hard_loss, argnums=(0, 1))(q, k)
  want = jax.grad(soft_loss, argnums=(0, 1))(q, k)
  for g, w in zip(got, want):
    assert np.abs(np.asarray(w)).max() > 1e-3
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


def test_eval_has_zero_gradient_and_dropout_zeroes_choices():
  q, k, v = _qkv(10)
  g = jax.grad(lambda q: jnp.sum(hard.hard_attention(q, k, v)))(q)
  assert np.all(np.asarray(g) == 0)
  _, weights = hard.hard_attention(q, k, v, rng=jax.random.PRNGKey(0), dropout_rate=0.5,
                                   dropout_rng=jax.random.PRNGKey(1), deterministic=False,
                                   return_weights=True)
  assert set(np.unique(np.asarray(weights))) <= {0.0, 2.0}


def test_bfloat16_inputs():
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(11))
  out, weights = _hard(q, k, v, rng=jax.random.PRNGKey(0), return_weights=True)
  assert out.dtype == jnp.bfloat16 and weights.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(weights, np.float32).sum(-1), 1.0)


def test_registered():
  variant = registry.get('hard')
  assert variant.stochastic and dict(variant.kwargs) == {'temperature': 1.0}
  assert registry.resolve_kwargs('hard', {'temperature': 0.5}) == {'temperature': 0.5}


@pytest.mark.parametrize('temperature', [0.0, -1.0, 'hot', True])
def test_bad_temperature_raises_naming_it(temperature):
  with pytest.raises(ValueError, match='temperature'):
    registry.resolve_kwargs('hard', {'temperature': temperature})
