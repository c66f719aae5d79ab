"""Data parallelism: 1 device = 8 devices (jit) = 4 devices (pmap) = 8 devices
(fsdp, the state sharded, with gradient accumulation), for a batch that does
not split over the devices (padded with weight-0 rows); a checkpoint resumes
on another device count (1 -> 8, 8 -> 4 with FSDP, 8 -> 1) on the curve of the
uninterrupted run; padding rows leave the update unchanged;
gradient accumulation = the large batch; the train step compiles once (float32
and bfloat16 runs); bf16 trains.

Several devices on CPU come from --xla_force_host_platform_device_count, which
must be set before jax starts: those runs are subprocesses.
"""
import contextlib
import functools
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import data, models
from flaxformer_lite.train import loop, metrics, state as state_lib, steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN_ON_DEVICES = '''
import gc, logging, sys
from flaxformer_lite import config as config_lib, main
from flaxformer_lite.train import loop
import jax
gc.set_threshold(*main.GC_THRESHOLDS)  # as the command line runs
assert jax.device_count() == int(sys.argv[1]), jax.devices()
log = logging.getLogger('flaxformer_lite')
log.addHandler(logging.StreamHandler())
log.setLevel(logging.INFO)
for path, workdir in zip(sys.argv[2::2], sys.argv[3::2]):
  print(f'=== run in {workdir}', file=sys.stderr, flush=True)
  loop.train_and_evaluate(config_lib.from_json(open(path).read()), workdir)
'''


def _on_devices(n, runs, tmp_path) -> dict:
  """Trains each (config, workdir) of `runs` in turn, in one subprocess with n
  CPU devices (one start-up for all); -> {workdir: its log}."""
  args = []
  for i, (config, workdir) in enumerate(runs):
    path = tmp_path / f'config_{n}_{i}.json'
    path.write_text(config_lib.to_json(config))
    args += [str(path), workdir]
  flags = os.environ.get('XLA_FLAGS', '')  # tests/conftest.py's, kept
  env = dict(os.environ, XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count={n}',
             JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, '-c', RUN_ON_DEVICES, str(n), *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  logs = done.stderr.split('=== run in ')[1:]
  assert [log.split('\n', 1)[0] for log in logs] == [w for _, w in runs], done.stderr[-3000:]
  return {w: log for (_, w), log in zip(runs, logs)}


def _curve(workdir, key='loss', split='train'):
  return {r['step']: r[key] for r in metrics.read(workdir) if r['split'] == split}


def _parallel_config(tiny_config):
  c = tiny_config
  c.model.dropout_rate = 0.0  # dropout masks are drawn per device in pmap mode
  c.train.num_steps, c.train.log_every, c.train.checkpoint_every = 20, 5, 10
  c.train.batch_size = 14  # nanoGPT-like: splits over neither 4 nor 8 devices
  c.eval.batch_size = 18  # neither
  c.eval.final_test = False
  return c


@contextlib.contextmanager
def _train_step_compilations(caplog):
  """-> a list that gets the 'Compiling jit(train_step)' messages (jax_log_compiles)
  logged inside the block."""
  compiles, start = [], len(caplog.records)
  jax.config.update('jax_log_compiles', True)
  try:
    with caplog.at_level(logging.WARNING):
      yield compiles
  finally:
    jax.config.update('jax_log_compiles', False)
  compiles += [r.getMessage() for r in caplog.records[start:]
               if r.getMessage().startswith('Compiling jit(train_step)')]


def _resume_copy(workdir, copy, step):
  """A copy of workdir as it was at checkpoint `step` (later checkpoints removed)."""
  shutil.copytree(workdir, copy)
  for s in os.listdir(os.path.join(copy, 'checkpoints')):
    if s.isdigit() and int(s) > step:
      shutil.rmtree(os.path.join(copy, 'checkpoints', s))
  return copy


def test_one_device_equals_several_and_a_checkpoint_resumes_on_another_count(
    tiny_config, tmp_path, caplog):
  c = _parallel_config(tiny_config)
  with _train_step_compilations(caplog) as compiles:
    loop.train_and_evaluate(c, str(tmp_path / 'one'))
  # 20 steps, 4 logs, 2 evaluations, 2 checkpoints: one compilation
  assert len(compiles) == 1, compiles
  curves = {'one': _curve(str(tmp_path / 'one'))}
  runs = {'jit': (8, 1), 'pmap': (4, 1), 'fsdp': (8, 2)}  # devices, accumulation steps
  configs = {}
  for mode, (n, accum) in runs.items():
    configs[mode] = config_lib.from_json(config_lib.to_json(c))
    configs[mode].train.parallel, configs[mode].train.grad_accum_steps = mode, accum
  # Resumed from step 10 on another device count, orbax restoring onto the
  # new mesh: the 1-device jit run on 8 devices with FSDP, the 8-device FSDP
  # run (its state sharded 8 ways) on 4 without accumulation, and the 8-device
  # jit run on 1 (in this process, below). train.parallel and
  # train.grad_accum_steps may change on resuming: they leave the update as it was.
  moved = {name: config_lib.from_json(config_lib.to_json(c)) for name in ('one_on_8', 'fsdp_on_4')}
  moved['one_on_8'].train.parallel = 'fsdp'
  moved['fsdp_on_4'].train.parallel = 'fsdp'
  # The resumed runs are compared on their training curves only: their
  # evaluations skip compiling a decoder (the same exact match, one pass).
  for config in moved.values():
    config.eval.sequence_accuracy = 'teacher_forced'
  resumes = {'one_on_8': (8, 'one', moved['one_on_8']),
             'fsdp_on_4': (4, 'fsdp', moved['fsdp_on_4'])}
  logs = {}
  for n in (8, 4):  # one subprocess per device count; the 8-device runs first
    todo = [(configs[m], str(tmp_path / m)) for m in runs if runs[m][0] == n]
    todo += [(config, _resume_copy(str(tmp_path / source), str(tmp_path / name), 10))
             for name, (count, source, config) in resumes.items() if count == n]
    logs.update(_on_devices(n, todo, tmp_path))
  for mode, (n, accum) in runs.items():
    log = logs[str(tmp_path / mode)]
    padded = -(-14 // (n * accum)) * n * accum
    assert (f'Train batch: 14 rows + {padded - 14} padding rows (weight 0) = {padded}, '
            f'over {n} device(s) x {accum}') in log
    assert f'Eval batches: 18 examples + {-(-18 // n) * n - 18} padding rows' in log
    curves[mode] = _curve(str(tmp_path / mode))
  assert sorted(curves['one']) == [5, 10, 15, 20]
  for mode in runs:
    for step, loss in curves['one'].items():
      assert curves[mode][step] == pytest.approx(loss, rel=2e-5), (mode, step)
  # The gradient norm at step 20 and the eval loss are taken with parameters after
  # 15-20 Adam steps, which carry each run's float32 reduction order: Adam's update
  # g / sqrt(v) is full-sized for a near-zero gradient whatever its rounding (2e-4
  # apart on one host's CPU, 3e-5 on another). A padding row counted with weight 1
  # moves them by percents.
  norms = [_curve(str(tmp_path / m), 'grad_norm')[20] for m in ('one', *runs)]
  np.testing.assert_allclose(norms, norms[0], rtol=1e-3)
  evals = [_curve(str(tmp_path / m), 'loss', 'eval')[20] for m in ('one', *runs)]
  np.testing.assert_allclose(evals, evals[0], rtol=1e-3)
  accuracy = [_curve(str(tmp_path / m), 'sequence_accuracy', 'eval')[20] for m in ('one', *runs)]
  assert accuracy == [accuracy[0]] * 4  # decoding: the padding rows' output is dropped

  parts = _resume_copy(str(tmp_path / 'jit'), str(tmp_path / 'jit_on_1'), 10)
  c.train.parallel, c.train.grad_accum_steps = 'jit', 1
  c.eval.sequence_accuracy = 'teacher_forced'
  loop.train_and_evaluate(c, parts)
  for name, n in (('one_on_8', 8), ('fsdp_on_4', 4), ('jit_on_1', 1)):
    if n > 1:
      assert 'Resumed from' in logs[str(tmp_path / name)] and \
          f'over {n} device(s)' in logs[str(tmp_path / name)]
    resumed = _curve(str(tmp_path / name))
    assert sorted(resumed) == [5, 10, 15, 20]
    for step in (15, 20):
      assert resumed[step] == pytest.approx(curves['one'][step], rel=2e-5), (name, step)


MODEL_AXIS = '''
import gc, json, logging, sys
import jax
from flaxformer_lite import config as config_lib, main, models
from flaxformer_lite.train import loop, partitioning, state as state_lib
gc.set_threshold(*main.GC_THRESHOLDS)  # as the command line runs
assert jax.device_count() == 8
log = logging.getLogger('flaxformer_lite')
log.addHandler(logging.StreamHandler())
log.setLevel(logging.INFO)
layouts = {}
for path, workdir in zip(sys.argv[1::2], sys.argv[2::2]):
  config = config_lib.from_json(open(path).read())
  loop.train_and_evaluate(config, workdir)
  t = config.train
  parallel = partitioning.Partitioner(t.parallel, t.model_parallel)
  model = models.build(config.model)
  batch = {k: jax.numpy.ones((2, 7), jax.numpy.int32) for k in ('inputs', 'targets')}
  state = jax.eval_shape(lambda: state_lib.create(model, config, batch, jax.random.key(0)))
  shardings = parallel.layout(state, state_lib.param_axes(model, config, batch))
  layouts[workdir] = {jax.tree_util.keystr(k): [list(x.shape), [a for a in sh.spec]]
                      for (k, x), sh in zip(jax.tree_util.tree_leaves_with_path(state.params),
                                            jax.tree.leaves(shardings.params))}
print(json.dumps(layouts))
'''

# What the model axis shards, written from the parameter names (Megatron-LM's
# split): (name suffix, the dimension over 'model'). Everything else, Shaw's
# tables among them, is replicated.
MODEL_SHARDED = (("['query']['kernel']", 1), ("['key']['kernel']", 1), ("['value']['kernel']", 1),
                 ("['query']['bias']", 0), ("['key']['bias']", 0), ("['value']['bias']", 0),
                 ("['out']['kernel']", 0), ("['wi']['kernel']", 1), ("['wi']['bias']", 0),
                 ("['wo']['kernel']", 0))


def _expected_spec(path, shape, data, model, fsdp):
  spec = [None] * len(shape)
  for suffix, dim in MODEL_SHARDED:
    if path.endswith(suffix) and model > 1 and shape[dim] % model == 0:
      spec[dim] = 'model'
  free = [i for i, n in enumerate(shape) if spec[i] is None and n % data == 0 and n >= data]
  if fsdp and data > 1 and free:
    spec[max(free, key=lambda i: shape[i])] = 'data'
  return spec


def test_model_axis_follows_the_one_device_curve_and_shards_by_the_rules(tiny_config, tmp_path):
  c = _parallel_config(tiny_config)
  c.model.num_heads, c.train.num_steps = 8, 10  # 8 heads of 4: a model axis of 8 splits them
  c.eval.num_examples_to_log, c.train.eval_every = 0, 10
  # The curves and layouts are compared, not the decoded sequences: no decoder
  # to compile for each mesh (decoding on a mesh: the test above).
  c.eval.sequence_accuracy = 'teacher_forced'
  # (data-only meshes: test_one_device_equals_several_...)
  meshes = {(4, 2): 'jit', (2, 4): 'fsdp', (1, 8): 'jit'}
  # shaw: every parameter dot_product has, and relative tables that stay replicated.
  c.model.attention = 'shaw'
  loop.train_and_evaluate(c, str(tmp_path / 'one'))
  curve = _curve(str(tmp_path / 'one'))
  runs = []
  for (data_ways, model), mode in meshes.items():
    config = config_lib.from_json(config_lib.to_json(c))
    config.train.parallel, config.train.model_parallel = mode, model
    runs.append((config, str(tmp_path / f'{data_ways}x{model}')))
  args = []
  for i, (config, workdir) in enumerate(runs):
    path = tmp_path / f'model_axis_{i}.json'
    path.write_text(config_lib.to_json(config))
    args += [str(path), workdir]
  flags = os.environ.get('XLA_FLAGS', '')
  env = dict(os.environ, XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, '-c', MODEL_AXIS, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  layouts = json.loads(done.stdout.strip().splitlines()[-1])
  for config, workdir in runs:
    model = config.train.model_parallel
    data, fsdp = 8 // model, config.train.parallel == 'fsdp'
    assert f"mesh {{'data': {data}, 'model': {model}}}" in done.stderr
    got = _curve(workdir)
    for step, loss in curve.items():
      assert got[step] == pytest.approx(loss, rel=2e-5), (workdir, step)
    sharded = 0
    for path, (shape, spec) in layouts[workdir].items():
      spec = spec + [None] * (len(shape) - len(spec))
      assert spec == _expected_spec(path, shape, data, model, fsdp), (workdir, path, shape)
      sharded += 'model' in spec
    # one encoder layer (attention: q, k, v kernels and biases, out kernel: 7; MLP: 3)
    # and one decoder layer (self- and cross-attention, MLP: 17)
    assert sharded == (27 if model > 1 else 0), workdir


@pytest.mark.parametrize('model_type', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_padding_rows_leave_the_update_unchanged(model_type):
  """A batch of 6 rows and the same rows + 2 all-PAD rows (data.pad_rows):
  the same parameters after one step, dropout on (its draws for the real rows
  do not depend on the rows after them)."""
  cfg = config_lib.base_config()
  cfg.model.update(type=model_type, vocab_size=12, d_model=16, num_heads=2, mlp_dim=32,
                   dropout_rate=0.2, num_encoder_layers=1, num_decoder_layers=1)
  cfg.train.schedule, cfg.train.learning_rate = 'constant', 1e-2
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(3, 12, size=(6, 7)).astype(np.int32) for k in ('inputs', 'targets')}
  batch['targets'][1, 3:] = batch['inputs'][2, 5:] = 0
  state = state_lib.create(models.build(cfg.model), cfg, batch, jax.random.key(0))
  # plain SGD: the update is minus the gradient (Adam's first step is sign(g),
  # which rounding noise flips where g is ~0, e.g. the key biases)
  state = state.replace(tx=optax.sgd(1.0), opt_state=optax.sgd(1.0).init(state.params))
  objective = steps.OBJECTIVES[model_type]
  step = jax.jit(functools.partial(steps.train_step, label_smoothing=0.1, objective=objective,
                                   vocab_size=12, data_vocab_size=11))
  want, want_sums = step(state, batch, jax.random.key(1))
  got, got_sums = step(state, data.pad_rows(batch, 8), jax.random.key(1))
  for key in ('loss', 'tokens', 'correct', 'grad_norm'):
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-6)
  # atol: one float32 ulp at magnitude 1 is 1.2e-7, and the batch's row count
  # changes the order of its sums; a padding row that counted would move the
  # update by percents.
  for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def _tiny_state(vocab=11, seed=0):
  cfg = config_lib.base_config()
  cfg.model.update(vocab_size=vocab, d_model=16, num_heads=2, mlp_dim=32, dropout_rate=0.0,
                   num_encoder_layers=1, num_decoder_layers=1)
  cfg.train.schedule, cfg.train.learning_rate = 'constant', 1e-2
  model = models.build(cfg.model)
  rng = np.random.default_rng(seed)
  batch = {k: rng.integers(3, vocab, size=(8, 7)).astype(np.int32) for k in ('inputs', 'targets')}
  for i, length in enumerate([7, 1, 3, 5, 2, 7, 4, 6]):  # ragged: microbatches differ in tokens
    batch['targets'][i, length:] = 0
    batch['inputs'][i, max(1, length - 1):] = 0
  state = state_lib.create(model, cfg, batch, jax.random.key(seed))
  # plain SGD with rate 1: the update is minus the gradient (Adam's first step
  # is sign(g), which noise flips where g is ~0, e.g. the key biases)
  return state.replace(tx=optax.sgd(1.0), opt_state=optax.sgd(1.0).init(state.params)), batch


def test_gradient_accumulation_equals_the_large_batch():
  state, batch = _tiny_state()
  step = functools.partial(steps.train_step, label_smoothing=0.1)
  big, big_sums = jax.jit(step)(state, batch, jax.random.key(1))
  for k in (4,):
    acc, acc_sums = jax.jit(functools.partial(step, grad_accum_steps=k))(
        state, batch, jax.random.key(1))
    for x, y in zip(jax.tree.leaves(acc.params), jax.tree.leaves(big.params)):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    for key in ('loss', 'tokens', 'correct', 'grad_norm'):
      np.testing.assert_allclose(acc_sums[key], big_sums[key], rtol=1e-5)
  # the large batch's gradient is the token-weighted mean over all rows: a
  # plain mean of the microbatch means would differ on these ragged rows
  assert float(big_sums['tokens']) == float(np.sum(batch['targets'] != 0))


def test_bfloat16_compute_trains_with_float32_params_and_loss_and_compiles_once(
    tiny_config, tmp_path, caplog):
  c = tiny_config
  c.model.dtype = 'bfloat16'
  c.train.num_steps, c.train.log_every, c.train.eval_every = 30, 10, 30
  c.eval.final_test = False
  with _train_step_compilations(caplog) as compiles:
    loop.train_and_evaluate(c, str(tmp_path / 'bf16'))
  assert len(compiles) == 1, compiles  # 30 steps, 3 logs, an eval: one compilation
  curve = _curve(str(tmp_path / 'bf16'))
  assert curve[30] < 0.9 * curve[10]
  model = models.build(dict(c.model, vocab_size=9))
  ids = jnp.ones((2, 5), jnp.int32)
  variables = model.init(jax.random.key(0), ids, ids)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
  assert model.apply(variables, ids, ids).dtype == jnp.float32


FSDP_LAYOUT = '''
import functools, json
import jax, numpy as np
from flaxformer_lite import config as config_lib, models
from flaxformer_lite.train import partitioning, state as state_lib, steps
assert jax.device_count() == 4
cfg = config_lib.base_config()
cfg.model.update(vocab_size=12, d_model=16, num_heads=2, mlp_dim=32, dropout_rate=0.0,
                 num_encoder_layers=1, num_decoder_layers=1)
batch = {k: np.full((8, 5), 3, np.int32) for k in ('inputs', 'targets')}
state = state_lib.create(models.build(cfg.model), cfg, batch, jax.random.key(0))
parallel = partitioning.Partitioner('fsdp')
parallel.layout(state, state_lib.param_axes(models.build(cfg.model), cfg, batch))
state = parallel.place_state(state)
step = parallel.compile_step(steps.train_step, label_smoothing=0.0)
def shards(tree):
  return {jax.tree_util.keystr(k): [list(x.shape), list(x.addressable_shards[0].data.shape)]
          for k, x in jax.tree_util.tree_leaves_with_path(tree)}
before = shards(state.params)
new, _ = step(state, parallel.place_batch(batch), jax.random.key(1))  # donates state
print(json.dumps({'before': before, 'after': shards(new.params), 'mu': shards(new.opt_state)}))
'''


def test_fsdp_shards_params_and_optimizer_state_and_keeps_them_sharded():
  flags = os.environ.get('XLA_FLAGS', '')  # tests/conftest.py's, kept
  env = dict(os.environ, XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, '-c', FSDP_LAYOUT], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  for which in ('before', 'after', 'mu'):
    for path, (shape, shard) in got[which].items():
      divisible = [s for s in shape if s % 4 == 0 and s >= 4]
      if divisible:  # the largest divisible dimension is split 4 ways
        assert np.prod(shard) * 4 == np.prod(shape), (which, path, shape, shard)
        assert shape[[a // b if b else 0 for a, b in zip(shape, shard)].index(4)] == max(divisible)
      else:
        assert shard == shape, (which, path, shape, shard)
  # the embedding [12, 16] splits its 16 features; a [16] bias splits too
  assert got['after']["['embed']['embedding']"] == [[12, 16], [12, 4]]
