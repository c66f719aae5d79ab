"""launch.sh: the `run` subcommand and the glibc malloc settings it exports.

What the settings do to page faults is measured by benchmarks/page_faults.py
(a timing-dependent property, so not asserted here)."""
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
  assert r.stdout.split() == ['1', '4294967296', '8589934592']
  r = launch('run', '-c', PRINT_ENV, env={'MALLOC_ARENA_MAX': '4'})
  assert r.stdout.split() == ['4', '4294967296', '8589934592']  # a value already set wins
  r = launch('run', '-c', PRINT_ENV, env={'FFL_SYSTEM_MALLOC': '1'})
  assert r.stdout.split() == ['-', '-', '-']
