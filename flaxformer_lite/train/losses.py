"""Token-level losses and metrics; padding (weight 0) is excluded."""
from __future__ import annotations

import jax.numpy as jnp
import optax


def cross_entropy(logits, targets, weights, label_smoothing: float = 0.0):
  """Label-smoothed cross-entropy summed over weighted tokens.

  logits [b, n, V], targets [b, n] int, weights [b, n] (0 on padding).
  The smoothed target puts 1 - label_smoothing on the true token and spreads
  label_smoothing uniformly over all V tokens (optax.smooth_labels), as in
  Szegedy et al. 2016.
  Returns (sum of weighted losses, sum of weights).
  """
  vocab = logits.shape[-1]
  labels = optax.smooth_labels(jnp.eye(vocab, dtype=jnp.float32)[targets], label_smoothing)
  loss = optax.softmax_cross_entropy(logits.astype(jnp.float32), labels)
  return jnp.sum(loss * weights), jnp.sum(weights)


def token_metrics(logits, targets, weights, label_smoothing: float = 0.0):
  """Sums for loss (smoothed), nll (unsmoothed), correct tokens, tokens,
  correct sequences, sequences. Divide sums at logging time."""
  loss, denom = cross_entropy(logits, targets, weights, label_smoothing)
  nll, _ = cross_entropy(logits, targets, weights, 0.0)
  correct = (jnp.argmax(logits, -1) == targets) * weights
  has_tokens = jnp.sum(weights, -1) > 0
  seq_correct = jnp.all((correct > 0) | (weights == 0), axis=-1) & has_tokens
  return {'loss': loss, 'nll': nll, 'correct': jnp.sum(correct), 'tokens': denom,
          'seq_correct': jnp.sum(seq_correct), 'sequences': jnp.sum(has_tokens)}
