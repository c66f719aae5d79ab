"""train_and_evaluate(config, workdir): the one training loop, top to bottom."""
from __future__ import annotations

import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxformer_lite import config as config_lib
from flaxformer_lite import data, decoding, models, tokens
from flaxformer_lite.data import tokenizers, validation as data_validation
from flaxformer_lite.train import (checkpoints, metrics as metrics_lib, multihost,
                                   partitioning, preemption, profiling, schedules, steps)
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


def _applied_learning_rate(schedule, opt_state) -> float:
  """The learning rate of the last update: the schedule at the optimizer's
  own count, which stays behind state.step by the steps skipped as non-finite
  (train.skip_nonfinite keeps the optimizer state as it was)."""
  found = optax.tree_utils.tree_get_all_with_path(opt_state, 'count')
  counts = [c for path, c in found if 'Schedule' in str(path[-1])] or [c for _, c in found]
  count = int(np.asarray(counts[0]).reshape(-1)[0]) if counts else 1  # pmap: [devices]
  return float(schedule(max(count - 1, 0)))


def _recorded_results(workdir, step) -> dict:
  """{split: metrics} that metrics.jsonl holds for `step` (eval and test)."""
  if not os.path.exists(os.path.join(workdir, 'metrics.jsonl')):
    return {}
  return {r['split']: {k: v for k, v in r.items() if k not in ('step', 'split')}
          for r in metrics_lib.read(workdir)
          if r['step'] == step and r['split'] in ('eval', 'test')}


def _fmt_metrics(m: dict) -> str:
  return '  '.join(f'{k} {v:.4f}' for k, v in sorted(m.items()))


def _train_batches(config, dataset):
  """The training iterator for the dataset kind and config.train."""
  t, n = config.train, jax.process_count()
  where = dict(process_index=jax.process_index(), process_count=n)
  train = dataset.splits['train']
  if dataset.kind == 'lm':
    return data.LMWindows(train, config.data.max_len, t.batch_size, seed=config.seed, **where)
  if config.data.pack:
    return data.PackedBatches(train, length=train['inputs'].shape[1], seed=config.seed,
                              batch_size=t.batch_size, batch_tokens=t.batch_tokens,
                              row_multiple=jax.local_device_count() * t.grad_accum_steps,
                              **where)
  if t.batch_tokens:
    return data.BucketedBatches(train, t.batch_tokens, seed=config.seed,
                                row_multiple=jax.local_device_count() * t.grad_accum_steps,
                                **where)
  return data.Batches(train, t.batch_size, seed=config.seed, **where)


def _fmt_time(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else \
      f'{seconds // 60}m{seconds % 60:02d}s'


def _prepare_workdir(config, workdir, allow_config_change=False):
  """Writes config.json; a resumed run must match the saved one (exit 2 if
  not, unless allow_config_change: then the differences are logged)."""
  path = os.path.join(workdir, 'config.json')
  try:  # before any compilation: a workdir that cannot be written fails now, not at the first save
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_test.{jax.process_index()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise config_lib.ConfigError(
        f'workdir {workdir} cannot be written ({type(e).__name__}: {e}); '
        'choose another --workdir') from None
  if os.path.exists(path):
    with open(path) as f:
      saved = config_lib.from_json(f.read())
    diffs = config_lib.differences(saved, config)
    if diffs and allow_config_change:
      log.warning('Resuming %s with a changed config (--allow_config_change): %s', workdir,
                  '; '.join(diffs))
    elif diffs:
      raise config_lib.ConfigError(
          f'workdir {workdir} holds a run with a different config; resuming it '
          f'would mix two experiments. Differences (saved -> new): {"; ".join(diffs)}. '
          'Use another --workdir, or the saved values (or --allow_config_change to '
          'resume anyway).')
  if jax.process_index() == 0:
    with open(path + '.tmp', 'w') as f:
      f.write(config_lib.to_json(config))
    os.replace(path + '.tmp', path)


class Evaluator:
  """Whole-split evaluation, by objective.

  seq2seq: teacher-forced loss/perplexity/accuracy, then decoding (greedy, or
    beam search with `beam_size` > 1): sequence_accuracy for token tasks,
    sacreBLEU of the detokenized output against the raw references for text.
  lm: loss, perplexity, bits_per_token (bpc for char/byte tokenizers) over
    the split's non-overlapping windows of data.max_len tokens.
  mlm: loss/accuracy on masked positions; the masks are drawn from a fixed
    key, so every evaluation scores the same ones.
  """

  def __init__(self, config, model, dataset, place_batch=None):
    self.config, self.dataset = config, dataset
    self.place_batch = place_batch or (lambda batch: batch)  # DataParallel.place_eval_batch
    self.objective = steps.OBJECTIVES[config.model.type]
    # Each batch of eval.batch_size examples is padded with weight-0 rows to
    # split over the devices: the metrics do not depend on the device count.
    self.rows = partitioning.padded_rows(config.eval.batch_size, jax.device_count())
    self.metrics_step = jax.jit(functools.partial(
        steps.eval_step, apply_fn=model.apply, label_smoothing=config.train.label_smoothing,
        objective=self.objective, mlm_rate=config.data.mlm_rate,
        vocab_size=config.model.vocab_size, data_vocab_size=dataset.vocab_size))
    self.model, self.decode_model = model, None
    if self.objective != 'mlm':
      self.decode_model = models.build(config.model, decode=True)
    self._decoders, self._arrays = {}, {}

  def arrays(self, split) -> dict:
    """A split as padded arrays (LM streams cut into windows), cached."""
    if split not in self._arrays:
      values = self.dataset.splits[split]
      if self.dataset.kind == 'lm':
        values = data.lm_eval_arrays(values, self.config.data.max_len)
      if self.config.eval.max_examples:
        values = {k: v[:self.config.eval.max_examples] for k, v in values.items()}
      self._arrays[split] = values
    return self._arrays[split]

  def _decoder(self, max_len, beam_size):
    key = (max_len, beam_size)
    if key not in self._decoders:
      self._decoders[key] = jax.jit(functools.partial(
          steps.decode_step, model=self.model, decode_model=self.decode_model,
          max_len=max_len, beam_size=beam_size, alpha=self.config.eval.beam_alpha))
    return self._decoders[key]

  def decode_len(self, arrays) -> int:
    """Tokens to decode: eval.max_decode_len, else the target width for token
    tasks and 1.5 x the source width + 10 for text (within model.max_len for
    learned positions)."""
    e, m = self.config.eval, self.config.model
    if e.max_decode_len:
      return e.max_decode_len
    if self.dataset.tokenizer is None:
      return arrays['targets'].shape[1]
    n = int(1.5 * arrays['inputs'].shape[1]) + 10
    return min(n, m.max_len) if m.positions == 'learned' else n

  def __call__(self, params, split, *, beam_size=1, log_examples=0) -> dict:
    arrays, sums = self.arrays(split), None
    eval_rng = jax.random.key(self.config.seed + 1)
    decode = self.objective == 'seq2seq'
    max_len = self.decode_len(arrays) if decode else 0
    decoder = self._decoder(max_len, beam_size) if decode else None
    predicted, size = [], self.config.eval.batch_size
    for i, batch in enumerate(data.eval_batches(arrays, size, rows=self.rows)):
      batch = self.place_batch(batch)
      s = self.metrics_step(params, batch, jax.random.fold_in(eval_rng, i))
      sums = s if sums is None else _add(sums, s)
      if decode:
        real = min(size, len(arrays['inputs']) - i * size)
        predicted.append(partitioning.to_host(decoder(params, batch['inputs']))[:real])
    out = _summarise(sums)
    if self.objective == 'lm':
      out['bits_per_token'] = out['nll'] / np.log(2.0)
      if isinstance(self.dataset.tokenizer, (tokenizers.CharTokenizer, tokenizers.ByteTokenizer)):
        out['bpc'] = out['bits_per_token']
      if log_examples:
        self._log_sample(params, arrays)
    if decode:
      out.update(self._score(split, arrays, np.concatenate(predicted), log_examples))
    return out

  def _score(self, split, arrays, predicted, log_examples) -> dict:
    num = len(arrays['inputs'])
    tokenizer = self.dataset.tokenizer
    if tokenizer is None:  # token tasks: exact match of the whole sequence
      targets = arrays['targets']
      width = min(predicted.shape[1], targets.shape[1])
      same = np.all(predicted[:, :width] == targets[:, :width], axis=1)
      for i in range(log_examples):
        log.info('  input %s\n  target %s\n  decoded %s', _tokens(arrays['inputs'][i]),
                 _tokens(targets[i]), _tokens(predicted[i]))
      return {'sequence_accuracy': float(np.mean(same))}
    hypotheses = [tokenizer.decode(row) for row in predicted]
    references = self.dataset.references[split][:num]
    for i in range(log_examples):
      log.info('  source    %s\n  reference %s\n  decoded   %s',
               tokenizer.decode(arrays['inputs'][i]), references[i], hypotheses[i])
    return {'bleu': metrics_lib.bleu(hypotheses, references)}

  def _log_sample(self, params, arrays):
    """A greedy continuation of the split's first window's first half."""
    context = self.config.data.max_len
    if 'sample' not in self._decoders:
      self._decoders['sample'] = jax.jit(functools.partial(
          decoding.greedy_generate, self.decode_model, max_steps=context - context // 2))
    prompt = arrays['inputs'][:1, :context // 2]
    out = np.asarray(self._decoders['sample'](params, prompt))
    tokenizer = self.dataset.tokenizer
    log.info('  prompt %r\n  greedy %r', tokenizer.decode(prompt[0]),
             tokenizer.decode(out[0]))


_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))


def _tokens(ids) -> str:
  return ' '.join(str(int(t)) for t in ids if t != tokens.PAD_ID)


def train_and_evaluate(config, workdir: str, *, allow_config_change: bool = False) -> dict:
  """Trains config.train.num_steps steps (resuming from the newest checkpoint
  in workdir), evaluates, and returns the final metrics by split.
  allow_config_change: resume a workdir whose config.json differs (logged)."""
  dataset = data.load(config.data)
  objective = steps.OBJECTIVES[config.model.type]
  data_validation.check_dataset(config, dataset.kind)
  # mlm reserves one more id, the last, for [MASK] (steps.forward).
  needed = dataset.vocab_size + (objective == 'mlm')
  with config.unlocked():
    if not config.model.vocab_size:
      config.model.vocab_size = needed
  if config.model.vocab_size < needed:
    raise config_lib.ConfigError(
        f'model.vocab_size={config.model.vocab_size} is smaller than the dataset '
        f'vocabulary ({needed}); use 0 (automatic) or >= {needed}')
  _prepare_workdir(config, workdir, allow_config_change)

  parallel = partitioning.DataParallel(config.train.parallel, config.train.model_parallel)

  t = config.train
  model = models.build(config.model)
  train_iter = _train_batches(config, dataset)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  example = {k: v[:1] for k, v in next(_train_batches(config, dataset)).items()}
  state = jax.device_put(state_lib.create(model, config, example, init_rng), parallel.replicated)
  if parallel.mode != 'pmap':
    parallel.layout(state, state_lib.param_axes(model, config, example))
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
  state = parallel.place_state(state)
  writer = metrics_lib.MetricWriter(workdir, start)
  evaluate = Evaluator(config, model, dataset, parallel.place_eval_batch)

  train_step = parallel.compile_step(
      steps.train_step, label_smoothing=t.label_smoothing, skip_nonfinite=t.skip_nonfinite,
      objective=objective, mlm_rate=config.data.mlm_rate, vocab_size=config.model.vocab_size,
      data_vocab_size=dataset.vocab_size, grad_accum_steps=t.grad_accum_steps)
  schedule = schedules.create(t, config.model.d_model)
  mc = config.model
  kv_heads = f' ({mc.num_kv_heads} key/value)' if mc.num_kv_heads not in (0, mc.num_heads) else ''
  log.info('Model %s, %s parameters, %d heads%s, attention=%s; training steps %d..%d, '
           'batch %s on %d device(s), mesh %s', mc.type, f'{num_params:,}', mc.num_heads,
           kv_heads, mc.attention, start, t.num_steps,
           f'~{t.batch_tokens} tokens' if t.batch_tokens else t.batch_size, jax.device_count(),
           dict(parallel.mesh.shape))
  # A batch that does not split over the devices (x accumulation steps) gets
  # all-PAD rows, which weigh nothing: the update is the unpadded batch's.
  row_multiple = jax.local_device_count() * t.grad_accum_steps
  if not t.batch_tokens:
    padded = partitioning.padded_rows(t.batch_size // jax.process_count(),
                                      row_multiple) * jax.process_count()
    log.info('Train batch: %d rows + %d padding rows (weight 0) = %d, over %d device(s) x %d '
             'accumulation step(s)', t.batch_size, padded - t.batch_size, padded,
             jax.device_count(), t.grad_accum_steps)
  log.info('Eval batches: %d examples + %d padding rows (weight 0) = %d, over %d device(s)',
           config.eval.batch_size, evaluate.rows - config.eval.batch_size, evaluate.rows,
           jax.device_count())

  window, window_start, window_steps = None, time.time(), 0
  train_start, eval_seconds, results = time.time(), 0.0, {}
  tracer = profiling.StepTracer(t.profile_steps, workdir)
  with preemption.Preemption() as preempt:
    for step in range(start, t.num_steps):
      batch = next(train_iter)
      batch = data.pad_rows(batch, partitioning.padded_rows(len(batch['inputs']), row_multiple))
      tracer.before(step)
      state, sums = train_step(state, parallel.place_batch(batch), dropout_rng)
      tracer.after(step + 1, state)
      sums = parallel.unplace_sums(sums)
      window = sums if window is None else _add(window, sums)
      window_steps += 1
      done = step + 1
      if done % t.log_every == 0 or done == t.num_steps:
        m = _summarise(window)
        skipped = int(window['skipped']) if 'skipped' in window else 0
        if window_steps > skipped:  # the mean over the steps that updated
          m['grad_norm'] /= window_steps - skipped
        else:
          del m['grad_norm']
        _check_finite(m['loss'], done, ckpt)
        if 'skipped' in window:
          m['skipped_steps'] = skipped
          if skipped:
            log.warning('skipped %d of the last %d steps: non-finite loss or gradients',
                        skipped, window_steps)
        elapsed = time.time() - window_start
        m['steps_per_sec'] = window_steps / elapsed
        m['tokens_per_sec'] = float(window['tokens']) / elapsed  # scored target tokens
        m['learning_rate'] = _applied_learning_rate(schedule, state.opt_state)
        writer.write(done, 'train', m)
        eta = (t.num_steps - done) / m['steps_per_sec']
        log.info('step %d/%d  loss %.4f  acc %.3f  lr %.2e  %.1f steps/s  ETA %s',
                 done, t.num_steps, m['loss'], m['accuracy'], m['learning_rate'],
                 m['steps_per_sec'], _fmt_time(eta))
        window, window_start, window_steps = None, time.time(), 0
      if done % t.eval_every == 0 or done == t.num_steps:
        eval_start = time.time()
        results['eval'] = evaluate(parallel.unplace_state(state).params, 'validation',
                                   log_examples=config.eval.num_examples_to_log)
        writer.write(done, 'eval', results['eval'])
        log.info('eval at step %d (%.1fs): %s', done, time.time() - eval_start,
                 _fmt_metrics(results['eval']))
        window_start += time.time() - eval_start
        eval_seconds += time.time() - eval_start
      stop = multihost.any_process(preempt.requested is not None)  # all stop at one step
      if done % t.checkpoint_every == 0 or done == t.num_steps or stop:
        if window is not None:  # steps since the last log: never save a non-finite state
          _check_finite(_summarise(window)['loss'], done, ckpt)
        ckpt.save(done, parallel.unplace_state(state), train_iter.get_state())
      if stop:
        reason = preempt.requested or 'a signal to another process'
        tracer.close()
        ckpt.close()
        writer.close()
        log.warning('Stopped on %s at step %d of %d; checkpoint saved in %s. Re-run the '
                    'same command to resume.', reason, done, t.num_steps, ckpt.directory)
        return {'preempted': reason, 'step': done, **results}

  tracer.close()
  train_time = time.time() - train_start
  recorded = _recorded_results(workdir, t.num_steps) if start == t.num_steps else {}
  if 'eval' not in results:  # resumed a finished run
    results['eval'] = recorded.get('eval') or evaluate(parallel.unplace_state(state).params,
                                                       'validation')
  if 'test' in recorded:  # a finished run re-run: its test record stands, written once
    results['test'] = recorded['test']
    log.info('test (recorded): %s', _fmt_metrics(results['test']))
  elif config.eval.final_test and 'test' in dataset.splits:
    test_start = time.time()
    results['test'] = evaluate(parallel.unplace_state(state).params, 'test', beam_size=config.eval.beam_size,
                               log_examples=config.eval.num_examples_to_log)
    if 'test_long' in dataset.splits:
      long = evaluate(parallel.unplace_state(state).params, 'test_long', beam_size=config.eval.beam_size)
      results['test'].update({f'long_{k}': v for k, v in long.items()})
    writer.write(t.num_steps, 'test', results['test'])
    log.info('test (%.1fs, beam %d): %s', time.time() - test_start, config.eval.beam_size,
             _fmt_metrics(results['test']))
  ckpt.close()
  writer.close()

  log.info('Done: %d steps; this run trained steps %d..%d in %s (periodic evaluation '
           '%s of it). Results by split:', t.num_steps, start, t.num_steps,
           _fmt_time(train_time), _fmt_time(eval_seconds))
  for split, m in results.items():
    log.info('  %-5s %s', split, _fmt_metrics(m))
  results['train_seconds'] = train_time
  results['eval_seconds'] = eval_seconds
  results['num_params'] = num_params
  return results
