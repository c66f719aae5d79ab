"""Shared loop reference for the attention-variant tests."""
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
