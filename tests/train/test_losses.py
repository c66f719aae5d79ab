"""Label-smoothed cross-entropy and metrics against loop formulas."""
import math

import jax.numpy as jnp
import numpy as np

from flaxformer_lite import models
from flaxformer_lite.train import losses, steps


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


def test_gradient_and_jvp_match_finite_differences_of_the_loop():
  # The loss's derivative is written by hand (losses._token_losses): reverse
  # and forward mode against central differences of the loop formula, in
  # float64, with padding, for the smoothed loss and for the plain nll.
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = np.array([[3, 1, 0], [4, 2, 2]])
  weights = (targets > 0).astype(np.float32)
  direction = rng.normal(size=logits.shape).astype(np.float32)
  for alpha, key in ((0.1, 'loss'), (0.0, 'loss'), (0.1, 'nll')):
    ref_alpha = 0.0 if key == 'nll' else alpha

    def ref(x):
      return _reference_loss(x, targets, weights, ref_alpha)[0]

    want = np.zeros(logits.shape)
    for idx in np.ndindex(logits.shape):
      hi, lo = logits.astype(np.float64), logits.astype(np.float64)
      hi[idx] += 1e-6
      lo[idx] -= 1e-6
      want[idx] = (ref(hi) - ref(lo)) / 2e-6

    def f(x):
      return losses.token_metrics(x, jnp.asarray(targets), jnp.asarray(weights), alpha)[key]

    got = jax.grad(f)(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=f'{key} ls={alpha}')
    _, tangent = jax.jvp(f, (jnp.asarray(logits),), (jnp.asarray(direction),))
    np.testing.assert_allclose(float(tangent), float(np.sum(want * direction)), rtol=1e-4,
                               atol=1e-5)


def test_a_prefix_lm_scores_no_position_that_sees_the_token_it_predicts():
  """With model.mask='prefix_lm' (prefix_len 3), position i predicts token
  i + 1 and sees it while i + 1 < 3: positions 0 and 1 weigh 0, the rest as
  without the mask (padding 0)."""
  targets = jnp.array([[5, 6, 7, 8, 9, 0], [4, 4, 4, 4, 0, 0]])
  batch = {'inputs': targets, 'targets': targets}
  logits = lambda variables, ids, **kw: jnp.zeros(ids.shape + (10,))  # noqa: E731
  mask = models.model_mask({'mask': 'prefix_lm', 'mask_kwargs': {'prefix_len': 3}})
  _, _, plain = steps.forward(logits, {}, batch, objective='lm')
  _, _, weights = steps.forward(logits, {}, batch, objective='lm', lm_mask=mask)
  np.testing.assert_array_equal(plain, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(weights, [[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
