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

import importlib.util
import logging
import os
import time

import jax
from jax import monitoring

from flaxformer_lite.train import preemption

ENV = 'FFL_COMPILE_CACHE'
_HITS, _MISSES = '/jax/compilation_cache/cache_hits', '/jax/compilation_cache/cache_misses'
_counts = {_HITS: 0, _MISSES: 0}
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
  if event in _counts:
    _counts[event] += 1


def compile_logged(name: str, jitted, *args, log: logging.Logger | None = None):
  """jitted.lower(*args) and its compile, with one log line saying how long
  each took and whether the persistent cache served it ('NAME compiled in
  ... s (lowered in ... s)' or 'NAME: cache, ... s (lowered in ... s)').
  Returns (lowered, compiled)."""
  global _listening
  if not _listening:
    monitoring.register_event_listener(_count)
    _listening = True
  start = time.perf_counter()
  lowered = jitted.lower(*args)
  lowered_seconds = time.perf_counter() - start
  hits, misses = _counts[_HITS], _counts[_MISSES]
  start = time.perf_counter()
  # In a thread of its own, so that a signal stops the run mid-compile
  # (train/preemption.py).
  compiled = preemption.start(lowered.compile).result()
  seconds = time.perf_counter() - start
  served = _counts[_HITS] > hits and _counts[_MISSES] == misses
  (log or logging.getLogger('flaxformer_lite')).info(
      '%s: cache, %.1f s (lowered in %.1f s)' if served else
      '%s compiled in %.1f s (lowered in %.1f s)', name, seconds, lowered_seconds)
  return lowered, compiled
