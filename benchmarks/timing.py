"""Shared by the benchmark scripts: XLA memory analysis, interleaved timing, table cells.

Importing it turns on the persistent compilation cache (flaxformer_lite/compilation.py)."""
import statistics
import time

import jax

from flaxformer_lite import compilation

compilation.set_xla_flags()
compilation.enable_cache()


def memory(fn, args):
  """MiB that XLA reserves for jitted fn(*args): {'temp', 'argument', 'output'}."""
  m = fn.lower(*args).compile().memory_analysis()
  sizes = {k: getattr(m, f'{k}_size_in_bytes', None) for k in ('temp', 'argument', 'output')}
  return {k: v / 2**20 for k, v in sizes.items() if v is not None}


def compile_all(builds, errors=(ValueError, NotImplementedError)):
  """builds: {name: () -> (jitted fn, args)} -> ({name: (fn, args)}, {name: temp MiB},
  {name: why it did not build or compile}).

  A kernel that refuses a configuration raises ValueError (or
  NotImplementedError) while the step is built or traced; that is reported,
  not raised, so that a table can print '-' for it and go on with the rest.
  errors: the exceptions reported so; a table of kernels not yet run on the
  machine may pass Exception (a Triton lowering error, XLA out of memory).
  """
  fns, temps, failed = {}, {}, {}
  for name, build in builds.items():
    try:
      fn, args = build()
      temps[name] = memory(fn, args)['temp']
    except errors as e:
      failed[name] = why(e)
    else:
      fns[name] = fn, args
  return fns, temps, failed


def why(e: Exception) -> str:
  """An exception as one line of a table's list of failures: its type and first line."""
  return f'{type(e).__name__}: {(str(e).splitlines() or [""])[0]}'


def interleaved_times(fns, repeats):
  """fns: {name: (jitted fn, args)} -> {name: [ms per call]}.

  Compiles and warms up each, then times them call by call in rotating order,
  so other load on the machine hits all of them alike.
  """
  for fn, args in fns.values():
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  names = list(fns)
  times = {name: [] for name in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      fn, args = fns[name]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(1e3 * (time.perf_counter() - t0))
  return times


def page_faults(fn, args, calls=5):
  """Minor page faults per call of jitted fn(*args), or None without getrusage.

  XLA:CPU mallocs each call's temp buffer. glibc serves a request above its
  mmap threshold (at most 32 MiB, see mallopt(3)) with fresh pages, so such a
  call faults in about one page per 4 KiB of temp memory, every call.
  """
  try:
    import resource
  except ImportError:  # not on Windows
    return None
  jax.block_until_ready(fn(*args))
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(calls):
    jax.block_until_ready(fn(*args))
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def ratio(a, b):
  """a / b, or None where either was not measured."""
  return None if a is None or b is None else a / b


def cell(value, spec):
  """value in format spec ('9.0f'), or '-' right-aligned to the same width."""
  return format(value, spec) if value is not None else format('-', '>' + spec.split('.')[0])


median = statistics.median
