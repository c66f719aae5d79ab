"""The command line end to end: an experiment file, overrides, outputs, resume."""
import glob
import json
import os
import runpy
import subprocess
import sys

import pytest

from flaxformer_lite import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(glob.glob(os.path.join(REPO, 'experiments', '*.py')))
TINY = ['--config.model.d_model=16', '--config.model.num_heads=2', '--config.model.mlp_dim=32',
        '--config.model.num_encoder_layers=1', '--config.model.num_decoder_layers=1',
        '--config.data.max_len=5', '--config.data.num_train=256', '--config.data.num_eval=20',
        '--config.train.batch_size=8', '--config.train.log_every=3',
        '--config.train.eval_every=6', '--config.train.checkpoint_every=3',
        '--config.eval.batch_size=10']


@pytest.mark.parametrize('path', EXPERIMENTS, ids=os.path.basename)
def test_every_experiment_file_is_valid_and_documents_its_command(path):
  module = runpy.run_path(path)
  main.validate(module['get_config']())
  assert './launch.sh' in module['__doc__'] and 'Expected' in module['__doc__']


def test_default_experiment_runs_and_resumes_from_the_command_line(tmp_path, tfds_dir, run_main):
  workdir = tmp_path / 'run'
  common = [f'--workdir={workdir}', f'--config.data.data_dir={tfds_dir}', *TINY]
  proc = run_main(*common, '--config.train.num_steps=6')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'step 6/6' in proc.stderr and 'sequence_accuracy' in proc.stderr
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['model']['d_model'] == 16 and saved['train']['num_steps'] == 6

  proc = run_main(*common, '--config.train.num_steps=9')  # same command, longer
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Resumed from' in proc.stderr and 'at step 6' in proc.stderr
  steps = [json.loads(line)['step'] for line in (workdir / 'metrics.jsonl').read_text().splitlines()
           if json.loads(line)['split'] == 'train']
  assert steps == [3, 6, 9]


START_ON_DEVICES = '''
import json, runpy, sys
import jax, numpy as np
from flaxformer_lite import config as config_lib, data, main, models
from flaxformer_lite.train import loop, partitioning, state as state_lib, steps
n = jax.device_count()
lower, out = sys.argv[1] == 'lower', {}
for path in sys.argv[2:]:
  config = runpy.run_path(path)['get_config']()
  main.validate(config)
  m, t, d = config.model, config.train, config.data
  objective = steps.OBJECTIVES[m.type]
  with config.unlocked():
    m.vocab_size = m.vocab_size or 40  # the data's, once loaded
  width = d.max_len + (objective == 'seq2seq')  # + EOS
  rows = t.batch_tokens // width if t.batch_tokens else t.batch_size
  batch = {k: np.full((rows, width), 5, np.int32) for k in ('inputs', 'targets')}
  parallel = partitioning.Partitioner(t.parallel)
  train_rows = partitioning.padded_rows(rows, jax.local_device_count() * t.grad_accum_steps)
  placed = parallel.place_batch(data.pad_rows(batch, train_rows))
  if lower:
    model = models.build(m)
    state = jax.eval_shape(lambda: state_lib.create(model, config, batch, jax.random.key(0)))
    if t.parallel != 'pmap':
      parallel.layout(state, state_lib.param_axes(model, config, batch))
    step = parallel.compile_step(
        steps.train_step, label_smoothing=t.label_smoothing, objective=objective,
        vocab_size=m.vocab_size, grad_accum_steps=t.grad_accum_steps)
    step.lower(state, placed, jax.random.key(1))
  eval_rows = partitioning.padded_rows(config.eval.batch_size, n)
  eval_batch = next(data.eval_batches({k: v[:1] for k, v in batch.items()},
                                      config.eval.batch_size, rows=eval_rows))
  parallel.place_eval_batch(eval_batch)
  out[path] = [rows, train_rows, config.eval.batch_size, eval_rows]
print(json.dumps(out))
'''


@pytest.mark.parametrize('devices', [2, 4, 8])
def test_every_experiment_starts_unchanged_on_several_devices(devices):
  """Each experiment file as shipped, on `devices` CPU devices: its config
  validates, its train batch (padded with weight-0 rows where it does not
  split) and its eval batch are placed on the mesh, and (8 devices) its train
  step lowers. (Training on padded batches = unpadded: tests/train/test_parallel.py.)"""
  flags = os.environ.get('XLA_FLAGS', '')  # tests/conftest.py's, kept
  env = dict(os.environ, XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count={devices}',
             JAX_PLATFORMS='cpu')
  lower = 'lower' if devices == 8 else 'place'
  done = subprocess.run([sys.executable, '-c', START_ON_DEVICES, lower, *EXPERIMENTS], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  plans = json.loads(done.stdout.strip().splitlines()[-1])
  assert sorted(plans) == EXPERIMENTS
  for path, (rows, train_rows, eval_size, eval_rows) in plans.items():
    accum = runpy.run_path(path)['get_config']().train.grad_accum_steps
    assert train_rows % (devices * accum) == 0 and 0 <= train_rows - rows < devices * accum
    assert eval_rows % devices == 0 and 0 <= eval_rows - eval_size < devices
