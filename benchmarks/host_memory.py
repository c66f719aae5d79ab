"""Does the memory guard's host estimate hold? Estimate against measured peak RSS.

  ./launch.sh run benchmarks/host_memory.py [--only NAME ...] [--steps 4]

Runs each shipped CPU experiment for a few steps through the project's own
entry point (`./launch.sh EXPERIMENT.py`, in a child process, with a fresh
workdir and the compilation cache off, so that every program is compiled as
on a first run), reads the guard's estimate from the run's log ('Memory: peak
about ...') and the child's peak resident memory from the kernel (ru_maxrss
of os.wait4, which covers launch.sh and the Python process it starts), and
prints a table: experiment, estimate GiB, measured peak RSS GiB, their ratio
(measured / estimate), wall time. A ratio at most 1 means the guard did not
undercount. Results: benchmarks/KERNELS.md, "host_memory.py".
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30

# name: (experiment file, overrides besides the step count): a short run with
# the experiment's batch and evaluation shapes, a checkpoint written mid-run.
EXPERIMENTS = {
    'reverse (the default ./launch.sh)': ('experiments/reverse.py', []),
    'tiny_shakespeare_long': ('experiments/tiny_shakespeare_long.py', []),
    'smollm2_shakespeare': ('experiments/smollm2_shakespeare.py', []),
    'multi30k_cpu (eval.max_examples=64)': ('experiments/multi30k_cpu.py',
                                            ['--config.eval.max_examples=64']),
}
_UNITS = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30, 'TiB': 2**40}


def estimate_bytes(log: str) -> float | None:
  """The guard's estimate in a run's log ('Memory: peak about 4.7 GiB ...'), bytes."""
  match = re.search(r'Memory: peak about ([\d.]+) (B|KiB|MiB|GiB|TiB)', log)
  return float(match.group(1)) * _UNITS[match.group(2)] if match else None


def measure(experiment: str, overrides: list[str], steps: int) -> tuple:
  """(estimate bytes or None, peak RSS bytes, wall seconds, exit code) of
  one run of `steps` steps, its log read for the estimate."""
  workdir = tempfile.mkdtemp(prefix='host_memory_')
  command = ['./launch.sh', experiment, f'--workdir={workdir}',
             f'--config.train.num_steps={steps}', f'--config.train.eval_every={steps}',
             f'--config.train.checkpoint_every={max(steps // 2, 1)}', *overrides]
  env = dict(os.environ, FFL_COMPILE_CACHE='off')
  start = time.time()
  with tempfile.TemporaryFile('w+') as out:
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    log = out.read()
  shutil.rmtree(workdir, ignore_errors=True)
  if child.returncode:
    sys.stderr.write(log[-3000:])
  return estimate_bytes(log), usage.ru_maxrss * 1024, time.time() - start, child.returncode


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', nargs='*', default=None, help='experiments to run (names below)')
  parser.add_argument('--steps', type=int, default=4, help='training steps of each run')
  args = parser.parse_args(argv)
  names = args.only or list(EXPERIMENTS)
  print('| experiment | estimate GiB | measured peak RSS GiB | ratio | wall |')
  print('| --- | ---: | ---: | ---: | ---: |')
  for name in names:
    experiment, overrides = EXPERIMENTS[name]
    estimate, rss, wall, code = measure(experiment, overrides, args.steps)
    ratio = f'{rss / estimate:.2f}' if estimate else '-'
    shown = f'{estimate / GiB:.2f}' if estimate else f'- (exit {code})'
    print(f'| {name} | {shown} | {rss / GiB:.2f} | {ratio} | {wall:.0f} s |', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
