"""Compile once: JAX's persistent compilation cache, and compiling with a log line.

Every run, test and benchmark compiles through one on-disk cache, so the same
step compiled again (a resumed run, the same experiment tomorrow, a sweep's
next seed) is read back instead of rebuilt. The cache lives in
`$XDG_CACHE_HOME/flaxformer_lite/jax` (default `~/.cache/...`);
FFL_COMPILE_CACHE=DIR moves it and FFL_COMPILE_CACHE=off turns it off. A
JAX_COMPILATION_CACHE_DIR already set (the test suite's own folder) is kept
when FFL_COMPILE_CACHE is not given. On a GPU, XLA's autotuning results (which
algorithm each fusion and matmul takes) are cached in the same folder.

On a machine with JAX's CUDA plugin, `set_xla_flags` adds GPU_XLA_FLAGS to
XLA_FLAGS (each unless XLA_FLAGS already names it, so a user's setting wins).
"""
from __future__ import annotations

import collections
import importlib.util
import logging
import os
import threading
import time

import jax
from jax import monitoring

from flaxformer_lite.train import preemption

ENV = 'FFL_COMPILE_CACHE'
_HITS, _MISSES = '/jax/compilation_cache/cache_hits', '/jax/compilation_cache/cache_misses'
# The cache's hits and misses per thread: two programs compile at once (the
# train step in a thread, the eval steps in the caller's).
_counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
_listening = False
# XLA:GPU's defaults spend a train step's compile on autotuning: Triton
# matmul kernels, each tried in many tilings (compiled and timed on the
# device), where cuBLAS's own choice runs the recipe's step as fast; and the
# fusion autotuner, which compiles each reduction and transpose fusion with
# several emitters to time them. benchmarks/compile_flags.py measures the
# compile and step times with and without these ('xla defaults').
GPU_XLA_FLAGS = ('--xla_gpu_enable_triton_gemm=false',
                 '--xla_gpu_experimental_enable_fusion_autotuner=false')


def xla_flags(environ) -> str:
  """XLA_FLAGS with GPU_XLA_FLAGS added where the CUDA plugin is installed."""
  flags = environ.get('XLA_FLAGS', '')
  if not any(importlib.util.find_spec(m) for m in ('jax_cuda12_plugin', 'jax_cuda13_plugin')):
    return flags
  for flag in GPU_XLA_FLAGS:
    if flag.split('=')[0] not in flags:
      flags = f'{flags} {flag}'.strip()
  return flags


def set_xla_flags() -> None:
  """os.environ's XLA_FLAGS as `xla_flags` gives them (subprocesses inherit
  them). Call before anything touches a device: XLA reads them once, when
  JAX first creates its backend."""
  flags = xla_flags(os.environ)
  if flags:
    os.environ['XLA_FLAGS'] = flags


def cache_dir(environ=None) -> str | None:
  """The cache folder the environment asks for; None when it is off."""
  environ = os.environ if environ is None else environ
  value = environ.get(ENV, '').strip()
  if value.lower() == 'off':
    return None
  if value:
    return os.path.abspath(os.path.expanduser(value))
  if environ.get('JAX_COMPILATION_CACHE_DIR'):
    return environ['JAX_COMPILATION_CACHE_DIR']
  base = environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'flaxformer_lite', 'jax')


def enable_cache(environ=None) -> str | None:
  """Points JAX's persistent cache at `cache_dir` (every compiled program,
  however quick to compile: a run's warm start is the sum of many small
  ones), or turns it off. Call before the first compilation. Returns the
  folder, or None."""
  directory = cache_dir(environ)
  if directory is None:
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  os.makedirs(directory, exist_ok=True)
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  jax.config.update('jax_persistent_cache_enable_xla_caches',
                    'xla_gpu_per_fusion_autotune_cache_dir')
  return directory


def _count(event: str, **_):
  if event in (_HITS, _MISSES):
    _counts[threading.get_ident()][event] += 1


class Compiling:
  """A program lowered, its XLA compile running in a thread of its own (so
  that a signal stops the run mid-compile: train/preemption.py, and so that
  the caller can lower and compile another program meanwhile: XLA releases
  the GIL). Lowering stays in the caller's thread: tracing runs Python that
  is not safe in two threads at once (flax builds the classes of nn.scan and
  nn.remat while tracing, and empties a base class's dataclass fields while
  it does)."""

  def __init__(self, name: str, jitted, *args, log: logging.Logger | None = None):
    global _listening
    if not _listening:
      monitoring.register_event_listener(_count)
      _listening = True
    self.name, self._log = name, log or logging.getLogger('flaxformer_lite')
    start = time.perf_counter()
    self.lowered = jitted.lower(*args)
    self.lowered_seconds = time.perf_counter() - start
    self._pending = preemption.start(self._compile)

  def _compile(self):
    counts = _counts[threading.get_ident()]
    hits, misses = counts[_HITS], counts[_MISSES]
    start = time.perf_counter()
    compiled = self.lowered.compile()
    served = counts[_HITS] > hits and counts[_MISSES] == misses
    return compiled, served, time.perf_counter() - start

  def result(self):
    """(lowered, compiled), after one log line saying how long each took and
    whether the persistent cache served it ('NAME compiled in ... s (lowered
    in ... s)' or 'NAME: cache, ... s (lowered in ... s)')."""
    compiled, served, seconds = self._pending.result()
    self._log.info('%s: cache, %.1f s (lowered in %.1f s)' if served else
                   '%s compiled in %.1f s (lowered in %.1f s)', self.name, seconds,
                   self.lowered_seconds)
    return self.lowered, compiled


def compile_logged(name: str, jitted, *args, log: logging.Logger | None = None):
  """jitted.lower(*args) and its compile, logged (Compiling.result).
  Returns (lowered, compiled)."""
  return Compiling(name, jitted, *args, log=log).result()
