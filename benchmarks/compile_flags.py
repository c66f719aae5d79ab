"""Where a GPU's compile time goes: the nanoGPT recipe's train step compiled
under XLA settings side by side.

  ./launch.sh run benchmarks/compile_flags.py [--layers 6] [--batch 64]

Each setting compiles experiments/tiny_shakespeare.py's train step (unrolled
layers, benchmarks/scan_layers.py's step) in a fresh process of its own, one
after another, and prints its lower and compile seconds and its median step
time over 20 calls. Settings:
  default        XLA's flags as JAX sets them, no persistent cache
  cache          the persistent cache on an empty folder, as a first run
                 (flaxformer_lite/compilation.py: XLA's autotuning results
                 written per fusion beside it)
  autotune 0     --xla_gpu_autotune_level=0 (no autotuning: defaults)
  no triton gemm --xla_gpu_enable_triton_gemm=false (matmuls on cuBLAS only)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SETTINGS = {
    'default': ('', False),
    'cache': ('', True),
    'autotune 0': ('--xla_gpu_autotune_level=0', False),
    'no triton gemm': ('--xla_gpu_enable_triton_gemm=false', False),
}


def child(args):
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax
  import numpy as np

  import scan_layers
  import timing
  from flaxformer_lite import compilation
  if args.cache:
    compilation.enable_cache({'FFL_COMPILE_CACHE': args.cache})
  else:
    jax.config.update('jax_enable_compilation_cache', False)
  config = scan_layers.experiment_config(args.layers, False)
  rng = np.random.default_rng(0)
  shape = (args.batch, config.data.max_len)
  batch = {'inputs': rng.integers(3, scan_layers.VOCAB, shape, dtype=np.int32),
           'targets': rng.integers(3, scan_layers.VOCAB, shape, dtype=np.int32)}
  compiled, fn_args, lower_s, compile_s = scan_layers.build_step(config, batch)
  times = timing.interleaved_times({'step': (compiled, fn_args)}, 20)['step']
  print(json.dumps({'lower_s': lower_s, 'compile_s': compile_s,
                    'step_ms': timing.median(times)}))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=6)
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--timeout', type=float, default=300, help='seconds per setting')
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--cache', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child(args)

  folder = tempfile.mkdtemp(prefix='compile_flags_')
  results = {}
  for name, (flags, cache) in SETTINGS.items():
    env = {**os.environ, 'XLA_FLAGS': f'{os.environ.get("XLA_FLAGS", "")} {flags}'.strip()}
    command = [sys.executable, os.path.abspath(__file__), '--child', f'--layers={args.layers}',
               f'--batch={args.batch}']
    if cache:
      command.append(f'--cache={os.path.join(folder, "cache")}')
    try:
      proc = subprocess.run(command, env=env, capture_output=True, text=True,
                            timeout=args.timeout)
      results[name] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 \
          else (proc.stderr.strip().splitlines() or [f'exit {proc.returncode}'])[-1][:200]
    except subprocess.TimeoutExpired:
      results[name] = f'over {args.timeout:.0f} s'
  import jax
  print(f'device: {jax.devices()[0].device_kind}; jax {jax.__version__}; '
        f'{args.layers} layers, batch {args.batch} x 256, unrolled train step')
  print('| setting | lower s | compile s | step ms |')
  print('| --- | ---: | ---: | ---: |')
  for name, r in results.items():
    if isinstance(r, dict):
      print(f'| {name} | {r["lower_s"]:.1f} | {r["compile_s"]:.1f} | {r["step_ms"]:.1f} |')
    else:
      print(f'| {name} | - | - | {r} |')


if __name__ == '__main__':
  main()
