"""Pure step functions: (state, batch, rng) -> (state, metrics); jit them outside."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite import decoding
from flaxformer_lite.models import PAD_ID, shift_right
from flaxformer_lite.train import losses


def train_step(state, batch, rng, *, label_smoothing: float, skip_nonfinite: bool = False):
  """One optimizer update. Dropout draws from fold_in(rng, step), so a resumed
  run draws the same numbers as an uninterrupted one.

  skip_nonfinite: when the loss or any gradient is NaN/inf, keep params and
  optimizer state as they were (the step counter still advances: the batch
  is consumed), zero this step's metric sums and count it in sums['skipped'].
  """
  inputs, targets = batch['inputs'], batch['targets']
  weights = (targets != PAD_ID).astype(jnp.float32)
  dropout_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, inputs, shift_right(targets),
                            deterministic=False, rngs={'dropout': dropout_rng})
    sums = losses.token_metrics(logits, targets, weights, label_smoothing)
    return sums['loss'] / jnp.maximum(sums['tokens'], 1.0), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  sums['grad_norm'] = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
  if skip_nonfinite:
    ok = jnp.isfinite(sums['loss']) & jnp.isfinite(sums['grad_norm'])
    kept = state.replace(step=state.step + 1)
    new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, kept)
    sums = jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), sums)
    sums['skipped'] = jnp.where(ok, 0, 1)
  return new_state, sums


def eval_step(params, batch, *, apply_fn, label_smoothing: float):
  """Teacher-forced metric sums on one batch (PAD rows weigh nothing)."""
  targets = batch['targets']
  weights = (targets != PAD_ID).astype(jnp.float32)
  logits = apply_fn({'params': params}, batch['inputs'], shift_right(targets))
  return losses.token_metrics(logits, targets, weights, label_smoothing)


def eval_and_predict_step(params, batch, *, model, decode_model, label_smoothing: float):
  """Teacher-forced sums plus greedy decoding of the batch.

  Returns (sums with 'decoded_correct' = exactly decoded sequences,
  predicted tokens [b, n] with n the target length).
  """
  sums = eval_step(params, batch, apply_fn=model.apply, label_smoothing=label_smoothing)
  targets = batch['targets']
  predicted = decoding.greedy_translate(model, decode_model, params, batch['inputs'],
                                        targets.shape[1])
  real = jnp.any(targets != PAD_ID, axis=-1)
  sums['decoded_correct'] = jnp.sum(jnp.all(predicted == targets, axis=-1) & real)
  return sums, predicted
