"""Rematerialisation policies (model.remat) side by side: temp memory and step time.

  ./launch.sh run benchmarks/remat.py                    # Transformer-base, CPU, float32
  ./launch.sh run benchmarks/remat.py --memory_only --batch=64 --src_len=512 --tgt_len=512

For each policy of layers/transformer.py REMAT, the real train step
(forward, backward, Adam update; dropout on, as in training) of one
encoder-decoder on the same random batch: XLA's compiled temp memory (the
activations kept for the backward pass live there) and the step time, timed
call by call in rotating order so that other load hits every policy alike.
Ratios are to 'none'.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import timing  # noqa: E402
import train_throughput  # noqa: E402
from flaxformer_lite import models  # noqa: E402
from flaxformer_lite.layers import transformer  # noqa: E402
from flaxformer_lite.train import state as state_lib, steps  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  train_throughput.add_model_flags(parser, vocab=8000)
  parser.add_argument('--repeats', type=int, default=6)
  parser.add_argument('--memory_only', action='store_true')
  args = parser.parse_args()

  batch = train_throughput.random_batch(args)
  fns, memory = {}, {}
  for policy in transformer.REMAT:
    config = train_throughput.model_config(args, dropout_rate=0.1, remat=policy)
    model = models.build(config.model)
    state = state_lib.create(model, config, batch, jax.random.key(0))
    step = jax.jit(functools.partial(steps.train_step, label_smoothing=0.1))
    fn_args = (state, batch, jax.random.key(1))
    memory[policy] = timing.memory(step, fn_args)['temp']
    fns[policy] = (step, fn_args)
  n = sum(x.size for x in jax.tree.leaves(fns['none'][1][0].params))
  print(f'device: {jax.devices()[0].device_kind} x{jax.device_count()}; jax {jax.__version__}; '
        f'Transformer-{args.preset} encoder-decoder, {n / 1e6:.1f}M parameters, {args.dtype}, '
        f'batch {args.batch} x ({args.src_len} + {args.tgt_len}) tokens')
  times = {} if args.memory_only else timing.interleaved_times(fns, args.repeats)
  print('| model.remat | temp memory, MiB | ratio | step time, median ms | ratio |')
  print('| --- | ---: | ---: | ---: | ---: |')
  for policy in transformer.REMAT:
    row = f'| {policy} | {memory[policy]:.0f} | {memory[policy] / memory["none"]:.2f} |'
    if times:
      ms, base = timing.median(times[policy]), timing.median(times['none'])
      row += f' {ms:.0f} | {ms / base:.2f} |'
    else:
      row += ' | |'
    print(row)


if __name__ == '__main__':
  main()
