"""launch.sh: the `run` subcommand and the glibc malloc settings it exports."""
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

# A jitted gradient whose XLA temp buffer (~68 MiB of [4096, 4096] float32
# intermediates) is far above glibc's largest default mmap threshold (32 MiB).
FAULTS = """
import resource, jax, jax.numpy as jnp
f = jax.jit(jax.grad(lambda x: jnp.sum(jnp.tanh(x @ x.T) ** 2)))
x = jnp.ones((4096, 256), jnp.float32) / 256
m = f.lower(x).compile().memory_analysis().temp_size_in_bytes
assert m > 48 * 2**20, m
for _ in range(3):
  f(x).block_until_ready()
faults = []
for _ in range(11):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[5])  # the median call
"""


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


@glibc_only
def test_malloc_settings_stop_per_call_page_faults():
  """Under plain glibc every call maps its >32 MiB temp buffer afresh and
  faults it in (~one fault per 4 KiB); under launch.sh it stays in the heap.
  (Some calls there still fault a whole fresh buffer in, by timing: 0-4 of 11
  in a run here; hence the median call.)"""
  skip_unless_launch_uses_this_venv()
  plain = launch('run', '-c', FAULTS, env={'FFL_SYSTEM_MALLOC': '1'})
  tuned = launch('run', '-c', FAULTS)
  assert plain.returncode == 0 and tuned.returncode == 0, plain.stderr + tuned.stderr
  plain_faults, tuned_faults = float(plain.stdout.split()[-1]), float(tuned.stdout.split()[-1])
  assert plain_faults > 4000, plain_faults  # >= 16 MiB of fresh pages every call
  assert tuned_faults < 100, tuned_faults
