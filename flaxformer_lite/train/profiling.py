"""train.profile_steps: a jax.profiler trace of a range of training steps;
`step_flops`: what XLA counts in a compiled step.

The trace goes to WORKDIR/plugins/profile/<time>/ (an .xplane.pb for
TensorBoard's Profile tab, `tensorboard --logdir WORKDIR` with
tensorboard-plugin-profile installed, and a .trace.json.gz that Perfetto
opens). Process 0 traces; the others would write files of the same host name.
"""
from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger('flaxformer_lite')


def step_flops(compiled) -> float:
  """The floating-point operations XLA's cost analysis counts in one call of
  a compiled executable (a train step: forward, backward and update, on one
  device's share); 0.0 where the backend gives none. A loop's body counts
  once (XLA does not multiply by the trip count): steps with the chunked
  kernel's block loop, gradient accumulation or remat'd scans are undercounted."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends and runtimes do not implement it
    return 0.0
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
    cost = cost[0] if cost else {}
  return float((cost or {}).get('flops', 0.0))


def parse(spec: str) -> tuple[int, int] | None:
  """'A:B' -> (A, B), the steps A..B-1 counted from 0 as the loop counts them
  (step A is the (A+1)-th update); '' -> None. ValueError for anything else."""
  if not spec:
    return None
  try:
    first, stop = (int(x) for x in spec.split(':'))
  except ValueError:
    raise ValueError(f"train.profile_steps={spec!r} is not 'START:STOP' "
                     "(e.g. '10:15' traces steps 10..14; '' = off)") from None
  if not 0 <= first < stop:
    raise ValueError(f'train.profile_steps={spec!r} needs 0 <= START < STOP')
  return first, stop


class StepTracer:
  """Starts the trace before the first step of the range that this run
  trains and stops it, once the state is computed, after the last."""

  def __init__(self, spec: str, workdir: str):
    steps = parse(spec) if jax.process_index() == 0 else None
    self.first, self.stop = steps or (0, 0)
    self.workdir, self.tracing = workdir, False

  def before(self, step: int):
    if not self.tracing and self.first <= step < self.stop:
      jax.profiler.start_trace(self.workdir)
      self.tracing = True

  def after(self, done: int, state):
    if self.tracing and done >= self.stop:
      jax.block_until_ready(state)
      self.close()
      log.info('Profile of steps %d..%d written under %s (tensorboard --logdir %s, '
               'Profile tab)', self.first, self.stop - 1,
               os.path.join(self.workdir, 'plugins', 'profile'), self.workdir)

  def close(self):
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
