"""Token-level losses and metrics; padding (weight 0) is excluded."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _token_losses(logits, targets, label_smoothing: float):
  """(smoothed loss, nll), each [...], of float32 logits [..., V] and int targets [...].

  The smoothed target puts 1 - ls on the true token and spreads ls uniformly
  over all V tokens (Szegedy et al. 2016; what optax.smooth_labels builds),
  so with lse = logsumexp(logits):
    nll  = lse - logits[target],
    loss = (1 - ls) * nll + ls * mean_v(-log p_v) = lse - (1 - ls) * logits[target] - ls * mean(logits).
  No [..., V] one-hot or log-probabilities are built. The derivative is
  written out (below): d loss / d logits = softmax - smoothed target, one
  pass over [..., V] in the backward step: with a large vocabulary, the
  step's largest array.
  """
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = lse - target_logit
  if not label_smoothing:
    return nll, nll
  return lse - (1.0 - label_smoothing) * target_logit - label_smoothing * jnp.mean(logits, -1), nll


@_token_losses.defjvp
def _token_losses_jvp(label_smoothing, primals, tangents):
  logits, targets = primals
  dlogits, _ = tangents
  loss, nll = _token_losses(logits, targets, label_smoothing)
  p = jnp.exp(logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))  # softmax
  is_target = jnp.arange(logits.shape[-1]) == targets[..., None]  # [..., V], fused, not stored
  d_nll = jnp.sum(jnp.where(is_target, p - 1.0, p) * dlogits, -1)
  smooth = label_smoothing / logits.shape[-1]
  d_loss = jnp.sum((jnp.where(is_target, p - (1.0 - label_smoothing), p) - smooth) * dlogits, -1)
  return (loss, nll), (d_loss, d_nll)


def _per_token(logits, targets, label_smoothing: float):
  """(smoothed loss, nll), each [b, n]; see _token_losses."""
  return _token_losses(logits.astype(jnp.float32), targets.astype(jnp.int32),
                       float(label_smoothing))


def cross_entropy(logits, targets, weights, label_smoothing: float = 0.0):
  """Label-smoothed cross-entropy summed over weighted tokens.

  logits [b, n, V], targets [b, n] int, weights [b, n] (0 on padding).
  Returns (sum of weighted losses, sum of weights).
  """
  loss, _ = _per_token(logits, targets, label_smoothing)
  return jnp.sum(loss * weights), jnp.sum(weights)


def token_metrics(logits, targets, weights, label_smoothing: float = 0.0):
  """Sums for loss (smoothed), nll (unsmoothed), correct tokens, tokens,
  correct sequences, sequences. Divide sums at logging time.

  A token is correct when its target's logit is the largest (>= every other):
  argmax's answer except on exact ties, without argmax's second pass over
  [b, n, V].
  """
  loss, nll = _per_token(logits, targets, label_smoothing)
  logits = jax.lax.stop_gradient(logits)
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), -1)[..., 0]
  correct = (target_logit >= jnp.max(logits, -1)) * weights
  has_tokens = jnp.sum(weights, -1) > 0
  seq_correct = jnp.all((correct > 0) | (weights == 0), axis=-1) & has_tokens
  return {'loss': jnp.sum(loss * weights), 'nll': jnp.sum(nll * weights),
          'correct': jnp.sum(correct), 'tokens': jnp.sum(weights),
          'seq_correct': jnp.sum(seq_correct), 'sequences': jnp.sum(has_tokens)}
