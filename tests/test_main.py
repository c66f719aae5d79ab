"""The command line end to end: an experiment file, overrides, outputs, resume."""
import glob
import json
import os
import runpy

import pytest

from flaxformer_lite import config as config_lib

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
  config_lib.validate(module['get_config']())
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
