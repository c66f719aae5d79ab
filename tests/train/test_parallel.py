"""Data parallelism: 1 device = 4 devices (jit) = 4 devices (pmap) = 4 devices
(fsdp, the state sharded), and a 4-device checkpoint resumes on 1 device;
gradient accumulation = the large batch; the train step compiles once; bf16
trains.

Several devices on CPU come from --xla_force_host_platform_device_count, which
must be set before jax starts: those runs are subprocesses.
"""
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
from flaxformer_lite import models
from flaxformer_lite.train import loop, metrics, state as state_lib, steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN_ON_4_DEVICES = '''
import json, sys
from flaxformer_lite import config as config_lib
from flaxformer_lite.train import loop
import jax
assert jax.device_count() == 4, jax.devices()
config = config_lib.from_json(open(sys.argv[1]).read())
loop.train_and_evaluate(config, sys.argv[2])
'''


def _on_4_devices(config, workdir, tmp_path):
  path = tmp_path / 'config.json'
  path.write_text(config_lib.to_json(config))
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, '-c', RUN_ON_4_DEVICES, str(path), workdir],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]


def _curve(workdir, key='loss'):
  return {r['step']: r[key] for r in metrics.read(workdir) if r['split'] == 'train'}


def _parallel_config(tiny_config):
  c = tiny_config
  c.model.dropout_rate = 0.0  # dropout masks are drawn per device in pmap mode
  c.train.num_steps, c.train.log_every, c.train.checkpoint_every = 20, 5, 10
  c.eval.final_test = False
  return c


def test_one_device_equals_four_devices_jit_pmap_fsdp_and_resumes_on_one(tiny_config, tmp_path):
  c = _parallel_config(tiny_config)
  loop.train_and_evaluate(c, str(tmp_path / 'one'))
  curves = {'one': _curve(str(tmp_path / 'one'))}
  for mode in ('jit', 'pmap', 'fsdp'):
    c.train.parallel = mode
    _on_4_devices(c, str(tmp_path / mode), tmp_path)
    curves[mode] = _curve(str(tmp_path / mode))
  assert sorted(curves['one']) == [5, 10, 15, 20]
  for mode in ('jit', 'pmap', 'fsdp'):
    for step, loss in curves['one'].items():
      assert curves[mode][step] == pytest.approx(loss, rel=2e-5), (mode, step)
  norms = [_curve(str(tmp_path / m), 'grad_norm')[20] for m in ('one', 'jit', 'pmap', 'fsdp')]
  np.testing.assert_allclose(norms, norms[0], rtol=1e-4)

  # The 4-device run's checkpoint at step 10 resumes here, on 1 device (orbax
  # restores onto this process's abstract target).
  parts = str(tmp_path / 'jit')
  shutil.rmtree(os.path.join(parts, 'checkpoints', '20'))
  c.train.parallel = 'jit'
  loop.train_and_evaluate(c, parts)
  resumed = _curve(parts)
  for step in (15, 20):
    assert resumed[step] == pytest.approx(curves['one'][step], rel=2e-5)


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


def test_the_train_step_compiles_once(tiny_config, tmp_path, caplog):
  c = tiny_config
  c.train.num_steps, c.train.log_every, c.train.eval_every = 30, 10, 30
  c.eval.final_test = False
  jax.config.update('jax_log_compiles', True)
  try:
    with caplog.at_level(logging.WARNING):
      loop.train_and_evaluate(c, str(tmp_path / 'run'))
  finally:
    jax.config.update('jax_log_compiles', False)
  compiles = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith('Compiling jit(train_step)')]
  assert len(compiles) == 1, compiles  # 30 steps, 3 logs, an eval: one compilation


def test_bfloat16_compute_trains_with_float32_params_and_loss(tiny_config, tmp_path):
  c = tiny_config
  c.model.dtype = 'bfloat16'
  c.train.num_steps, c.train.log_every, c.train.eval_every = 30, 10, 30
  c.eval.final_test = False
  loop.train_and_evaluate(c, str(tmp_path / 'bf16'))
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
parallel = partitioning.DataParallel('fsdp')
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
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
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
