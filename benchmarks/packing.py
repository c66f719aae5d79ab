"""Packed against bucketed training batches on Multi30k, side by side.

  .venv/bin/python benchmarks/packing.py --manual_dir=../shared/data/multi30k

With the model and token budget of experiments/multi30k_cpu.py (batch_tokens
4096): over one epoch of each iterator, the fraction of the batch's source
and target slots that are padding; then the real train step (jitted, donated
state, dropout on) timed on the same number of batches of each, interleaved,
as target tokens (scored, EOS included) per second. Bucketing pads each row to
a multiple of 8 and to the longer of source and target; packing fills rows of
the training width (data.max_len + EOS) with whole pairs.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time

import jax
import numpy as np

from flaxformer_lite import data, models
from flaxformer_lite.train import state as state_lib, steps

HERE = os.path.dirname(os.path.abspath(__file__))


def experiment_config(manual_dir: str):
  spec = importlib.util.spec_from_file_location(
      'multi30k_cpu', os.path.join(HERE, '..', 'experiments', 'multi30k_cpu.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.data.manual_dir = manual_dir
  return config


def padding(batches, epoch_batches: int) -> tuple[float, int]:
  """(padding fraction of source + target slots, target tokens) over batches."""
  slots = real = targets = 0
  for _ in range(epoch_batches):
    b = next(batches)
    for k in ('inputs', 'targets'):
      slots += b[k].size
      real += int(np.sum(b[k] != models.PAD_ID))
    targets += int(np.sum(b['targets'] != models.PAD_ID))
  return 1.0 - real / slots, targets


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--manual_dir', default=os.path.join(HERE, '..', '..', 'shared', 'data',
                                                           'multi30k'))
  parser.add_argument('--steps', type=int, default=40, help='timed steps per iterator')
  parser.add_argument('--rounds', type=int, default=3, help='interleaved rounds')
  args = parser.parse_args()
  config = experiment_config(args.manual_dir)
  config.model.vocab_size = 0
  dataset = data.load(config.data)
  config.model.vocab_size = dataset.vocab_size
  train = dataset.splits['train']
  width = train['inputs'].shape[1]
  budget = config.train.batch_tokens
  make = {
      'bucketed': lambda: data.BucketedBatches(train, budget, seed=0),
      'packed': lambda: data.PackedBatches(train, length=width, batch_tokens=budget, seed=0),
  }
  print(f'# Multi30k train ({len(train["inputs"])} pairs, width {width}), batch_tokens '
        f'{budget}, {jax.devices()[0].platform}, {os.cpu_count()} cores')
  stats = {}
  for name, fn in make.items():
    it = fn()
    n = len(it._batches) if name == 'bucketed' else len(it._packed['inputs']) // it.rows
    stats[name] = (n,) + padding(fn(), n)

  model = models.build(config.model)
  step = jax.jit(functools.partial(steps.train_step, label_smoothing=0.1), donate_argnums=(0,))
  iters = {name: fn() for name, fn in make.items()}
  states = {name: state_lib.create(model, config, next(fn()), jax.random.key(0))
            for name, fn in make.items()}
  rng = jax.random.key(1)
  # Compile every shape first: one pass over an epoch's batch shapes (bucketed has several).
  for name, it in iters.items():
    shapes = set()
    for _ in range(stats[name][0]):
      b = next(it)
      key = b['inputs'].shape
      if key not in shapes:
        shapes.add(key)
        states[name], sums = step(states[name], b, rng)
  jax.block_until_ready(states)
  timed = {name: [0.0, 0] for name in make}
  for _ in range(args.rounds):
    for name, it in iters.items():
      batches = [next(it) for _ in range(args.steps)]
      start = time.perf_counter()
      tokens = 0.0
      for b in batches:
        states[name], sums = step(states[name], b, rng)
        tokens += float(sums['tokens'])
      timed[name][0] += time.perf_counter() - start
      timed[name][1] += tokens
  print('iterator   batches/epoch  padding  target tokens/s  ratio')
  base = timed['bucketed'][1] / timed['bucketed'][0]
  for name in make:
    n, pad, _ = stats[name]
    rate = timed[name][1] / timed[name][0]
    print(f'{name:10s} {n:13d} {pad:8.1%} {rate:16.0f} {rate / base:6.2f}')


if __name__ == '__main__':
  main()
