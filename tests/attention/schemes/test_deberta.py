"""DeBERTa disentangled attention against the paper's formula, position by position.

He et al. 2021, eq. 4: A_ij = Q^c_i K^c_j + Q^c_i K^r_{d(i,j)} + K^c_j Q^r_{d(j,i)}, divided by
sqrt(3d), K^r = P W_k,r, Q^r = P W_q,r, d(i,j) = clamp(bucket(i - j) + s, 0, 2s - 1) with
DeBERTa-v2's log buckets (`make_log_bucket_position` in the released code), written here as a
scalar Python function. The loops are float64; the code under test gathers rows of matmuls
(the dense kernel) or reads lookup tables per query and per key (the fused Pallas kernel).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import attend, masks
from flaxformer_lite.attention.kernels import pallas_gpu
from flaxformer_lite.attention.schemes.deberta import deberta_attention, log_bucket


def _bucket(r, s, top):
  """DeBERTa-v2's make_log_bucket_position for one offset, in Python floats."""
  mid = s // 2
  if abs(r) <= mid:
    return r
  log_pos = math.ceil(math.log(abs(r) / mid) / math.log((top - 1) / mid) * (mid - 1)) + mid
  return int(math.copysign(log_pos, r))


@pytest.mark.parametrize('s,top', [(8, 20), (256, 512), (2, 5), (7, 30)])
def test_log_bucket_equals_the_released_formula(s, top):
  r = np.arange(-3 * top, 3 * top + 1)
  got = np.asarray(log_bucket(jnp.asarray(r), position_buckets=s, max_relative_positions=top))
  np.testing.assert_array_equal(got, [_bucket(int(x), s, top) for x in r])


def test_log_bucket_hand_computed():
  # s = 8: offsets up to 4 exact; 5..19 share log-spaced buckets; max 20 reaches bucket 7.
  # bucket(10) = 4 + ceil(log(10/4) / log(19/4) * 3) = 4 + ceil(1.764) = 6;
  # bucket(1000) = 4 + ceil(log(250) / log(19/4) * 3) = 4 + ceil(10.63) = 15.
  got = log_bucket(jnp.asarray([0, 3, -4, 10, -10, 19, 1000]), position_buckets=8,
                   max_relative_positions=20)
  assert np.asarray(got).tolist() == [0, 3, -4, 6, -6, 7, 15]


def _loop(q, k, v, p, w_kr, w_qr, mask, q_offset, s, top, softmax, p2c_row='released'):
  """Float64 outputs and weights of eq. 4 (softmax: the loop_softmax fixture);
  the position-to-content row of j - i as printed ('paper'), or of i - j as
  the released code's `disentangled_att_bias` gathers it ('released')."""
  d = q.shape[-1]
  idx = lambda r: min(max(_bucket(r, s, top) + s, 0), 2 * s - 1)  # noqa: E731

  def logit(bi, hi, i, j):
    pi = q_offset + i
    return (q[bi, i, hi] @ k[bi, j, hi]
            + q[bi, i, hi] @ (p[idx(pi - j)] @ w_kr[:, hi, :])
            + k[bi, j, hi] @ (p[idx(j - pi if p2c_row == 'paper' else pi - j)] @ w_qr[:, hi, :])
            ) / math.sqrt(3 * d)

  return softmax(logit, v, mask)


@pytest.mark.parametrize('q_offset,p2c_row', [(0, 'released'), (6, 'released'), (6, 'paper')])
def test_output_and_weights_equal_the_paper_formula(q_offset, p2c_row, loop_softmax):
  # s = 4, max 9: offsets past 2 are log-bucketed and past 8 clamped, all within 9 keys.
  b, n, m, h, d, s, top = 2, 5, 9, 2, 4, 4, 9
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=x) for x in ((b, n, h, d), (b, m, h, d), (b, m, h, d)))
  p = rng.normal(size=(2 * s, h * d))
  w_kr, w_qr = rng.normal(size=(2, h * d, h, d)) / 3
  mask = np.zeros((b, n, m), bool)
  mask[0] = np.arange(m)[None] <= q_offset + np.arange(n)[:, None]
  mask[1, 1:, :7] = True  # example 1: keys 0..6, its first row sees nothing
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  got, weights = deberta_attention(
      f32(q), f32(k), f32(v), f32(p), f32(w_kr), f32(w_qr), mask=jnp.asarray(mask[:, None]),
      q_offset=q_offset, position_buckets=s, max_relative_positions=top, p2c_row=p2c_row,
      return_weights=True)
  want, want_weights = _loop(q, k, v, p, w_kr, w_qr, mask, q_offset, s, top, loop_softmax,
                             p2c_row)
  np.testing.assert_allclose(np.asarray(weights), want_weights, atol=2e-5)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)


def test_each_position_term_changes_the_output():
  # A term the code dropped (or a projection it ignored) would leave this unchanged.
  rng = np.random.default_rng(2)
  args = [jnp.asarray(rng.normal(size=x), jnp.float32) for x in
          ((1, 4, 2, 4), (1, 6, 2, 4), (1, 6, 2, 4), (8, 8), (8, 2, 4), (8, 2, 4))]
  kw = dict(position_buckets=4, max_relative_positions=6)
  base = np.asarray(deberta_attention(*args, **kw))
  for i in (3, 4, 5):
    moved = list(args)
    moved[i] = jnp.zeros_like(args[i])
    assert np.abs(np.asarray(deberta_attention(*moved, **kw)) - base).max() > 1e-3, i


def test_gradients_equal_central_differences_of_the_loop(loop_softmax):
  b, n, m, h, d, s, top = 1, 3, 4, 1, 2, 2, 4
  rng = np.random.default_rng(3)
  x = {name: rng.normal(size=shape) for name, shape in (
      ('q', (b, n, h, d)), ('k', (b, m, h, d)), ('v', (b, m, h, d)), ('p', (2 * s, h * d)),
      ('w_kr', (h * d, h, d)), ('w_qr', (h * d, h, d)))}
  mask = np.ones((b, n, m), bool)
  cot = rng.normal(size=(b, n, h, d))

  def loss64(y):
    return float(np.sum(_loop(y['q'], y['k'], y['v'], y['p'], y['w_kr'], y['w_qr'], mask, 1, s,
                              top, loop_softmax)[0] * cot))

  def loss32(y):
    out = deberta_attention(y['q'], y['k'], y['v'], y['p'], y['w_kr'], y['w_qr'], q_offset=1,
                            position_buckets=s, max_relative_positions=top)
    return jnp.sum(out * cot)

  grads = jax.grad(loss32)({key: jnp.asarray(v, jnp.float32) for key, v in x.items()})
  eps = 1e-5
  for name, value in x.items():
    for index in np.ndindex(value.shape):
      up, down = dict(x), dict(x)
      up[name], down[name] = value.copy(), value.copy()
      up[name][index] += eps
      down[name][index] -= eps
      want = (loss64(up) - loss64(down)) / (2 * eps)
      assert float(grads[name][index]) == pytest.approx(want, abs=2e-3, rel=2e-3), (name, index)


DOCUMENTS = np.array([[0] * 14 + [1] * 19, [0] * 33])
VALID = np.ones((2, 33), bool)
VALID[1, 27:] = False  # padding: row 1's last queries see no key, and no key sees them

# The fused kernel's cases: (n, m, q_offset, p2c_row, mask); s = 4 and max 9
# put log buckets and the clamp inside its blocks of 16 (pallas_gpu.BLOCK).
FUSED = {
    'causal, segments, padding': (33, 33, 0, 'released', masks.causal() & masks.key_padding(VALID)
                                  & masks.segments(DOCUMENTS, DOCUMENTS)
                                  & masks.query_padding(VALID)),
    "decoding offset, key padding, the paper's p2c row": (
        9, 33, 20, 'paper', masks.causal() & masks.key_padding(VALID)),
}


@pytest.mark.parametrize('case', FUSED)
def test_the_fused_kernel_equals_the_paper_formula_forward_and_gradients(
    case, loop_softmax, monkeypatch, gradients_match_the_loop):
  """attend(kernel='pallas') (interpreted, blocks of 16: c2p a per-query
  lookup, p2c a per-key one) against eq. 4's float64 loop with one
  key/value head for two query heads: the output, and the gradients of q,
  k, v, P and both projections along random directions against the loop's
  central differences."""
  monkeypatch.setattr(pallas_gpu, 'BLOCK', 16)
  n, m, q_offset, p2c_row, mask = FUSED[case]
  b, h, d, s, top = 2, 2, 4, 4, 9
  rng = np.random.default_rng(5)
  shapes = [(b, n, h, d), (b, m, 1, d), (b, m, 1, d), (2 * s, h * d), (h * d, h, d), (h * d, h, d)]
  args = [rng.normal(size=shape) / (3 if i > 3 else 1) for i, shape in enumerate(shapes)]
  visible = np.asarray(masks.as_dense(mask, b, 1, n, m, q_offset))
  visible = np.broadcast_to(visible, (b, 1, n, m))[:, 0]
  options = dict(position_buckets=s, max_relative_positions=top, p2c_row=p2c_row)
  cot = rng.normal(size=(b, n, h, d))

  def loop(q, k, v, p, w_kr, w_qr):
    return _loop(q, np.repeat(k, h, 2), np.repeat(v, h, 2), p, w_kr, w_qr, visible, q_offset, s,
                 top, loop_softmax, p2c_row)[0]

  def fused(q, k, v, p, w_kr, w_qr):
    out = attend(q, k, v, scheme='deberta', kernel='pallas', mask=mask, q_offset=q_offset,
                 options=options, params={'rel_embeddings': p, 'position_key_kernel': w_kr,
                                          'position_query_kernel': w_qr})
    return jnp.sum(out * cot), out

  grads, out = jax.grad(fused, argnums=tuple(range(6)), has_aux=True)(
      *(jnp.asarray(x, jnp.float32) for x in args))
  np.testing.assert_allclose(np.asarray(out), loop(*args), atol=2e-5)
  gradients_match_the_loop(loop, args, grads, cot, case)
