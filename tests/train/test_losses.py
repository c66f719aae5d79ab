"""Label-smoothed cross-entropy and metrics against loop formulas."""
import math

import numpy as np

from flaxformer_lite.train import losses


def _reference_loss(logits, targets, weights, alpha):
  total, denom = 0.0, 0.0
  b, n, v = logits.shape
  for i in range(b):
    for j in range(n):
      if weights[i, j] == 0:
        continue
      row = logits[i, j].astype(np.float64)
      logz = math.log(sum(math.exp(x - row.max()) for x in row)) + row.max()
      for k in range(v):
        q = (1 - alpha) * (k == targets[i, j]) + alpha / v
        total -= weights[i, j] * q * (row[k] - logz)
      denom += weights[i, j]
  return total, denom


def test_cross_entropy_matches_loop_formula_and_excludes_padding():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 4, 6)).astype(np.float32)
  targets = np.array([[3, 1, 0, 0], [5, 2, 4, 0]])
  weights = (targets > 0).astype(np.float32)
  for alpha in (0.0, 0.1):
    loss, denom = losses.cross_entropy(logits, targets, weights, alpha)
    ref_loss, ref_denom = _reference_loss(logits, targets, weights, alpha)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert float(denom) == ref_denom == 5
  # changing logits at padded positions changes nothing
  logits2 = logits.copy()
  logits2[0, 2:] += 7.0
  np.testing.assert_allclose(float(losses.cross_entropy(logits2, targets, weights, 0.1)[0]),
                             float(losses.cross_entropy(logits, targets, weights, 0.1)[0]))


def test_token_and_sequence_accuracy_by_hand():
  v = 5
  targets = np.array([[3, 4, 2, 0], [3, 3, 2, 0], [0, 0, 0, 0]])
  predicted = np.array([[3, 4, 2, 1], [3, 4, 2, 0], [1, 1, 1, 1]])  # row 0 right, row 1 one miss
  logits = np.eye(v, dtype=np.float32)[predicted] * 10
  weights = (targets > 0).astype(np.float32)
  m = losses.token_metrics(logits, targets, weights)
  assert float(m['tokens']) == 6 and float(m['correct']) == 5
  assert float(m['seq_correct']) == 1 and float(m['sequences']) == 2
