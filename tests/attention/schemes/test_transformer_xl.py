"""Transformer-XL relative attention against the paper's formula, position by position.

Dai et al. 2019, section 3.3: A_ij = q_i.k_j + q_i.W_R R_{i-j} + u.k_j + v.W_R R_{i-j}, here
divided by sqrt(d) as in the paper's code, with R_t = [sin(t w_k), cos(t w_k)], w_k =
10000^(-2k/D). The loops below are float64 and index by distance; the code under test uses the
relative shift (pad, reshape, slice).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention.schemes.transformer_xl import transformer_xl_attention


def _loop(q, k, v, w_r, u, bias_v, mask, q_offset, softmax):
  """Float64 outputs and weights of the paper's formula (softmax: the loop_softmax fixture)."""
  d = q.shape[-1]
  width = w_r.shape[0]

  def r(t):
    half = [t * 10000.0 ** (-2 * i / width) for i in range(width // 2)]
    return np.array([math.sin(a) for a in half] + [math.cos(a) for a in half])

  def logit(bi, hi, i, j):
    return ((q[bi, i, hi] + u[hi]) @ k[bi, j, hi]
            + (q[bi, i, hi] + bias_v[hi]) @ (r(q_offset + i - j) @ w_r[:, hi, :])) / math.sqrt(d)

  return softmax(logit, v, mask)


@pytest.mark.parametrize('q_offset', [0, 3])
def test_output_and_weights_equal_the_paper_formula(q_offset, loop_softmax):
  b, n, m, h, d = 2, 5, 9, 2, 4
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=s) for s in ((b, n, h, d), (b, m, h, d), (b, m, h, d)))
  w_r, u, bias_v = rng.normal(size=(h * d, h, d)) / 3, rng.normal(size=(h, d)), rng.normal(
      size=(h, d))
  # Example 0 causal at positions q_offset + i; example 1 keys 0..6 with its first row hidden.
  mask = np.zeros((b, n, m), bool)
  mask[0] = np.arange(m)[None] <= q_offset + np.arange(n)[:, None]
  mask[1, 1:, :7] = True
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  got, weights = transformer_xl_attention(
      f32(q), f32(k), f32(v), f32(w_r), f32(u), f32(bias_v), mask=jnp.asarray(mask[:, None]),
      q_offset=q_offset, return_weights=True)
  want, want_weights = _loop(q, k, v, w_r, u, bias_v, mask, q_offset, loop_softmax)
  np.testing.assert_allclose(np.asarray(weights), want_weights, atol=2e-5)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)


def test_u_v_and_w_r_each_change_the_output():
  # A bias or projection the code dropped would leave this unchanged.
  rng = np.random.default_rng(2)
  args = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in
          ((1, 4, 2, 4), (1, 6, 2, 4), (1, 6, 2, 4), (8, 2, 4), (2, 4), (2, 4))]
  base = np.asarray(transformer_xl_attention(*args))
  for i in (3, 4, 5):
    moved = list(args)
    moved[i] = jnp.zeros_like(args[i])
    assert np.abs(np.asarray(transformer_xl_attention(*moved)) - base).max() > 1e-3, i


def test_gradients_equal_central_differences_of_the_loop(loop_softmax):
  b, n, m, h, d = 1, 3, 4, 1, 2
  rng = np.random.default_rng(3)
  x = {name: rng.normal(size=s) for name, s in (('q', (b, n, h, d)), ('k', (b, m, h, d)),
                                                ('v', (b, m, h, d)), ('w_r', (h * d, h, d)),
                                                ('u', (h, d)), ('bias_v', (h, d)))}
  mask = np.ones((b, n, m), bool)
  cot = rng.normal(size=(b, n, h, d))

  def loss64(y):
    return float(np.sum(_loop(y['q'], y['k'], y['v'], y['w_r'], y['u'], y['bias_v'], mask, 2,
                              loop_softmax)[0]
                        * cot))

  def loss32(y):
    out = transformer_xl_attention(y['q'], y['k'], y['v'], y['w_r'], y['u'], y['bias_v'],
                                   q_offset=2)
    return jnp.sum(out * cot)

  grads = jax.grad(loss32)({k: jnp.asarray(v, jnp.float32) for k, v in x.items()})
  eps = 1e-5
  for name, value in x.items():
    for index in np.ndindex(value.shape):
      up, down = dict(x), dict(x)
      up[name], down[name] = value.copy(), value.copy()
      up[name][index] += eps
      down[name][index] -= eps
      want = (loss64(up) - loss64(down)) / (2 * eps)
      assert float(grads[name][index]) == pytest.approx(want, abs=2e-3, rel=2e-3), (name, index)
