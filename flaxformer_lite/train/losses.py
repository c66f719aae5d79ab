"""Token-level losses and metrics; padding (weight 0) is excluded."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _per_token(logits, targets, label_smoothing: float):
  """(smoothed loss, nll), each [b, n], from one log-softmax.

  The smoothed target puts 1 - label_smoothing on the true token and spreads
  label_smoothing uniformly over all V tokens (Szegedy et al. 2016; what
  optax.smooth_labels builds), so its cross-entropy is
  (1 - ls) * nll + ls * mean_v(-log p_v): no [b, n, V] one-hot is built.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if not label_smoothing:
    return nll, nll
  return (1.0 - label_smoothing) * nll - label_smoothing * jnp.mean(logp, axis=-1), nll


def cross_entropy(logits, targets, weights, label_smoothing: float = 0.0):
  """Label-smoothed cross-entropy summed over weighted tokens.

  logits [b, n, V], targets [b, n] int, weights [b, n] (0 on padding).
  Returns (sum of weighted losses, sum of weights).
  """
  loss, _ = _per_token(logits, targets, label_smoothing)
  return jnp.sum(loss * weights), jnp.sum(weights)


def token_metrics(logits, targets, weights, label_smoothing: float = 0.0):
  """Sums for loss (smoothed), nll (unsmoothed), correct tokens, tokens,
  correct sequences, sequences. Divide sums at logging time."""
  loss, nll = _per_token(logits, targets, label_smoothing)
  correct = (jnp.argmax(logits, -1) == targets) * weights
  has_tokens = jnp.sum(weights, -1) > 0
  seq_correct = jnp.all((correct > 0) | (weights == 0), axis=-1) & has_tokens
  return {'loss': jnp.sum(loss * weights), 'nll': jnp.sum(nll * weights),
          'correct': jnp.sum(correct), 'tokens': jnp.sum(weights),
          'seq_correct': jnp.sum(seq_correct), 'sequences': jnp.sum(has_tokens)}
