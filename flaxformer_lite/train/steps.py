"""Pure step functions: (state, batch, rng) -> (state, metrics); jit them outside.

The objective follows the model type (OBJECTIVES):
  seq2seq  batch {'inputs', 'targets'}: teacher-forced decoder on shift_right(targets)
           (packed rows: also segmentation and positions, data.pack);
  lm       batch {'inputs', 'targets' = next tokens}: a causal LM on inputs;
  mlm      batch {'inputs'}: BERT's masked LM, masks drawn inside the step
           (data/masking.py); loss on the masked positions only;
  classify batch {'inputs', 'inputs_b', 'targets' = the class [b, 1]}: the
           two-stream classifier, scored as one token per row (an all-PAD
           row, padding the batch, weighs nothing).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite import decoding
from flaxformer_lite.data import masking
from flaxformer_lite.model_types import MODEL_TYPES
from flaxformer_lite.tokens import EOS_ID, PAD_ID, shift_right
from flaxformer_lite.train import losses

OBJECTIVES = {name: t.objective for name, t in MODEL_TYPES.items()}


def forward(apply_fn, params, batch, *, objective: str, deterministic: bool = True,
            rng=None, mlm_rate: float = 0.15, vocab_size: int = 0, data_vocab_size: int = 0,
            mask_id: int = 0, lm_mask=None):
  """-> (logits [b, n, V], targets [b, n], weights [b, n] float, 0 = not scored);
  classify: n = 1 and V = the classes.

  rng: dropout (when not deterministic) and, for mlm, the masks.
  vocab_size: mlm only, the model's vocabulary (its last id is [MASK] unless
    mask_id says otherwise).
  data_vocab_size: mlm only, the ids the data uses (random replacements are
    drawn from them); 0 = every id below [MASK]. A model.vocab_size set
    larger than the data's leaves ids no data token has.
  mask_id: mlm only, the tokenizer's own [MASK] id (a pretrained BERT's); 0 =
    the model's last id.
  lm_mask: lm only, the model's mask in place of the causal rule
    (models.model_mask: prefix-LM), or None. A position that sees the token
    it predicts (query i, key i + 1) is not scored: its loss would be a copy.
  """
  rngs = None if deterministic else {'dropout': jax.random.fold_in(rng, 0)}
  if objective == 'mlm':
    mask_id = mask_id or vocab_size - 1
    inputs, targets, weights = masking.mask_tokens(
        jax.random.fold_in(rng, 1), batch['inputs'], vocab_size=data_vocab_size or mask_id,
        mask_id=mask_id, rate=mlm_rate)
    logits = apply_fn({'params': params}, inputs, deterministic=deterministic, rngs=rngs)
    return logits, targets, weights.astype(jnp.float32)
  targets = batch['targets']
  if objective == 'classify':
    logits = apply_fn({'params': params}, batch['inputs'], batch['inputs_b'],
                      deterministic=deterministic, rngs=rngs)[:, None]  # [b, 1, C]
    return logits, targets, jnp.any(batch['inputs'] != PAD_ID, axis=1, keepdims=True
                                    ).astype(jnp.float32)
  if objective == 'seq2seq':
    packed = {k: batch[k] for k in ('inputs_segmentation', 'targets_segmentation',
                                    'inputs_positions', 'targets_positions') if k in batch}
    decoder_inputs = shift_right(targets, segmentation=packed.get('targets_segmentation'))
    logits = apply_fn({'params': params}, batch['inputs'], decoder_inputs,
                      deterministic=deterministic, rngs=rngs, **packed)
  else:
    logits = apply_fn({'params': params}, batch['inputs'], deterministic=deterministic,
                      rngs=rngs)
  weights = targets != PAD_ID
  if lm_mask is not None:
    rows, i = jnp.arange(targets.shape[0])[:, None], jnp.arange(targets.shape[1])[None, :]
    weights = weights & ~lm_mask(rows, 0, i, i + 1)
  return logits, targets, weights.astype(jnp.float32)


def train_step(state, batch, rng, *, label_smoothing: float, skip_nonfinite: bool = False,
               objective: str = 'seq2seq', mlm_rate: float = 0.15, vocab_size: int = 0,
               data_vocab_size: int = 0, mask_id: int = 0, grad_accum_steps: int = 1,
               axis_name: str | None = None, lm_mask=None):
  """One optimizer update on the global batch.

  The gradient is that of (sum of token losses) / (number of tokens) over the
  whole global batch, however it is split:
    grad_accum_steps k > 1: k microbatches in a lax.scan (rows j, j+k, ...
      form microbatch j, so each device keeps its own rows), their gradient
      and metric sums added, then divided once by the total token count;
    axis_name (jax.pmap): the sums are psum-med over devices before that
      division (a pmean of per-device means would weigh devices with fewer
      tokens too much).
  Dropout (and mlm masks) draw from fold_in(rng, step), then per microbatch
  and per device, so a resumed run draws the same numbers as an
  uninterrupted one.

  skip_nonfinite: when the loss or any gradient is NaN/inf, keep params and
  optimizer state as they were (the step counter still advances: the batch
  is consumed), zero this step's metric sums and count it in sums['skipped'].
  """
  step_rng = jax.random.fold_in(rng, state.step)
  if axis_name is not None:
    step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axis_name))

  def grads_and_sums(params, batch, rng):
    def loss_fn(params):
      logits, targets, weights = forward(
          state.apply_fn, params, batch, objective=objective, deterministic=False,
          rng=rng, mlm_rate=mlm_rate, vocab_size=vocab_size, data_vocab_size=data_vocab_size,
          mask_id=mask_id, lm_mask=lm_mask)
      sums = losses.token_metrics(logits, targets, weights, label_smoothing)
      return sums['loss'], sums
    return jax.grad(loss_fn, has_aux=True)(params)

  if grad_accum_steps == 1:
    grads, sums = grads_and_sums(state.params, batch, step_rng)
  else:
    k = grad_accum_steps
    micro = jax.tree.map(lambda x: x.reshape((-1, k) + x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(total, i_and_batch):
      i, mb = i_and_batch
      g, s = grads_and_sums(state.params, mb, jax.random.fold_in(step_rng, i))
      return jax.tree.map(jnp.add, total, (g, s)), None

    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        grads_and_sums, state.params, jax.tree.map(lambda x: x[0], micro), step_rng))
    (grads, sums), _ = jax.lax.scan(accumulate, zero, (jnp.arange(k), micro))
  if axis_name is not None:
    grads, sums = jax.lax.psum((grads, sums), axis_name)
  grads = jax.tree.map(lambda g: g / jnp.maximum(sums['tokens'], 1.0), grads)
  new_state = state.apply_gradients(grads=grads)
  sums['grad_norm'] = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
  if skip_nonfinite:
    ok = jnp.isfinite(sums['loss']) & jnp.isfinite(sums['grad_norm'])
    kept = state.replace(step=state.step + 1)
    new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, kept)
    sums = jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), sums)
    sums['skipped'] = jnp.where(ok, 0, 1)
  return new_state, sums


def eval_step(params, batch, rng=None, *, apply_fn, label_smoothing: float,
              objective: str = 'seq2seq', mlm_rate: float = 0.15, vocab_size: int = 0,
              data_vocab_size: int = 0, mask_id: int = 0, row_scores: bool = False,
              lm_mask=None):
  """Teacher-forced metric sums on one batch (PAD rows weigh nothing).
  rng: the mlm masks (fixed per batch, so every eval scores the same masks).

  row_scores: also, per row, (answer tokens whose argmax is right [b],
  answer tokens [b], every target token right [b] bool), the answer being
  the target without its EOS. A row with every token right is greedy
  decoding's exact match, for a target that is one fixed sequence: if each
  argmax given the true prefix is the true token, greedy decoding follows
  the true prefix throughout, and conversely; one parallel pass instead of
  a decode step per token.
  """
  logits, targets, weights = forward(apply_fn, params, batch, objective=objective,
                                     rng=rng, mlm_rate=mlm_rate, vocab_size=vocab_size,
                                     data_vocab_size=data_vocab_size, mask_id=mask_id,
                                     lm_mask=lm_mask)
  sums = losses.token_metrics(logits, targets, weights, label_smoothing)
  if not row_scores:
    return sums
  scored = weights > 0
  right = jnp.argmax(logits, axis=-1) == targets
  answer = scored & (targets != EOS_ID)
  return sums, ((right & answer).sum(axis=1), answer.sum(axis=1),
                jnp.all(right | ~scored, axis=1))


def decode_step(params, inputs, *, model, decode_model, max_len: int, beam_size: int = 1,
                alpha: float = 0.6):
  """Greedy (beam_size 1) or beam decoding: inputs [b, m] -> tokens [b, max_len]."""
  if beam_size == 1:
    return decoding.greedy_translate(model, decode_model, params, inputs, max_len)
  return decoding.beam_translate(model, decode_model, params, inputs, max_len,
                                 beam_size=beam_size, alpha=alpha)
