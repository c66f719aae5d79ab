"""train_and_evaluate(config, workdir): the one training loop, top to bottom."""
from __future__ import annotations

import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from flaxformer_lite import config as config_lib
from flaxformer_lite import data, models
from flaxformer_lite.train import checkpoints, metrics as metrics_lib, preemption, schedules, steps
from flaxformer_lite.train import state as state_lib


log = logging.getLogger('flaxformer_lite')


class NonFiniteLossError(RuntimeError):
  """The loss became NaN/inf; main.py exits with code 3."""


def _check_finite(loss: float, step: int, ckpt):
  if not np.isfinite(loss):
    ckpt.manager.wait_until_finished()  # an earlier async save completes; none follows
    raise NonFiniteLossError(
        f'loss is {loss} by step {step}; the last good checkpoint is step '
        f'{ckpt.latest_step()} in {ckpt.directory} (nothing was saved after it). '
        'Lower train.learning_rate or set train.grad_clip.')


def _summarise(sums) -> dict:
  """Metric sums -> means: loss, nll, perplexity, accuracy (and mean grad_norm sums)."""
  tokens = max(float(sums['tokens']), 1.0)
  out = {'loss': float(sums['loss']) / tokens, 'nll': float(sums['nll']) / tokens,
         'accuracy': float(sums['correct']) / tokens}
  out['perplexity'] = float(np.exp(min(out['nll'], 50.0)))
  if 'grad_norm' in sums:
    out['grad_norm'] = float(sums['grad_norm'])
  return out


def _fmt_time(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else \
      f'{seconds // 60}m{seconds % 60:02d}s'


def _prepare_workdir(config, workdir):
  """Writes config.json; a resumed run must match the saved one (exit 2 if not)."""
  path = os.path.join(workdir, 'config.json')
  try:  # before any compilation: a workdir that cannot be written fails now, not at the first save
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, '.write_test'), 'w') as f:
      f.write('ok')
    os.remove(os.path.join(workdir, '.write_test'))
  except OSError as e:
    raise config_lib.ConfigError(
        f'workdir {workdir} cannot be written ({type(e).__name__}: {e}); '
        'choose another --workdir') from None
  if os.path.exists(path):
    with open(path) as f:
      saved = config_lib.from_json(f.read())
    diffs = config_lib.differences(saved, config)
    if diffs:
      raise config_lib.ConfigError(
          f'workdir {workdir} holds a run with a different config; resuming it '
          f'would mix two experiments. Differences (saved -> new): {"; ".join(diffs)}. '
          'Use another --workdir, or the saved values.')
  if jax.process_index() == 0:
    with open(path + '.tmp', 'w') as f:
      f.write(config_lib.to_json(config))
    os.replace(path + '.tmp', path)


class Evaluator:
  """Teacher-forced metrics and greedy-decoding accuracy over whole splits."""

  def __init__(self, config, model, batch_sharding):
    self.config, self.batch_sharding = config, batch_sharding
    self.step = jax.jit(functools.partial(
        steps.eval_and_predict_step, model=model,
        decode_model=models.build(config.model, decode=True),
        label_smoothing=config.train.label_smoothing))

  def __call__(self, params, arrays, *, log_examples=0) -> dict:
    sums, examples = None, []
    for batch in data.eval_batches(arrays, self.config.eval.batch_size):
      batch = jax.device_put(batch, self.batch_sharding)
      s, predicted = self.step(params, batch)
      sums = s if sums is None else _add(sums, s)
      for i in range(min(log_examples - len(examples), int(s['sequences']))):
        examples.append((batch['inputs'][i], batch['targets'][i], predicted[i]))
    out = _summarise(sums)
    out['sequence_accuracy'] = float(sums['decoded_correct']) / max(float(sums['sequences']), 1.0)
    for inputs, targets, predicted in examples:
      log.info('  input %s\n  target %s\n  decoded %s', _tokens(inputs),
               _tokens(targets), _tokens(predicted))
    return out


_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))


def _tokens(ids) -> str:
  return ' '.join(str(int(t)) for t in ids if t != models.PAD_ID)


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains config.train.num_steps steps (resuming from the newest checkpoint
  in workdir), evaluates, and returns the final metrics by split."""
  config_lib.validate(config)
  dataset = data.load(config.data)
  with config.unlocked():
    if not config.model.vocab_size:
      config.model.vocab_size = dataset.vocab_size
  if config.model.vocab_size < dataset.vocab_size:
    raise config_lib.ConfigError(
        f'model.vocab_size={config.model.vocab_size} is smaller than the dataset '
        f'vocabulary ({dataset.vocab_size}); use 0 (automatic) or >= {dataset.vocab_size}')
  _prepare_workdir(config, workdir)

  mesh = jax.make_mesh((jax.device_count(),), ('data',),
                       axis_types=(jax.sharding.AxisType.Auto,))
  batch_sharding = NamedSharding(mesh, P('data'))
  replicated = NamedSharding(mesh, P())

  t = config.train
  model = models.build(config.model)
  train_iter = data.Batches(dataset.splits['train'], t.batch_size, seed=config.seed,
                            process_index=jax.process_index(),
                            process_count=jax.process_count())
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  example = {k: v[:1] for k, v in dataset.splits['train'].items()}
  state = jax.device_put(state_lib.create(model, config, example, init_rng), replicated)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))

  ckpt = checkpoints.Checkpointer(workdir, t.keep_checkpoints)
  start = 0
  if ckpt.latest_step() is not None:
    try:
      state, data_state = ckpt.restore(state)
    except checkpoints.CheckpointError:
      ckpt.close()
      raise
    train_iter.set_state(data_state)
    start = int(state.step)
    log.info('Resumed from %s at step %d', ckpt.directory, start)
  writer = metrics_lib.MetricWriter(workdir, start)
  evaluate = Evaluator(config, model, batch_sharding)

  train_step = jax.jit(
      functools.partial(steps.train_step, label_smoothing=t.label_smoothing,
                        skip_nonfinite=t.skip_nonfinite),
      donate_argnums=(0,))
  schedule = schedules.create(t, config.model.d_model)
  log.info('Model %s, %s parameters, attention=%s; training steps %d..%d, '
               'batch %d on %d device(s)', config.model.type, f'{num_params:,}',
               config.model.attention, start, t.num_steps, t.batch_size,
               jax.device_count())

  window, window_start, window_steps = None, time.time(), 0
  train_start, results = time.time(), {}
  with preemption.Preemption() as preempt:
    for step in range(start, t.num_steps):
      batch = jax.make_array_from_process_local_data(batch_sharding, next(train_iter))
      state, sums = train_step(state, batch, dropout_rng)
      window = sums if window is None else _add(window, sums)
      window_steps += 1
      done = step + 1
      if done % t.log_every == 0 or done == t.num_steps:
        m = _summarise(window)
        m['grad_norm'] /= window_steps
        _check_finite(m['loss'], done, ckpt)
        if 'skipped' in window:
          m['skipped_steps'] = int(window['skipped'])
          if m['skipped_steps']:
            log.warning('skipped %d of the last %d steps: non-finite loss or gradients',
                        m['skipped_steps'], window_steps)
        elapsed = time.time() - window_start
        m['steps_per_sec'] = window_steps / elapsed
        m['learning_rate'] = float(schedule(step))
        writer.write(done, 'train', m)
        eta = (t.num_steps - done) / m['steps_per_sec']
        log.info('step %d/%d  loss %.4f  acc %.3f  lr %.2e  %.1f steps/s  ETA %s',
                 done, t.num_steps, m['loss'], m['accuracy'], m['learning_rate'],
                 m['steps_per_sec'], _fmt_time(eta))
        window, window_start, window_steps = None, time.time(), 0
      if done % t.eval_every == 0 or done == t.num_steps:
        eval_start = time.time()
        results['eval'] = evaluate(state.params, dataset.splits['validation'],
                                   log_examples=config.eval.num_examples_to_log)
        writer.write(done, 'eval', results['eval'])
        log.info('eval at step %d: loss %.4f  accuracy %.4f  sequence_accuracy %.4f '
                 '(%.1fs)', done, results['eval']['loss'], results['eval']['accuracy'],
                 results['eval']['sequence_accuracy'], time.time() - eval_start)
        window_start += time.time() - eval_start
      if (done % t.checkpoint_every == 0 or done == t.num_steps
          or preempt.requested):
        if window is not None:  # steps since the last log: never save a non-finite state
          _check_finite(_summarise(window)['loss'], done, ckpt)
        ckpt.save(done, state, train_iter.get_state())
      if preempt.requested:
        ckpt.close()
        writer.close()
        log.warning('Stopped on %s at step %d of %d; checkpoint saved in %s. Re-run the '
                    'same command to resume.', preempt.requested, done, t.num_steps,
                    ckpt.directory)
        return {'preempted': preempt.requested, 'step': done, **results}

  train_time = time.time() - train_start
  if 'eval' not in results:  # resumed a finished run
    results['eval'] = evaluate(state.params, dataset.splits['validation'])
  if config.eval.final_test:
    test = evaluate(state.params, dataset.splits['test'])
    long = evaluate(state.params, dataset.splits['test_long'])
    results['test'] = {**test, **{f'long_{k}': v for k, v in long.items()}}
    writer.write(t.num_steps, 'test', results['test'])
  ckpt.close()
  writer.close()

  log.info('Done: %d steps in %s (this run: %d steps). Results by split:',
               t.num_steps, _fmt_time(train_time), t.num_steps - start)
  for split, m in results.items():
    log.info('  %-5s %s', split, '  '.join(f'{k} {v:.4f}' for k, v in sorted(m.items())))
  results['train_seconds'] = train_time
  results['num_params'] = num_params
  return results
