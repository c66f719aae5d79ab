"""Unrolled against scanned layers (model.scan_layers): compile time and step time.

  ./launch.sh run benchmarks/scan_layers.py                   # nanoGPT's 6 layers, CPU
  ./launch.sh run benchmarks/scan_layers.py --layers 2 6 12 --batch 4

The model is experiments/tiny_shakespeare.py's (nanoGPT's baby GPT: decoder-only,
d 384, 6 heads, MLP 1536, context 256, GPT-2 init, dropout 0.2; its vocabulary
of 65 characters), with the number of layers of --layers. For each depth and
layout, the LM train step (forward, backward, AdamW update, dropout on; as
train/steps.py) on one random batch: the seconds
to trace and lower it, to compile the lowered program (the persistent
compilation cache off, so every compile is a real one), and its step time,
timed call by call in rotating order. Ratios are scanned / unrolled.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import timing  # noqa: E402
from flaxformer_lite import models  # noqa: E402
from flaxformer_lite.train import losses, state as state_lib  # noqa: E402

EXPERIMENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          'experiments', 'tiny_shakespeare.py')
VOCAB = 65  # Tiny Shakespeare's characters


def experiment_config(layers: int, scan_layers: bool, d_model: int = 0):
  spec = importlib.util.spec_from_file_location('tiny_shakespeare', EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.model.update(vocab_size=VOCAB, num_decoder_layers=layers, scan_layers=scan_layers)
  if d_model:  # a narrower model of the same shape (--d_model; heads of 64 at most)
    config.model.update(d_model=d_model, mlp_dim=4 * d_model,
                        num_heads=max(1, min(config.model.num_heads, d_model // 64)))
  models.validate(config.model)
  return config


def train_step(state, batch, rng):
  """steps.train_step's LM update (dropout on, mean token loss, AdamW),
  without the data package that steps.py imports."""
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['inputs'], deterministic=False,
                            rngs={'dropout': jax.random.fold_in(rng, state.step)})
    sums = losses.token_metrics(logits, batch['targets'], jnp.ones(batch['targets'].shape))
    return sums['loss'] / sums['tokens']
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def build_step(config, batch):
  """(compiled train step, its args, lower seconds, compile seconds)."""
  model = models.build(config.model)
  state = state_lib.create(model, config, batch, jax.random.key(0))
  args = (state, batch, jax.random.key(1))
  t0 = time.perf_counter()
  lowered = jax.jit(train_step).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, args, t1 - t0, time.perf_counter() - t1


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, nargs='+', default=[6])
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=6)
  parser.add_argument('--d_model', type=int, default=0, help="default: the experiment's 384")
  parser.add_argument('--context', type=int, default=0, help="default: the experiment's 256")
  args = parser.parse_args()
  jax.config.update('jax_enable_compilation_cache', False)  # timing.py turns it on

  rows = []
  for layers in args.layers:
    config = experiment_config(layers, False, args.d_model)
    rng = np.random.default_rng(0)
    context = args.context or config.data.max_len
    batch = {'inputs': rng.integers(3, VOCAB, (args.batch, context), dtype=np.int32),
             'targets': rng.integers(3, VOCAB, (args.batch, context), dtype=np.int32)}
    fns, lower, compile_s = {}, {}, {}
    for scanned in (False, True):
      compiled, fn_args, lower[scanned], compile_s[scanned] = build_step(
          experiment_config(layers, scanned, args.d_model), batch)
      fns[scanned] = compiled, fn_args
    times = timing.interleaved_times(fns, args.repeats)
    rows.append((layers, lower, compile_s, {k: timing.median(v) for k, v in times.items()}))

  d = config.model.d_model
  print(f'device: {jax.devices()[0].device_kind} x{jax.device_count()}; jax {jax.__version__}; '
        f'{os.path.basename(EXPERIMENT)} model (d {d}, MLP {4 * d}), batch {args.batch} x '
        f'{context} tokens, train step; compilation cache off')
  print('| layers | lower s (unrolled / scanned) | ratio | compile s (unrolled / scanned) '
        '| ratio | step ms, median (unrolled / scanned) | ratio |')
  print('| ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for layers, lower, compile_s, step_ms in rows:
    print(f'| {layers} | {lower[False]:.2f} / {lower[True]:.2f} | '
          f'{lower[True] / lower[False]:.2f} | {compile_s[False]:.2f} / {compile_s[True]:.2f} | '
          f'{compile_s[True] / compile_s[False]:.2f} | {step_ms[False]:.0f} / '
          f'{step_ms[True]:.0f} | {step_ms[True] / step_ms[False]:.2f} |')


if __name__ == '__main__':
  main()
