"""Training throughput and model FLOPs utilisation (MFU) of the real train step.

  .venv/bin/python benchmarks/train_throughput.py                 # Transformer-base, CPU, float32
  .venv/bin/python benchmarks/train_throughput.py --preset=big --dtype=bfloat16 --batch=64   # GPU

Times `steps.train_step` (forward, backward, Adam update; jitted with donated
state, as in training) on random tokens, batch x src_len source and
batch x tgt_len target tokens, no padding, no dropout.

Model FLOPs per step, the PaLM convention (Chowdhery et al. 2022, appendix B):
6 * N per token for the matmuls of N parameters (forward 2N, backward 4N) plus
12 * L * H * Q * T per token for attention scores and values (L layers, H
heads, Q head size, T the attended length). For the encoder-decoder, per
source token: 6 * N_encoder + 12 * L_enc * d * src_len; per target token:
6 * N_decoder (self- and cross-attention projections, MLPs, the tied output
softmax) + 12 * L_dec * d * (tgt_len + src_len) (self- and cross-attention).
Causal self-attention is counted at full length (T, not T/2), as PaLM does;
the token embedding lookup is not a matmul and counts nothing on the input
side. XLA's own count (compiled cost analysis) is printed beside it.

MFU = model FLOPs per second / peak FLOPs per second. The peak: on CPU, the
best of several large float32 matmuls measured in the same run (a 2-core
machine has no datasheet number worth quoting); on GPU, --peak_tflops (e.g.
989 for H100 SXM bf16 dense).
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite import config as config_lib
from flaxformer_lite import models
from flaxformer_lite.train import state as state_lib, steps

PRESETS = {  # Vaswani et al. 2017, table 3
    'base': dict(d_model=512, num_heads=8, mlp_dim=2048, layers=6),
    'big': dict(d_model=1024, num_heads=16, mlp_dim=4096, layers=6),
    'tiny': dict(d_model=32, num_heads=2, mlp_dim=64, layers=1),  # a check that it runs
}


def model_flops(params, cfg, batch, src_len, tgt_len) -> float:
  """PaLM-convention FLOPs of one training step (see the module docstring)."""
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
  n_enc = count(params['encoder'])
  n_dec = count(params['decoder']) + count(params['embed'])  # tied output softmax
  d, enc_layers, dec_layers = cfg.d_model, cfg.num_encoder_layers, cfg.num_decoder_layers
  per_src = 6 * n_enc + 12 * enc_layers * d * src_len
  per_tgt = 6 * n_dec + 12 * dec_layers * d * (tgt_len + src_len)
  return batch * (src_len * per_src + tgt_len * per_tgt)


def matmul_peak(dtype, size=2048, repeats=20) -> float:
  """Best FLOP/s of a size^3 matmul on the default device."""
  a = jnp.ones((size, size), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * size ** 3 / best


def add_model_flags(parser, vocab=32000):
  """The flags that pick the model and batch (shared with remat.py)."""
  parser.add_argument('--preset', default='base', choices=sorted(PRESETS))
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--src_len', type=int, default=128)
  parser.add_argument('--tgt_len', type=int, default=128)
  parser.add_argument('--vocab', type=int, default=vocab)
  parser.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])


def model_config(args, **model):
  """The experiment config of the preset, args' sizes and `model` overrides;
  a constant learning rate."""
  p = PRESETS[args.preset]
  config = config_lib.base_config()
  config.model.update(vocab_size=args.vocab, d_model=p['d_model'], num_heads=p['num_heads'],
                      mlp_dim=p['mlp_dim'], num_encoder_layers=p['layers'],
                      num_decoder_layers=p['layers'], dropout_rate=0.0, dtype=args.dtype,
                      max_len=max(args.src_len, args.tgt_len))
  config.model.update(**model)
  config.train.schedule, config.train.learning_rate = 'constant', 1e-4
  return config


def random_batch(args) -> dict:
  rng = np.random.default_rng(0)
  return {'inputs': rng.integers(3, args.vocab, (args.batch, args.src_len), dtype=np.int32),
          'targets': rng.integers(3, args.vocab, (args.batch, args.tgt_len), dtype=np.int32)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_flags(parser)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--attention', default='dot_product')
  parser.add_argument('--peak_tflops', type=float, default=0.0,
                      help='device peak; 0 = measure a large matmul (CPU)')
  args = parser.parse_args()

  config = model_config(args, attention=args.attention)
  model = models.build(config.model)
  batch = random_batch(args)
  state = state_lib.create(model, config, batch, jax.random.key(0))
  step = jax.jit(functools.partial(steps.train_step, label_smoothing=0.1), donate_argnums=(0,))
  key = jax.random.key(1)
  compiled = step.lower(state, batch, key).compile()
  xla_flops = (compiled.cost_analysis() or {}).get('flops', float('nan'))
  flops = model_flops(state.params, config.model, args.batch, args.src_len, args.tgt_len)

  measure_peak = not args.peak_tflops
  peaks = [matmul_peak(jnp.dtype(args.dtype))] if measure_peak else []
  for _ in range(2):  # warm up
    state, sums = step(state, batch, key)
  jax.block_until_ready(sums)
  times = []
  for _ in range(args.steps):
    t = time.perf_counter()
    state, sums = step(state, batch, key)
    jax.block_until_ready(sums)
    times.append(time.perf_counter() - t)
  seconds = float(np.median(times))

  # On CPU the peak is measured before and after the steps and the best kept:
  # a low reading (other load on the machine) would inflate the MFU.
  peak = max(peaks + [matmul_peak(jnp.dtype(args.dtype))]) if measure_peak else args.peak_tflops * 1e12
  tokens = args.batch * (args.src_len + args.tgt_len)
  n = sum(x.size for x in jax.tree.leaves(state.params))
  print(f'device: {jax.devices()[0].device_kind} x{jax.device_count()}; jax {jax.__version__}')
  print(f'model: Transformer-{args.preset} encoder-decoder, {n / 1e6:.1f}M parameters, '
        f'{args.dtype}; batch {args.batch} x ({args.src_len} + {args.tgt_len}) tokens')
  print()
  print('| quantity | value |')
  print('| --- | ---: |')
  print(f'| step time, median of {args.steps} | {seconds * 1e3:.1f} ms |')
  print(f'| tokens/s (source + target) | {tokens / seconds:,.0f} |')
  print(f'| model TFLOP per step (PaLM convention) | {flops / 1e12:.3f} |')
  print(f'| XLA cost-analysis TFLOP per step | {xla_flops / 1e12:.3f} |')
  print(f'| achieved model TFLOP/s | {flops / seconds / 1e12:.3f} |')
  print(f'| peak TFLOP/s ({"given" if args.peak_tflops else "measured 2048^3 matmul"}) '
        f'| {peak / 1e12:.3f} |')
  print(f'| **MFU** | **{flops / seconds / peak:.1%}** |')


if __name__ == '__main__':
  main()
