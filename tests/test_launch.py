"""launch.sh: its help, --devices, the `run` subcommand, the glibc malloc
settings it exports and the bytecode of the venv it installs.

What the settings do to page faults is measured by benchmarks/page_faults.py
(a timing-dependent property, so not asserted here)."""
import importlib.util
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MALLOC_VARS = ('MALLOC_ARENA_MAX', 'MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_')
glibc_only = pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='the malloc settings are for glibc on Linux')


def launch(*args, env=None):
  base = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS + ('FFL_SYSTEM_MALLOC',)}
  # The venv that runs these tests, so launch.sh neither builds nor reinstalls one.
  base['FFL_VENV'] = os.path.dirname(os.path.dirname(sys.executable))
  return subprocess.run(['bash', os.path.join(ROOT, 'launch.sh'), *args], cwd=ROOT,
                        env={**base, **(env or {})}, capture_output=True, text=True, timeout=300)


def skip_unless_launch_uses_this_venv():
  venv = os.path.dirname(os.path.dirname(sys.executable))
  if not os.path.isfile(os.path.join(venv, '.pyproject.sha256')):
    pytest.skip(f'{venv} was not made by launch.sh (it would install a new one)')


PRINT_ENV = 'import os; print(" ".join(os.environ.get(k, "-") for k in %r))' % (MALLOC_VARS,)


def test_run_needs_a_script():
  skip_unless_launch_uses_this_venv()
  r = launch('run')
  assert r.returncode == 2, r.stderr
  assert 'run needs a script' in r.stderr


@glibc_only
def test_malloc_settings_exported_unless_set_or_disabled():
  skip_unless_launch_uses_this_venv()
  r = launch('run', '-c', PRINT_ENV)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ['1', '1073741824', '8589934592']
  r = launch('run', '-c', PRINT_ENV, env={'MALLOC_ARENA_MAX': '4'})
  assert r.stdout.split() == ['4', '1073741824', '8589934592']  # a value already set wins
  r = launch('run', '-c', PRINT_ENV, env={'FFL_SYSTEM_MALLOC': '1'})
  assert r.stdout.split() == ['-', '-', '-']


HELP_NAMES = ('./launch.sh test', './launch.sh run SCRIPT.py', '-m MODULE', './launch.sh sweep',
              '--list_attention', 'experiments/reverse.py', '--config.a.b=value',
              '--config.model.attention=shaw', '--workdir=DIR', 'workdirs/EXPERIMENT-KEY=VALUE,...-HASH',
              '--devices=N', 'Exit codes: 0 done; 2 bad flag, config or data',
              '3 non-finite loss', '130 a second SIGINT (143 a second SIGTERM)',
              '--config.data.manual_dir', '../shared/data', 'stdout',
              'FFL_PYTHON=python3')


def test_help_is_one_text_exit_0_without_a_venv(tmp_path):
  """--help, -h, help (and --help among an experiment's flags) print the same
  usage and exit 0, before any venv is made."""
  venv = tmp_path / 'no_venv'
  runs = [launch(*args, env={'FFL_VENV': str(venv)}) for args in (
      ['--help'], ['-h'], ['help'], ['experiments/reverse.py', '--config.seed=1', '--help'])]
  for r in runs:
    assert (r.returncode, r.stderr, r.stdout) == (0, '', runs[0].stdout)
  for name in HELP_NAMES:
    assert name in runs[0].stdout, name
  assert not venv.exists()


def test_devices_sets_the_cpu_device_count_for_every_command(tmp_path):
  """--devices=N before `run` reaches the script as N CPU devices, appended to
  XLA_FLAGS; among an experiment's flags it is taken out before main.py (which
  would refuse it); a bad count exits 2 before anything starts."""
  skip_unless_launch_uses_this_venv()
  r = launch('--devices=4', 'run', '-c',
             'import os, jax; print(jax.device_count(), os.environ["XLA_FLAGS"])',
             env={'XLA_FLAGS': '--xla_backend_optimization_level=0', 'JAX_PLATFORMS': 'cpu'})
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ['4', '--xla_backend_optimization_level=0',
                              '--xla_force_host_platform_device_count=4']
  r = launch('experiments/reverse.py', '--devices=2', '--list_attention', env={'COLUMNS': '72'})
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert lines[0].split() == ['name', 'models', 'kernels', 'options']
  assert max(map(len, lines)) <= 72
  for bad in ('--devices=0', '--devices=two', '--devices'):
    r = launch(bad, env={'FFL_VENV': str(tmp_path / 'no_venv')})
    assert r.returncode == 2 and '--devices=N' in r.stderr, (bad, r.stderr)


def test_fetch_names_the_models_it_knows():
  skip_unless_launch_uses_this_venv()
  r = launch('fetch', 'gpt5')
  assert r.returncode == 2, r.stderr
  assert "unknown model 'gpt5'; valid: minilm, smollm2" in r.stderr
  r = launch('fetch')
  assert r.returncode == 2 and 'usage: ./launch.sh fetch NAME; NAME: minilm, smollm2' in r.stderr


def test_the_venv_holds_the_bytecode_of_every_module_of_its_packages():
  """launch.sh byte-compiles the packages it installs: where
  PYTHONDONTWRITEBYTECODE is set, Python would otherwise compile jax, flax
  and the rest from source in every process (each test worker, each run a
  test starts). Every module has its bytecode, imported by now or not."""
  skip_unless_launch_uses_this_venv()
  import flax
  import jax
  for package in (jax, flax):
    root = os.path.dirname(package.__file__)
    sources = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
               if f.endswith('.py')]
    missing = [s for s in sources if not os.path.exists(importlib.util.cache_from_source(s))]
    assert sources and not missing, (
        f'{len(missing)} of {len(sources)} modules without bytecode, e.g. {missing[:3]}')
