"""Shared scalar references for the attention-variant tests: loops over
(batch, head, query, key) for a dot-product score plus a bias and for any
score, T5's bucket of one offset, and a gradient held to central
differences of a loop."""
import math

import numpy as np
import pytest


def _loop_attention(q, k, v, bias_fn, mask=None):
  """softmax_j(q_i.k_j / sqrt(d) + bias_fn(h, i, j)) over visible j, then sum_j w v_j."""
  b, n, h, d = q.shape
  m = k.shape[1]
  mask = np.ones((b, h, n, m), bool) if mask is None else np.broadcast_to(mask, (b, h, n, m))
  out = np.zeros((b, n, h, d))
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        visible = [j for j in range(m) if mask[bi, hi, i, j]]
        logits = [float(np.dot(q[bi, i, hi].astype(np.float64), k[bi, j, hi]))
                  / math.sqrt(d) + bias_fn(hi, i, j) for j in visible]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        for j, e in zip(visible, exps):
          out[bi, i, hi] += e / sum(exps) * v[bi, j, hi]
  return out


@pytest.fixture
def loop_attention():
  """loop_attention(q, k, v, bias_fn, mask=None): the slow reference, python loops."""
  return _loop_attention


def _loop_softmax(logit, v, mask):
  """Float64 (out [b, n, h, dv], weights [b, h, n, m]): softmax over the visible
  keys (mask bool [b, n, m]) of logit(batch, head, i, j), then sum_j w v_j; a
  query that sees no key weighs every key alike (the project's rule)."""
  b, n, m = mask.shape
  h = v.shape[2]
  weights = np.zeros((b, h, n, m))
  out = np.zeros((b, n, h, v.shape[3]))
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        logits = np.array([logit(bi, hi, i, j) for j in range(m)])
        visible = mask[bi, i]
        if visible.any():
          e = np.where(visible, np.exp(logits - logits[visible].max()), 0.0)
          weights[bi, hi, i] = e / e.sum()
        else:
          weights[bi, hi, i] = 1.0 / m
        out[bi, i, hi] = weights[bi, hi, i] @ v[bi, :, hi]
  return out, weights


@pytest.fixture
def loop_softmax():
  """loop_softmax(logit, v, mask) -> (out, weights): the slow reference for any score."""
  return _loop_softmax


def _ref_bucket(rel, bidirectional, num_buckets, max_distance):
  """mesh_tensorflow.transformer.transformer_layers._relative_position_bucket
  over one python int (key_pos - query_pos), with math.log."""
  ret = 0
  n = -rel
  if bidirectional:
    num_buckets //= 2
    if n < 0:
      ret += num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                          * (num_buckets - max_exact))
  return ret + min(large, num_buckets - 1)


@pytest.fixture
def t5_ref_bucket():
  """t5_ref_bucket(rel, bidirectional, num_buckets, max_distance): T5's bucket, scalar reference."""
  return _ref_bucket



def _gradients_match_the_loop(loop, args, grads, cot, what):
  """Each grads[i] (of sum(out * cot) w.r.t. args[i]) along a random
  direction equals the central difference of sum(loop(*args) * cot)."""
  for i, (x, grad) in enumerate(zip(args, grads)):
    direction = np.random.default_rng(10 + i).normal(size=np.shape(x))
    shift = lambda t: np.sum(loop(*args[:i], x + t * direction, *args[i + 1:]) * cot)  # noqa: E731
    want = (shift(1e-4) - shift(-1e-4)) / 2e-4
    np.testing.assert_allclose(np.sum(np.asarray(grad, np.float64) * direction), want,
                               rtol=1e-3, atol=1e-3, err_msg=f'{what}: argument {i}')


@pytest.fixture
def gradients_match_the_loop():
  """gradients_match_the_loop(loop, args, grads, cot, what): each gradient
  along a random direction against the loop's central difference."""
  return _gradients_match_the_loop
