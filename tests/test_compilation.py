"""The persistent compilation cache: where it lives, and the log line that says
whether it served a compile."""
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import compilation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cache_dir_follows_the_environment(tmp_path):
  home = os.path.expanduser('~')
  assert compilation.cache_dir({}) == os.path.join(home, '.cache', 'flaxformer_lite', 'jax')
  assert compilation.cache_dir({'XDG_CACHE_HOME': '/x'}) == '/x/flaxformer_lite/jax'
  assert compilation.cache_dir({'JAX_COMPILATION_CACHE_DIR': '/j'}) == '/j'
  assert compilation.cache_dir({'FFL_COMPILE_CACHE': str(tmp_path),
                                'JAX_COMPILATION_CACHE_DIR': '/j'}) == str(tmp_path)
  assert compilation.cache_dir({'FFL_COMPILE_CACHE': '~/c'}) == os.path.join(home, 'c')
  assert compilation.cache_dir({'FFL_COMPILE_CACHE': 'off'}) is None
  assert compilation.cache_dir({'FFL_COMPILE_CACHE': 'OFF'}) is None


def _program(seed):
  """A function no other test compiles (its constant is this call's)."""
  constant = float(np.random.default_rng(seed).normal())
  return jax.jit(lambda x: jnp.tanh(x @ x.T + constant).sum())


def _messages(caplog):
  return [r.getMessage() for r in caplog.records if r.name == 'flaxformer_lite']


def test_a_second_compile_after_the_in_memory_caches_are_gone_is_served_from_disk(caplog):
  x = jnp.ones((8, 8))
  seed = int.from_bytes(os.urandom(4), 'little')
  with caplog.at_level(logging.INFO, logger='flaxformer_lite'):
    _, first = compilation.compile_logged('probe', _program(seed), x)
    jax.clear_caches()
    _, second = compilation.compile_logged('probe', _program(seed), x)
  first_line, second_line = _messages(caplog)
  assert first_line.startswith('probe compiled in '), first_line
  assert second_line.startswith('probe: cache, '), second_line
  assert float(second(x)) == pytest.approx(float(first(x)))


_OFF = """
import logging, sys
import jax, jax.numpy as jnp
from flaxformer_lite import compilation
logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stdout)
print('dir', compilation.enable_cache())
for _ in range(2):
  compilation.compile_logged('probe', jax.jit(lambda x: jnp.tanh(x @ x.T).sum()), jnp.ones((8, 8)))
  jax.clear_caches()
"""


def test_off_compiles_every_time(tmp_path):
  """FFL_COMPILE_CACHE=off, in a process of its own: JAX decides once per
  process whether it uses the cache."""
  env = {**os.environ, 'FFL_COMPILE_CACHE': 'off', 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run([sys.executable, '-c', _OFF], env=env, capture_output=True, text=True,
                       timeout=120, cwd=REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0] == 'dir None'
  assert [line.split(' in ')[0] for line in lines[1:]] == ['probe compiled'] * 2, lines


@pytest.mark.parametrize('plugin', [None, 'jax_cuda12_plugin', 'jax_cuda13_plugin'])
def test_gpu_xla_flags_are_added_where_the_cuda_plugin_is_and_a_users_setting_wins(
    monkeypatch, plugin):
  monkeypatch.setattr(compilation.importlib.util, 'find_spec',
                      lambda name: object() if name == plugin else None)
  assert compilation.xla_flags({}) == ('' if plugin is None else
                                       ' '.join(compilation.GPU_XLA_FLAGS))
  name = compilation.GPU_XLA_FLAGS[0].split('=')[0]
  mine = f'--xla_dump_to=/tmp/d {name}=true'
  flags = compilation.xla_flags({'XLA_FLAGS': mine})
  assert flags.startswith(mine) and flags.count(name) == 1
  assert all(f in flags for f in compilation.GPU_XLA_FLAGS[1:]) == (plugin is not None)


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_the_loop_compiles_the_eval_programs_beside_the_train_step_on_cpu_only(
    monkeypatch, backend):
  """The train step is lowered in the caller's thread (tracing is not safe in
  two threads), its XLA compile runs in a thread: beside the eval programs'
  on CPU, before them on a GPU."""
  import threading

  from flaxformer_lite.train import loop
  events, train_started, eval_done = [], threading.Event(), threading.Event()

  def in_main():
    return threading.current_thread() is threading.main_thread()

  class Lowered:
    def compile(self):
      events.append(('train starts', in_main()))
      train_started.set()
      eval_done.wait(timeout=2)  # returns at once where the eval compiles alongside
      events.append(('train ends', None))
      return 'compiled'

  class Jitted:
    def lower(self, *args):
      events.append(('train lowered', in_main()))
      return lowered

  def eval_programs(*_):
    train_started.wait(timeout=10)
    events.append(('eval', in_main()))
    eval_done.set()
    yield 'eval step', None

  lowered = Lowered()
  monkeypatch.setattr(loop.jax, 'default_backend', lambda: backend)
  monkeypatch.setattr(loop, '_eval_programs', eval_programs)
  train = compilation.Compiling('train step', Jitted(), 'state', 'batch')
  assert loop._compile_programs(None, None, None, None, train) == (lowered, 'compiled')
  order = [name for name, _ in events]
  threads = dict(events)
  assert threads['train lowered'] and threads['eval'] and not threads['train starts']
  if backend == 'gpu':  # one after another
    assert order == ['train lowered', 'train starts', 'train ends', 'eval']
  else:  # the eval program compiled while the train step did
    assert order == ['train lowered', 'train starts', 'eval', 'train ends']
