"""Shared scalar references for the attention-variant tests: a loop over
(batch, head, query, key) and T5's bucket of one offset."""
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
