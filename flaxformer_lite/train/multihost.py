"""Multi-host runs through jax.distributed; nothing of our own on the wire.

Three ways a process learns it is one of several:
  --multihost            jax.distributed.initialize() with no arguments: JAX
                         detects the cluster (TPU pod slices, SLURM, ...).
  FFL_COORDINATOR, FFL_NUM_PROCESSES, FFL_PROCESS_ID in the environment:
                         set by `launch_local` below, or by hand.
  --local_processes=N    `launch_local`: start N copies of this command on
                         127.0.0.1 (a free coordinator port), one JAX process
                         each, to run a multi-host job on one machine.
Then every process reads its own rows of each global batch, process 0 writes
metrics, logs and config.json, and orbax writes checkpoints collectively.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

ENV = ('FFL_COORDINATOR', 'FFL_NUM_PROCESSES', 'FFL_PROCESS_ID')


def initialize(auto: bool = False) -> None:
  """jax.distributed.initialize from the FFL_* environment, or auto-detected."""
  import jax
  if all(os.environ.get(k) for k in ENV):
    jax.distributed.initialize(coordinator_address=os.environ['FFL_COORDINATOR'],
                               num_processes=int(os.environ['FFL_NUM_PROCESSES']),
                               process_id=int(os.environ['FFL_PROCESS_ID']))
  elif auto:
    jax.distributed.initialize()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def launch_local(num_processes: int, argv: list[str], poll_seconds: float = 0.2) -> int:
  """Runs `python -m flaxformer_lite.main argv` as num_processes JAX processes
  on this machine and returns the exit code.

  All exit 0: 0. One exits non-zero (or is killed): the others are sent
  SIGTERM (then SIGKILL after 10 s) instead of waiting forever in a
  collective, and its code is returned (128 + signal for a killed one).
  SIGTERM/SIGINT to this launcher are passed on to every process.
  """
  env = dict(os.environ, FFL_COORDINATOR=f'127.0.0.1:{_free_port()}',
             FFL_NUM_PROCESSES=str(num_processes))
  procs = []
  for i in range(num_processes):
    procs.append(subprocess.Popen([sys.executable, '-m', 'flaxformer_lite.main', *argv],
                                  env=dict(env, FFL_PROCESS_ID=str(i))))
    print(f'launch: process {i} of {num_processes} is pid {procs[-1].pid}', file=sys.stderr)

  def forward(signum, frame):
    del frame
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        code = 128 - code if code < 0 else code
        print(f'launch: process {i} exited with code {code}; stopping the others',
              file=sys.stderr)
        _stop([p for p in procs if p.poll() is None])
        return code
      if all(c == 0 for c in codes):
        return 0
      time.sleep(poll_seconds)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _stop(procs, grace_seconds: float = 10.0):
  for p in procs:
    p.terminate()
  deadline = time.time() + grace_seconds
  for p in procs:
    try:
      p.wait(max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (a collective: every
  process must call it at the same point)."""
  import jax
  import numpy as np
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))
