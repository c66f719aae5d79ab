"""What each fusion mode costs as the streams grow: the train step's FLOPs and time.

  .venv/bin/python benchmarks/two_stream_flops.py                       # lengths 32 256 1024
  .venv/bin/python benchmarks/two_stream_flops.py --lengths 64 --repeats 3

The model of experiments/two_stream.py (4 layers, d 64) on two streams of n
tokens each, batch 8: its real train step (forward, backward, Adam), jitted.
Rows are the sweep's (experiments/sweeps/two_stream_fusion.py): early (one
joint sequence of 2n tokens from layer 0), late_L (streams alone for L
layers, then joint), bottleneck_B (from layer 2, each stream with B shared
tokens). FLOPs are XLA's cost analysis of the compiled step; time is the
median of interleaved calls. Attention runs on the dense kernel: XLA's cost
analysis counts a loop's body once, so the chunked kernel's blocks (a loop)
would be undercounted. Joint attention costs (2n)^2 per layer, a
bottleneck layer 2 (n + B)^2: about half once n dominates the MLPs.
"""
from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from flaxformer_lite import models  # noqa: E402
from flaxformer_lite.train import profiling, state as state_lib, steps  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows() -> dict:
  """The sweep's rows: name -> config.model overrides."""
  grid = runpy.run_path(os.path.join(REPO, 'experiments', 'sweeps', 'two_stream_fusion.py'))
  return {name: {k.split('.', 1)[1]: v for k, v in overrides.items()}
          for name, overrides in grid['ROWS'].items()}


def build(overrides: dict, n: int, batch: int):
  """() -> (the jitted train step, its args) for one row at stream length n."""
  def make():
    config = runpy.run_path(os.path.join(REPO, 'experiments', 'two_stream.py'))['get_config']()
    config.model.update(vocab_size=64, num_classes=5, max_len=n, **overrides)
    config.model.attention_kwargs.kernel = 'dense'  # see the module docstring
    model = models.build(config.model)
    rng = np.random.default_rng(0)
    data = {'inputs': rng.integers(3, 64, (batch, n), dtype=np.int32),
            'inputs_b': rng.integers(3, 64, (batch, n), dtype=np.int32),
            'targets': rng.integers(0, 5, (batch, 1), dtype=np.int32)}
    state = state_lib.create(model, config, data, jax.random.key(0))
    step = jax.jit(functools.partial(steps.train_step, label_smoothing=0.0,
                                     objective='classify'))
    return step, (state, data, jax.random.key(1))
  return make


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--lengths', type=int, nargs='+', default=[32, 256, 1024])
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  print(f'device: {jax.devices()[0].device_kind} x{jax.device_count()}; jax {jax.__version__}; '
        f'batch {args.batch}, two streams of n tokens each')
  print()
  print('| n | row | GFLOPs per step | x early | ms per step | x early |')
  print('|---|---|---|---|---|---|')
  for n in args.lengths:
    builds = {name: build(overrides, n, args.batch) for name, overrides in rows().items()}
    fns, _, failed = timing.compile_all(builds)
    flops = {name: profiling.step_flops(fn.lower(*a).compile()) for name, (fn, a) in fns.items()}
    times = timing.interleaved_times(fns, args.repeats)
    ms = {name: float(np.median(t)) for name, t in times.items()}
    for name in builds:
      if name in failed:
        print(f'| {n} | {name} | {failed[name]} | | | |')
        continue
      print(f'| {n} | {name} | {flops[name] / 1e9:.3f} | {flops[name] / flops["early"]:.2f} | '
            f'{ms[name]:.1f} | {ms[name] / ms["early"]:.2f} |')


if __name__ == '__main__':
  main()
