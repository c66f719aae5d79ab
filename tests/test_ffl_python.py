"""FFL_PYTHON: launch.sh in an interpreter that came with JAX, as it is, and
the packages a run of a synthetic task does without (tensorflow-datasets,
tensorboardX).

A Python that lacks a package is this one with a sitecustomize.py on
PYTHONPATH that sets sys.modules[name] = None for it: `import name` then
raises ModuleNotFoundError, in it and in every process it starts."""
import os
import platform
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import data
from flaxformer_lite.data import corpora, synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MALLOC_VARS = ('MALLOC_ARENA_MAX', 'MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_')
# The quick start's overrides (tests/test_readme.py): seconds, and its compiled steps.
TINY = ['--config.model.d_model=16', '--config.model.num_heads=2', '--config.model.mlp_dim=32',
        '--config.model.num_decoder_layers=1', '--config.train.num_steps=2',
        '--config.train.log_every=1', '--config.train.eval_every=2',
        '--config.train.checkpoint_every=2', '--config.model.num_encoder_layers=1',
        '--config.data.max_len=5', '--config.data.num_train=64', '--config.data.num_eval=8',
        '--config.train.batch_size=8', '--config.eval.batch_size=8']


def requirement(distribution: str) -> str:
  """pyproject.toml's requirement line for `distribution`, e.g. 'tensorboardX>=2.6'."""
  with open(os.path.join(REPO, 'pyproject.toml')) as f:
    return re.search(r'"(%s(?:[<>=!~][^"]*)?)"' % re.escape(distribution), f.read()).group(1)


def launch(*args, blocked=(), tmp_path):
  """launch.sh with FFL_PYTHON = this interpreter, `blocked` modules made
  unimportable, and FFL_VENV a folder that must stay absent."""
  block = tmp_path / 'block'
  block.mkdir(exist_ok=True)
  (block / 'sitecustomize.py').write_text(
      f'import sys\nsys.modules.update(dict.fromkeys({tuple(blocked)!r}))\n')
  base = {k: v for k, v in os.environ.items()
          if k not in MALLOC_VARS + ('FFL_SYSTEM_MALLOC', 'FFL_VENV', 'CI')}
  base.update(FFL_PYTHON=sys.executable, FFL_VENV=str(tmp_path / 'no_venv'),
              PYTHONPATH=str(block))
  done = subprocess.run(['bash', os.path.join(REPO, 'launch.sh'), *args], cwd=REPO,
                        env=base, capture_output=True, text=True, timeout=300)
  assert not (tmp_path / 'no_venv').exists()
  return done


def test_a_missing_package_is_named_with_its_pip_line_and_exit_2(tmp_path):
  """Every command needs the core packages (ml_collections among them), the
  tests also pytest-xdist: one pip line names each that does not import,
  with pyproject.toml's specifier, before anything runs."""
  python = shlex.quote(sys.executable)
  done = launch('test', blocked=('ml_collections', 'xdist'), tmp_path=tmp_path)
  assert (done.returncode, done.stdout) == (2, '')
  assert done.stderr.splitlines() == [
      f'launch.sh: FFL_PYTHON={python} cannot import ml_collections, xdist (needed by '
      './launch.sh test); install with',
      f"  {python} -m pip install 'ml-collections>=1.0' 'pytest-xdist>=3.5'",
      'or leave FFL_PYTHON unset (launch.sh then sets up .venv).']
  assert [requirement('ml-collections'), requirement('pytest-xdist')] == [
      'ml-collections>=1.0', 'pytest-xdist>=3.5']


def test_the_venv_python_runs_as_it_is(tmp_path):
  """FFL_PYTHON=.venv/bin/python: no venv made or checked, the checkout first
  on PYTHONPATH, the malloc settings as with the venv."""
  printed = ('import os, flaxformer_lite; print(flaxformer_lite.__file__); '
             f'print(os.environ["PYTHONPATH"]); print(*map(os.environ.get, {MALLOC_VARS!r}))')
  done = launch('run', '-c', printed, tmp_path=tmp_path)
  assert done.returncode == 0, done.stderr
  module, path, malloc = done.stdout.splitlines()
  assert module == os.path.join(REPO, 'flaxformer_lite', '__init__.py')
  assert path.split(os.pathsep) == [REPO, str(tmp_path / 'block')]
  if platform.system() == 'Linux':  # as with the venv (tests/test_launch.py)
    assert malloc.split() == ['1', '1073741824', '8589934592']
  listed = launch('--list_attention', tmp_path=tmp_path)
  assert listed.returncode == 0, listed.stderr
  assert listed.stdout.split('\n')[0].split() == ['name', 'models', 'kernels', 'options']


def test_the_default_experiment_runs_without_tfds_and_tensorboardx(tmp_path):
  """Its data generated in memory (one line says so; nothing written to the
  data dir), metrics.jsonl without TensorBoard's event files (one warning
  with the pip line)."""
  workdir, data_dir = tmp_path / 'run', tmp_path / 'tfds'
  done = launch(*TINY, f'--workdir={workdir}', f'--config.data.data_dir={data_dir}',
                blocked=('tensorflow_datasets', 'tensorboardX'), tmp_path=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'step 2/2' in done.stdout
  assert 'data: reverse generated in memory (tensorflow_datasets is not installed)' in done.stdout
  warning = ("TensorBoard event files are not written: this Python lacks tensorboardX "
             f"({sys.executable} -m pip install '{requirement('tensorboardX')}' adds it); "
             "metrics.jsonl holds every point")
  assert done.stderr.count(warning) == 1, done.stderr[-3000:]
  assert 'Traceback' not in done.stderr
  files = os.listdir(workdir)
  assert 'metrics.jsonl' in files and not any(f.startswith('events.out') for f in files)
  assert os.listdir(data_dir) == ['.flaxformer_lite.lock']


@pytest.mark.usefixtures('tfds')
@pytest.mark.parametrize('overrides', [
    {},  # the default experiment's task
    {'task': 'mqar', 'test_lengths': (9, 12)},  # its own generator, test_long spread
], ids=['reverse', 'mqar'])
def test_in_memory_examples_are_the_tfds_builders(tmp_path, monkeypatch, overrides):
  """Without TFDS, data.load gives the splits the TFDS files hold, row for row
  (TFDS's order: md5 of split + key), so the first training batch is the same."""
  config = config_lib.base_config()
  d = config.data
  d.data_dir, d.num_train, d.num_eval = str(tmp_path), 256, 24
  d.update(overrides)
  written = data.load(d)
  monkeypatch.setattr(synthetic, 'tfds', None)
  generated = data.load(d)
  assert generated.splits.keys() == written.splits.keys() == set(synthetic.split_plans(
      synthetic.spec(d)))
  for split, arrays in written.splits.items():
    for k in arrays:
      np.testing.assert_array_equal(generated.splits[split][k], arrays[k], err_msg=split)
  assert generated.length_groups.keys() == written.length_groups.keys()
  for split, lengths in written.length_groups.items():
    np.testing.assert_array_equal(generated.length_groups[split], lengths)
  first = [next(data.Batches(ds.splits['train'], config.train.batch_size, seed=config.seed))
           for ds in (written, generated)]
  np.testing.assert_array_equal(first[0]['inputs'], first[1]['inputs'])


def test_a_real_corpus_without_tfds_is_a_data_error_naming_the_pip_line(monkeypatch, tmp_path):
  monkeypatch.setattr(corpora, 'tfds', None)
  d = config_lib.base_config().data
  d.task, d.data_dir = 'tiny_shakespeare', str(tmp_path)
  with pytest.raises(data.DataError) as e:
    data.load(d)
  line = ' '.join(shlex.quote(requirement(name)) for name in (
      'tensorflow-datasets', 'importlib_resources', 'array-record'))
  assert f'{sys.executable} -m pip install {line} adds it' in str(e.value)
  assert str(e.value).startswith('data.task=tiny_shakespeare reads its corpus through '
                                 'tensorflow_datasets, which this Python lacks')
