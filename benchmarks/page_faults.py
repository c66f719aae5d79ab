"""Minor page faults per call of a step with ~68 MiB of temp memory, with and
without the glibc malloc settings of ./launch.sh.

The step is a jitted gradient whose XLA temp buffer (float32 [4096, 4096]
intermediates) is far above glibc's largest default mmap threshold (32 MiB).
Under plain glibc every call maps that buffer afresh and faults it in, about
one fault per 4 KiB page; under launch.sh's settings it stays in the heap
(benchmarks/KERNELS.md, "CPU allocator"). Some calls there still fault a whole fresh buffer
in, by timing, hence the median beside the max. Each setting runs in a fresh
process (glibc reads the variables at start-up); the values are read from
launch.sh itself.

  .venv/bin/python benchmarks/page_faults.py                   # CPU: ~1 min
  .venv/bin/python benchmarks/page_faults.py --calls 21 --trials 3
"""
import argparse
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

from timing import median, memory

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch.sh')


def launch_malloc_settings():
  """{'MALLOC_...': value} as launch.sh exports them (when not already set)."""
  with open(LAUNCH) as f:
    found = re.findall(r'export (MALLOC_\w+)="\$\{\1:-(\w+)\}"', f.read())
  if not found:
    raise SystemExit(f'no MALLOC_ exports found in {LAUNCH}')
  return dict(found)


def measure(size, calls):
  """-> {'temp': MiB, 'faults': [minor faults of each call], 'page': bytes}, in this process."""
  import resource  # Unix only
  f = jax.jit(jax.grad(lambda x: jnp.sum(jnp.tanh(x @ x.T) ** 2)))
  x = jnp.ones((size, 256), jnp.float32) / 256  # [size, 256]; x @ x.T is [size, size]
  temp = memory(f, (x,))['temp']
  for _ in range(3):
    jax.block_until_ready(f(x))
  faults = []
  for _ in range(calls):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  return {'temp': temp, 'faults': faults, 'page': resource.getpagesize()}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--size', type=int, default=4096, help='rows of x; temp memory ~ 4 size^2 B')
  p.add_argument('--calls', type=int, default=11)
  p.add_argument('--trials', type=int, default=1, help='fresh processes per setting')
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    print(json.dumps(measure(a.size, a.calls)))
    return
  if sys.platform != 'linux':
    raise SystemExit('the malloc settings are for glibc on Linux')
  tuned = launch_malloc_settings()
  plain_env = {k: v for k, v in os.environ.items() if k not in tuned}
  settings = {'plain glibc': plain_env, 'launch.sh': {**plain_env, **tuned}}
  print(f'grad of sum(tanh(x x^T)^2), x [{a.size}, 256] float32, {a.calls} calls after 3 '
        f'warm-up calls, {a.trials} process(es) per setting, backend={jax.default_backend()}, '
        f'jax={jax.__version__}')
  print(' '.join(f'{k}={v}' for k, v in tuned.items()))
  print(f'{"malloc":<13}{"temp MiB":>9}{"median":>9}{"max":>9}{"calls > 1000":>14}'
        f'{"median MiB":>12}')
  argv = [sys.executable, __file__, '--child', f'--size={a.size}', f'--calls={a.calls}']
  for name, env in settings.items():
    runs = [json.loads(subprocess.run(argv, env=env, check=True, capture_output=True,
                                      text=True).stdout.splitlines()[-1])
            for _ in range(a.trials)]
    faults = [n for r in runs for n in r['faults']]
    many = sum(n > 1000 for n in faults)
    print(f'{name:<13}{runs[0]["temp"]:>9.1f}{median(faults):>9.0f}{max(faults):>9}'
          f'{f"{many}/{len(faults)}":>14}{median(faults) * runs[0]["page"] / 2**20:>12.1f}')


if __name__ == '__main__':
  main()
