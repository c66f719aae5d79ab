"""Shared by the benchmark scripts: XLA memory analysis and interleaved timing."""
import statistics
import time

import jax


def memory(fn, args):
  """MiB that XLA reserves for jitted fn(*args): {'temp', 'argument', 'output'}."""
  m = fn.lower(*args).compile().memory_analysis()
  sizes = {k: getattr(m, f'{k}_size_in_bytes', None) for k in ('temp', 'argument', 'output')}
  return {k: v / 2**20 for k, v in sizes.items() if v is not None}


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


median = statistics.median
