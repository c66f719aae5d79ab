"""train_and_evaluate(config, workdir): the one training loop, top to bottom."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import flax.linen as nn
import jax
import numpy as np
import optax

from flaxformer_lite import compilation, config as config_lib
from flaxformer_lite import data, models
from flaxformer_lite.data import validation as data_validation
from flaxformer_lite.train import (checkpoints, memory, metrics as metrics_lib, multihost,
                                   partitioning, preemption, profiling, schedules, steps)
from flaxformer_lite.train import state as state_lib
from flaxformer_lite.train.evaluation import Evaluator


log = logging.getLogger('flaxformer_lite')


class NonFiniteLossError(RuntimeError):
  """The loss became NaN/inf; main.py exits with code 3."""


def _process_age() -> float:
  """Seconds since this process started (Linux: /proc; elsewhere since this
  module was imported)."""
  try:
    with open('/proc/self/stat') as f:
      started = int(f.read().rsplit(')', 1)[1].split()[19]) / os.sysconf('SC_CLK_TCK')
    with open('/proc/uptime') as f:
      return float(f.read().split()[0]) - started
  except (OSError, ValueError, IndexError):
    return time.time() - _IMPORTED


_IMPORTED = time.time()


def _check_finite(loss: float, step: int, ckpt):
  if not np.isfinite(loss):
    ckpt.manager.wait_until_finished()  # an earlier async save completes; none follows
    raise NonFiniteLossError(
        f'loss is {loss} by step {step}; the last good checkpoint is step '
        f'{ckpt.latest_step()} in {ckpt.directory} (nothing was saved after it). '
        'Lower train.learning_rate or set train.grad_clip.')


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


def _undo_new_workdir(workdir: str, created: bool) -> None:
  """A new run refused before it wrote anything but config.json (the memory
  guard, a pretrained checkpoint that does not fit the model) leaves no
  workdir that looks like a run: config.json and an empty checkpoints/ go,
  and the workdir itself if this run made it. Anything else there stays."""
  if jax.process_index() != 0 or not os.path.isdir(workdir):
    return
  checkpoints_dir = os.path.join(workdir, 'checkpoints')
  if os.path.isdir(checkpoints_dir) and not os.listdir(checkpoints_dir):
    os.rmdir(checkpoints_dir)
  if set(os.listdir(workdir)) - {'config.json'}:
    return
  if os.path.exists(os.path.join(workdir, 'config.json')):
    os.remove(os.path.join(workdir, 'config.json'))
  if created:
    os.rmdir(workdir)


def _load_dataset(config):
  """data.load(config.data), checked against the config; model.vocab_size 0
  becomes the dataset's vocabulary, model.num_classes 0 a classification
  task's classes (ConfigError if a set one is smaller)."""
  dataset = data.load(config.data, tokenizer_from=config.model.get('init_from', ''))
  objective = steps.OBJECTIVES[config.model.type]
  data_validation.check_dataset(config, dataset.kind)
  # mlm reserves one more id, the last, for [MASK] (steps.forward), unless
  # the tokenizer has its own.
  needed = dataset.vocab_size + (objective == 'mlm' and not dataset.mask_id)
  with config.unlocked():
    if not config.model.vocab_size:
      config.model.vocab_size = needed
    if objective == 'classify' and not config.model.num_classes:
      config.model.num_classes = dataset.num_classes
  if config.model.vocab_size < needed:
    raise config_lib.ConfigError(
        f'model.vocab_size={config.model.vocab_size} is smaller than the dataset '
        f'vocabulary ({needed}); use 0 (automatic) or >= {needed}')
  if objective == 'classify' and config.model.num_classes < dataset.num_classes:
    raise config_lib.ConfigError(
        f'model.num_classes={config.model.num_classes} is fewer than the classes of '
        f'data.task={config.data.task!r} ({dataset.num_classes}); use 0 (automatic) or '
        f'>= {dataset.num_classes}')
  return dataset


def _init_state(config, model, first_batch, parallel):
  """(a new train state in `parallel`'s layout, the dropout rng), drawn
  where state.init_device says, then placed."""
  example = {k: v[:1] for k, v in first_batch.items()}
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  shapes = state_lib.abstract_params(model, config, example)  # one trace for both uses
  device = state_lib.init_device(shapes)
  with jax.default_device(device) if device else contextlib.nullcontext():
    state = state_lib.create(model, config, example, init_rng)
  state = jax.device_put(state, parallel.replicated)
  if parallel.mode != 'pmap':
    parallel.layout(state, nn.get_partition_spec(shapes))
  return state, dropout_rng


# The checkpoint's data state also holds the train window it was taken in.
WINDOW_KEY = 'train_window'


def _resume(ckpt, state, train_iter):
  """(state, first step, train window): the newest readable checkpoint's,
  with train_iter moved to where it was; (state, 0, an empty window) when
  there is no checkpoint."""
  if ckpt.latest_step() is None:
    return state, 0, _TrainWindow()
  state, data_state = ckpt.restore(state)
  window = _TrainWindow.resumed(data_state.pop(WINDOW_KEY, {}))
  train_iter.set_state(data_state)
  start = int(state.step)
  log.info('Resumed from %s at step %d', ckpt.directory, start)
  return state, start, window


def _compile_train_step(config, dataset, parallel):
  t = config.train
  return parallel.compile_step(
      steps.train_step, label_smoothing=t.label_smoothing, skip_nonfinite=t.skip_nonfinite,
      objective=steps.OBJECTIVES[config.model.type], mlm_rate=config.data.mlm_rate,
      vocab_size=config.model.vocab_size, data_vocab_size=dataset.vocab_size,
      mask_id=dataset.mask_id, grad_accum_steps=t.grad_accum_steps,
      lm_mask=models.model_mask(config.model))


def _eval_splits(config, dataset) -> list[str]:
  """The splits this run evaluates: validation, and at the end test and test_long."""
  final = [s for s in ('test', 'test_long') if config.eval.final_test and s in dataset.splits]
  return ['validation', *final]


def _opt_state_bytes(parallel, state) -> int:
  """The optimizer state's bytes on one device: it stays allocated while the
  eval steps run, which are passed the parameters only."""
  leaves = jax.tree.leaves(state.opt_state)
  if parallel.mode == 'pmap':  # host copies, stacked over the local devices
    return sum(x[0].nbytes for x in leaves)
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def _check_memory(config, dataset, parallel, state, lowered_train, compiled_train, train_batch,
                  evaluate, limit) -> None:
  """The memory guard: with the compiled train step, compiles every eval
  step (and the greedy sample's generation) this run will call, each once, and stops the
  run (ConfigError, exit 2) if its peak (memory.peak) would not fit in
  `limit` = (bytes or None, where from); else logs each step's peak.

  A step's peak is what XLA assigns it (memory.step_bytes, `_analysis`): the
  train step's arguments hold the whole state; an eval step is passed the
  parameters, and the optimizer state stays allocated beside it.
  """
  train = _analysis(lowered_train, compiled_train, limit[0])
  if train is None:  # a backend without XLA's buffer assignment
    log.info('Memory: no estimate on this backend (%s)', jax.default_backend())
    return
  shape = 'x'.join(map(str, train_batch['inputs'].shape))
  name = f'train step, batch {shape}'
  needs, kept = {name: memory.step_bytes(train)}, {name: train.temp_size_in_bytes}
  eval_needs, eval_kept = _eval_needs(config, dataset, evaluate,
                                      parallel.unplace_state(state).params,
                                      _opt_state_bytes(parallel, state), limit[0])
  held, saved = _host_bytes(state)
  _check_needs(config, {**needs, **eval_needs}, {**kept, **eval_kept}, limit, held, saved)


def _host_bytes(tree) -> tuple[int, int]:
  """(bytes of `tree`'s arrays on this process's devices, bytes a checkpoint
  of it copies to the host: each distinct shard once)."""
  held = saved = 0
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      # From the sharding, not the shards' data: a pmap-mode array (its
      # leading axis one per device) has no single-device shards to read.
      indices = x.sharding.addressable_devices_indices_map(x.shape)
      shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      held += shard * len(indices)
      saved += shard * len({str(i) for i in indices.values()})
  return held, saved


def _check_before_loading(config, limit) -> None:
  """On CPU, where the model's vocabulary is known before the data (set, or
  model.init_from's): ConfigError (exit 2) if the process now, the
  parameters, the optimizer state, a checkpoint's copy and a pretrained
  checkpoint's tensors as read (memory.before_loading) would not fit in
  `limit`, before any data or weights are read. Shapes only: nothing is
  initialised."""
  m, rss = config.model, memory.process_rss()
  if (jax.default_backend() != 'cpu' or not m.vocab_size or rss is None
      or (steps.OBJECTIVES[m.type] == 'classify' and not m.num_classes)):
    return
  example = {k: jax.ShapeDtypeStruct((1, 4), np.int32) for k in ('inputs', 'inputs_b', 'targets')}
  shapes = nn.unbox(state_lib.abstract_params(models.build(m), config, example))
  train = config.train.num_steps > 0
  opt = jax.eval_shape(state_lib.create_optimizer(config.train, m.d_model).init,
                       shapes) if train else {}
  copies = jax.local_device_count() if config.train.parallel != 'fsdp' else 1
  nbytes = lambda tree: copies * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  terms = memory.before_loading(rss, nbytes(shapes), nbytes(opt), bool(m.get('init_from')))
  if not train:
    terms.pop("a checkpoint's host copy", None)
  sizes = ('d_model', 'mlp_dim', 'num_encoder_layers', 'num_decoder_layers')
  lower = ({'model.init_from': m.init_from} if m.get('init_from') else
           {f'model.{k}': m[k] for k in sizes})
  line = memory.check_before_loading(terms, *limit, lower)
  if line:
    log.info('%s', line)


def _analysis(lowered, compiled, limit_bytes):
  """compiled.memory_analysis(); on CPU, for a step whose estimate is above a
  quarter of `limit_bytes`, the larger of it and the analysis of the step
  compiled without library fusions (memory.WITHOUT_LIBRARY_FUSIONS), whose
  buffers XLA's assignment does not see. Below a quarter, an estimate off by
  the factor those buffers make still fits."""
  stats = compiled.memory_analysis()
  if (stats is None or limit_bytes is None or jax.default_backend() != 'cpu'
      or 4 * memory.step_bytes(stats) * jax.local_device_count() <= limit_bytes):
    return stats
  try:
    # In a thread of its own, as every compile: a signal meanwhile stops the run.
    plain = preemption.start(lowered.compile,
                             memory.WITHOUT_LIBRARY_FUSIONS).result().memory_analysis()
  except preemption.Preempted:
    raise
  except Exception as e:  # an XLA without those options: its own assignment stands
    log.info('Memory: a step read as compiled only (%s)', str(e).splitlines()[0][:200])
    return stats
  return max(stats, plain, key=memory.step_bytes)


def _eval_needs(config, dataset, evaluate, params, held: int, limit_bytes) -> tuple[dict, dict]:
  """({step: peak bytes}, {step: its temp buffer's bytes}) of every eval step
  (and the greedy sample's generation) the run will call, each compiled
  once (`_analysis` against `limit_bytes`); `held`: the bytes that stay
  allocated beside them (the optimizer state)."""
  needs, kept = {}, {}
  for name, compiled in _eval_programs(config, dataset, evaluate, params):
    if name not in needs:
      stats = _analysis(evaluate.lowered(compiled), compiled, limit_bytes)
      needs[name], kept[name] = memory.step_bytes(stats) + held, stats.temp_size_in_bytes
  return needs, kept


def _eval_programs(config, dataset, evaluate, params):
  """(name, compiled) of every eval step (and the greedy sample's
  generation) the run will call, each compiled once (the Evaluator keeps them)."""
  for split in _eval_splits(config, dataset):
    for context in evaluate.contexts():
      arrays = evaluate.arrays(split, context)
      shape = f'{evaluate.batch_rows(arrays)[1]}x{arrays["inputs"].shape[1]}'
      yield f'eval step, batch {shape}', evaluate.compiled_step(params, split, context)
  if evaluate.objective == 'lm' and config.eval.num_examples_to_log:
    generate, prompt = evaluate.sample_step(params, 'validation')
    yield f'greedy sample after {prompt.shape[1]} tokens', generate


def _compile_programs(config, dataset, evaluate, params, train: compilation.Compiling):
  """Compiles every program of `_eval_programs` while the train step (lowered
  already) compiles; returns the train step's (lowered, compiled).

  On CPU the eval steps and the sampler compile while the train step compiles
  in its thread (XLA's compiler releases the GIL): the first step waits for
  the longest compile, not their sum. On a GPU they compile one after another:
  XLA:GPU autotunes each program by running candidate kernels on the one
  device, and two compiles at once slow each other down several times over
  (benchmarks/compile_flags.py compiles them in turn, as here).
  """
  if jax.default_backend() == 'gpu':
    compiled = train.result()
    for _ in _eval_programs(config, dataset, evaluate, params):
      pass
    return compiled
  try:
    for _ in _eval_programs(config, dataset, evaluate, params):
      pass
  finally:
    compiled = train.result()  # also when an eval program failed: its error follows
  return compiled


def _check_needs(config, needs: dict, kept: dict, limit, held: int = 0, saved: int = 0) -> None:
  """ConfigError (exit 2) if the run's peak (memory.peak of the steps'
  `needs`, with the temp buffers `kept` where the host's heap keeps them)
  would not fit in `limit`; else logs them. On CPU the local devices share
  the host's memory, so their peaks add up, and the process holds more
  beside them (memory.host_terms: what it holds now less the arrays `held`
  that the steps' peaks count as arguments, and a checkpoint's copy of
  `saved` bytes)."""
  host = None
  if jax.default_backend() == 'cpu':
    devices = jax.local_device_count()
    needs = {k: v * devices for k, v in needs.items()}
    kept = {k: v * devices for k, v in (memory.kept_by_heap(kept) or {}).items()} or None
    rss = memory.process_rss()
    host = None if rss is None else memory.host_terms(rss, held, saved)
  else:
    kept = None
  e = config.eval
  lower = {'train.batch_size': config.train.batch_size,
           **({'eval.batch_tokens': e.batch_tokens} if e.batch_tokens
              else {'eval.batch_size': e.batch_size}),
           'data.max_len': config.data.max_len}
  limit_bytes, source = limit
  log.info(memory.check(needs, limit_bytes, source, lower, config.model.remat, kept, host))


def _log_setup(config, parallel, evaluate, num_params, start, row_multiple):
  """The model, the steps to train, and how the batches split over the devices."""
  t, mc = config.train, config.model
  kv_heads = f' ({mc.num_kv_heads} key/value)' if mc.num_kv_heads not in (0, mc.num_heads) else ''
  log.info('Model %s, %s parameters, %d heads%s, attention=%s; training steps %d..%d, '
           'batch %s on %d device(s), mesh %s', mc.type, f'{num_params:,}', mc.num_heads,
           kv_heads, mc.attention, start, t.num_steps,
           f'~{t.batch_tokens} tokens' if t.batch_tokens else t.batch_size, jax.device_count(),
           dict(parallel.mesh.shape))
  if not t.batch_tokens:
    padded = partitioning.padded_rows(t.batch_size // jax.process_count(),
                                      row_multiple) * jax.process_count()
    log.info('Train batch: %d rows + %d padding rows (weight 0) = %d, over %d device(s) x %d '
             'accumulation step(s)', t.batch_size, padded - t.batch_size, padded,
             jax.device_count(), t.grad_accum_steps)
  for context in evaluate.contexts():
    size, rows = evaluate.batch_rows(evaluate.arrays('validation', context))
    log.info('Eval batches%s: %d examples + %d padding rows (weight 0) = %d, over %d '
             'device(s)', f' at context {context}' if context else '', size, rows - size, rows,
             jax.device_count())


class _TrainWindow:
  """The metric sums of the training steps since the last train log, and
  when they started (moved on by the time evaluation takes). Steps and tokens
  restored from a checkpoint (`resumed`) count in the means, not the speed."""

  def __init__(self):
    self.sums, self.start, self.steps = None, time.time(), 0
    self.restored_steps, self.restored_tokens = 0, 0.0

  def saved(self) -> dict:
    """The sums and their step count as JSON values, for a checkpoint taken
    inside the window: the run resumed from it logs the same means."""
    if self.sums is None:
      return {}
    return {'steps': self.steps, 'sums': {k: [np.asarray(v).item(), str(np.asarray(v).dtype)]
                                          for k, v in self.sums.items()}}

  @classmethod
  def resumed(cls, saved: dict) -> _TrainWindow:
    """The window `saved` describes (empty: a checkpoint at a train log)."""
    window = cls()
    if saved:
      window.steps = window.restored_steps = saved['steps']
      window.sums = {k: np.asarray(v, dtype) for k, (v, dtype) in saved['sums'].items()}
      window.restored_tokens = float(window.sums['tokens'])
    return window

  def add(self, sums):
    self.sums = sums if self.sums is None else metrics_lib.add_sums(self.sums, sums)
    self.steps += 1

  def check_finite(self, done: int, ckpt):
    """NonFiniteLossError if these steps' mean loss is not finite."""
    if self.sums is not None:
      _check_finite(metrics_lib.summarise(self.sums)['loss'], done, ckpt)

  def metrics(self, done: int, ckpt) -> dict:
    """The means over these steps (NonFiniteLossError for a non-finite loss)
    with skipped_steps (train.skip_nonfinite) and the speed."""
    m = metrics_lib.summarise(self.sums)
    skipped = int(self.sums['skipped']) if 'skipped' in self.sums else 0
    if self.steps > skipped:  # the mean over the steps that updated
      m['grad_norm'] /= self.steps - skipped
    else:
      del m['grad_norm']
    _check_finite(m['loss'], done, ckpt)
    if 'skipped' in self.sums:
      m['skipped_steps'] = skipped
      if skipped:
        log.warning('skipped %d of the last %d steps: non-finite loss or gradients',
                    skipped, self.steps)
    elapsed = time.time() - self.start
    m['steps_per_sec'] = (self.steps - self.restored_steps) / elapsed
    # scored target tokens
    m['tokens_per_sec'] = (float(self.sums['tokens']) - self.restored_tokens) / elapsed
    return m


def _log_train(writer, done: int, num_steps: int, m: dict):
  writer.write(done, 'train', m)
  eta = (num_steps - done) / m['steps_per_sec']
  log.info('step %d/%d  loss %.4f  acc %.3f  lr %.2e  %s  ETA %s',
           done, num_steps, m['loss'], m['accuracy'], m['learning_rate'],
           metrics_lib.fmt_rate(m['steps_per_sec']), metrics_lib.fmt_time(eta))


def _validation_due(config, step: int) -> bool:
  """Whether a training run evaluates the validation split at `step`: step 0
  with eval.at_start, every train.eval_every-th step, and the last."""
  if step == 0:
    return config.eval.at_start
  return step % config.train.eval_every == 0 or step == config.train.num_steps


def _validate(evaluate, params, done: int, writer, log_examples: int, recorded=None):
  """(the validation metrics of `params`, written and logged; the seconds they
  took). Metrics that `recorded` (`_recorded_results` at `done`) holds are
  returned as they are, neither evaluated nor written again."""
  if recorded and 'eval' in recorded:
    log.info('eval at step %d (recorded): %s', done, _fmt_metrics(recorded['eval']))
    return recorded['eval'], 0.0
  eval_start = time.time()
  # The sample (an LM's) is written inside evaluate, before the metrics line:
  # the line is the record that the whole evaluation finished.
  m = evaluate(params, 'validation', log_examples=log_examples)
  writer.write(done, 'eval', m)
  log.info('eval at step %d (%.1fs): %s', done, time.time() - eval_start, _fmt_metrics(m))
  return m, time.time() - eval_start


def _test(config, dataset, evaluate, params, writer, step: int, recorded) -> dict | None:
  """The test split's metrics and test_long's as long_<name>, written at
  `step` (the last); those `recorded` at it as they are; None without a test
  split or with eval.final_test=False."""
  if 'test' in recorded:
    log.info('test at step %d (recorded): %s', step, _fmt_metrics(recorded['test']))
    return recorded['test']
  e, test_start = config.eval, time.time()
  if not (e.final_test and 'test' in dataset.splits):
    return None
  m = evaluate(params, 'test', beam_size=e.beam_size, log_examples=e.num_examples_to_log)
  if 'test_long' in dataset.splits:
    long = evaluate(params, 'test_long', beam_size=e.beam_size)
    m.update({f'long_{k}': v for k, v in long.items()})
  writer.write(step, 'test', m)
  log.info('test (%.1fs, beam %d): %s', time.time() - test_start, e.beam_size, _fmt_metrics(m))
  return m


def _stopped_evaluating(signal: preemption.Preempted, step: int, results=None) -> dict:
  """The result of a run stopped while it evaluated at `step`, its
  checkpoint's: the evaluations finished are recorded, a re-run does the rest."""
  log.warning('Stopped on %s while evaluating at step %d; the checkpoint at step %d is saved '
              'and the evaluations finished are recorded. Re-run the same command to finish '
              'the run.', signal, step, step)
  return {'preempted': str(signal), 'step': step, **(results or {})}


def _log_done(num_steps: int, start: int, train_time: float, eval_seconds: float, results):
  log.info('Done: %d steps; this run trained steps %d..%d in %s (periodic evaluation '
           '%s of it). Results by split:', num_steps, start, num_steps,
           metrics_lib.fmt_time(train_time), metrics_lib.fmt_time(eval_seconds))
  for split, m in results.items():
    log.info('  %-5s %s', split, _fmt_metrics(m))


def evaluate_only(config, workdir: str, *, allow_config_change: bool = False) -> dict:
  """train.num_steps=0: model.init_from's weights evaluated as they are, on
  validation (and test, eval.final_test), written to metrics.jsonl at step 0
  as a trained run's final evaluation is. No optimizer state, no train step,
  no checkpoint. Returns the metrics by split."""
  limit = memory.available(jax.devices()[0])
  _check_before_loading(config, limit)
  dataset = _load_dataset(config)
  _prepare_workdir(config, workdir, allow_config_change)
  parallel = partitioning.Partitioner(config.train.parallel, config.train.model_parallel)
  model = models.build(config.model)
  example = {k: v[:1] for k, v in next(_train_batches(config, dataset)).items()}
  params = jax.device_put(state_lib.init_params(model, config, example,
                                                jax.random.key(config.seed)),
                          parallel.replicated)
  evaluate = Evaluator(config, model, dataset, parallel.place_eval_batch,
                       sample_path=os.path.join(workdir, 'sample.txt'))
  log.info('Model %s, %s parameters, attention=%s: evaluated without training '
           '(train.num_steps=0)', config.model.type,
           f'{sum(x.size for x in jax.tree.leaves(params)):,}', config.model.attention)
  _check_needs(config, *_eval_needs(config, dataset, evaluate, params, 0, limit[0]), limit,
               _host_bytes(params)[0])
  results, start = {}, time.time()
  with contextlib.closing(metrics_lib.MetricWriter(workdir, 0)) as writer:
    recorded = _recorded_results(workdir, 0)
    results['eval'], _ = _validate(evaluate, params, 0, writer, config.eval.num_examples_to_log,
                                   recorded)
    if (test := _test(config, dataset, evaluate, params, writer, 0, recorded)) is not None:
      results['test'] = test
  _log_done(0, 0, 0.0, time.time() - start, results)
  return results


def train_and_evaluate(config, workdir: str, *, allow_config_change: bool = False) -> dict:
  """Trains config.train.num_steps steps (resuming from the newest checkpoint
  in workdir), evaluates, and returns the final metrics by split; with
  train.num_steps=0, `evaluate_only`. A SIGTERM or SIGINT anywhere stops the
  run within a step (train/preemption.py), keeping every step trained; the
  result then has 'preempted' (the signal) and 'step'.
  allow_config_change: resume a workdir whose config.json differs (logged)."""
  created, new = not os.path.isdir(workdir), not os.path.exists(
      os.path.join(workdir, 'config.json'))
  with preemption.Preemption() as preempt:
    try:
      if config.train.num_steps == 0:
        return evaluate_only(config, workdir, allow_config_change=allow_config_change)
      return _train(config, workdir, allow_config_change, preempt)
    except preemption.Preempted as e:  # before the first step, or with nothing to save
      log.warning('Stopped on %s %s. Re-run the same command to finish the run.', e,
                  'before the first step: nothing new to save' if config.train.num_steps else
                  'while evaluating (train.num_steps=0): the splits evaluated are recorded')
      return {'preempted': str(e), 'step': None}
    except Exception:
      if new:
        _undo_new_workdir(workdir, created)
      raise


def _train(config, workdir: str, allow_config_change: bool, preempt) -> dict:
  # Before the run allocates anything: on CPU its buffers come out of MemAvailable.
  limit = memory.available(jax.devices()[0])
  _check_before_loading(config, limit)
  dataset = _load_dataset(config)
  _prepare_workdir(config, workdir, allow_config_change)
  t = config.train
  parallel = partitioning.Partitioner(t.parallel, t.model_parallel)
  model = models.build(config.model)
  train_iter = _train_batches(config, dataset)
  # A batch that does not split over the devices (x accumulation steps) gets
  # all-PAD rows, which weigh nothing: the update is the unpadded batch's.
  row_multiple = jax.local_device_count() * t.grad_accum_steps
  # An example batch (a fresh iterator's first): the state is initialised from
  # it and the train step compiled for its shape; train_iter keeps its place.
  first_batch = next(_train_batches(config, dataset))
  state, dropout_rng = _init_state(config, model, first_batch, parallel)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))

  # The checkpointer and the metric writer are closed once however the run
  # ends; closing the checkpointer waits for its async save and starts none.
  with contextlib.ExitStack() as to_close:
    ckpt = to_close.enter_context(contextlib.closing(
        checkpoints.Checkpointer(workdir, t.keep_checkpoints)))
    state, start, resumed_window = _resume(ckpt, state, train_iter)
    if start >= t.num_steps:
      log.info('Nothing to train: %s is already trained to step %d (train.num_steps=%d); its '
               'results follow. Pass --workdir=DIR, or raise train.num_steps, for more.',
               os.path.abspath(workdir), start, t.num_steps)
    state = parallel.place_state(state)
    evaluate = Evaluator(config, model, dataset, parallel.place_eval_batch,
                         sample_path=os.path.join(workdir, 'sample.txt'))
    train_step = _compile_train_step(config, dataset, parallel)
    _log_setup(config, parallel, evaluate, num_params, start, row_multiple)
    # Before the metric writer, which drops the points logged after `start`:
    # a run that cannot fit changes nothing in its workdir.
    example = parallel.place_batch(data.pad_rows(first_batch, partitioning.padded_rows(
        len(first_batch['inputs']), row_multiple)))
    with models.recording_attention() as seen:
      lowered_train, compiled_train = _compile_programs(
          config, dataset, evaluate, parallel.unplace_state(state).params,
          compilation.Compiling('train step', train_step, state, example, dropout_rng))
    for line in models.attention_kernels(seen):
      log.info('Attention: %s', line)
    _check_memory(config, dataset, parallel, state, lowered_train, compiled_train, example,
                  evaluate, limit)
    step_flops = profiling.step_flops(compiled_train)
    writer = to_close.enter_context(contextlib.closing(metrics_lib.MetricWriter(workdir, start)))
    schedule = schedules.create(t, config.model.d_model)

    # What metrics.jsonl holds at `start`: a run stopped in the evaluation at
    # its newest checkpoint (or after the last step) does what is not recorded.
    recorded = _recorded_results(workdir, start)
    train_start, eval_seconds, results = time.time(), 0.0, {}
    preemption.check()
    if _validation_due(config, start):
      try:
        results['eval'], eval_seconds = _validate(
            evaluate, parallel.unplace_state(state).params, start, writer,
            config.eval.num_examples_to_log, recorded)
      except preemption.Preempted as e:
        if start == 0:
          raise
        to_close.close()
        return _stopped_evaluating(e, start)
    window, stop, in_flight = resumed_window, False, None
    window.start = time.time()
    with contextlib.closing(profiling.StepTracer(t.profile_steps, workdir)) as tracer:
      for step in range(start, t.num_steps):
        done = step + 1
        batch = next(train_iter)
        batch = data.pad_rows(batch, partitioning.padded_rows(len(batch['inputs']),
                                                              row_multiple))
        tracer.before(step)
        called = time.perf_counter()
        state, sums = train_step(state, parallel.place_batch(batch), dropout_rng)
        if step == start:
          jax.block_until_ready(sums)
          log.info('first step done, %.1f s after the process started (the step itself '
                   '%.1f s)', _process_age(), time.perf_counter() - called)
        tracer.after(done, state)
        # One step in flight: a signal is acted on after the step running
        # when it came, not after a queue of them.
        jax.block_until_ready(in_flight)
        in_flight = sums
        window.add(parallel.unplace_sums(sums))
        if done % t.log_every == 0 or done == t.num_steps:
          m = window.metrics(done, ckpt)
          m['learning_rate'] = _applied_learning_rate(schedule, state.opt_state)
          if step_flops:
            m['step_flops'] = step_flops
          _log_train(writer, done, t.num_steps, m)
          window = _TrainWindow()
        if _validation_due(config, done):
          try:
            results['eval'], seconds = _validate(
                evaluate, parallel.unplace_state(state).params, done, writer,
                config.eval.num_examples_to_log)
          except preemption.Preempted:  # the step is saved below
            seconds = 0.0
          window.start += seconds
          eval_seconds += seconds
        stop = multihost.any_process(preempt.requested is not None)  # all stop at one step
        if done % t.checkpoint_every == 0 or done == t.num_steps or stop:
          window.check_finite(done, ckpt)  # never save a non-finite state
          ckpt.save(done, parallel.unplace_state(state),
                    {**train_iter.get_state(), WINDOW_KEY: window.saved()})
        if stop:
          break
    if stop:
      reason = preempt.requested or 'a signal to another process'
      to_close.close()  # here, so that a second signal during the last save exits at once
      log.warning('Stopped on %s at step %d of %d; checkpoint saved in %s. Re-run the '
                  'same command to resume.', reason, done, t.num_steps, ckpt.directory)
      return {'preempted': reason, 'step': done, **results}

    train_time = time.time() - train_start
    try:
      test = _test(config, dataset, evaluate, parallel.unplace_state(state).params, writer,
                   t.num_steps, recorded if start == t.num_steps else {})
    except preemption.Preempted as e:
      to_close.close()
      return _stopped_evaluating(e, t.num_steps, results)
    if test is not None:
      results['test'] = test

  _log_done(t.num_steps, start, train_time, eval_seconds, results)
  results['train_seconds'] = train_time
  results['eval_seconds'] = eval_seconds
  results['num_params'] = num_params
  return results
