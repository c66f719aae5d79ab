"""Where a GPU's compile time goes: the nanoGPT recipe's programs, as its run
compiles them, under XLA settings side by side.

  ./launch.sh run benchmarks/compile_flags.py [--settings NAME ...]

Each setting runs in a fresh process of its own, one after another, with the
persistent cache off (every compile a real one). A process builds the run's
train state as train/loop.py does (the seconds from the data to the state on
the device: the init program and the optimizer's), compiles the loop's own
train step (sharded jit, donation, the step's metrics and gradient norm),
then the eval step and the greedy sampler the run compiles beside it, and
times 20 train steps. Settings:
  project        XLA_FLAGS as flaxformer_lite/compilation.py sets them
                 (GPU_XLA_FLAGS on a machine with the CUDA plugin)
  xla defaults   XLA's own: each of GPU_XLA_FLAGS switched back
  autotune 0     the project's, plus --xla_gpu_autotune_level=0 (no autotuning)
  cache          the project's, the persistent cache on an empty folder, as a
                 first run (XLA's autotuning results written beside it)
On CPU the GPU flags change nothing; run it on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

EXPERIMENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          'experiments', 'tiny_shakespeare.py')
SETTINGS = {
    'project': ('', False),
    'xla defaults': (None, False),
    'autotune 0': ('--xla_gpu_autotune_level=0', False),
    'cache': ('', True),
}


def _xla_defaults() -> str:
  """XLA_FLAGS that switch the project's GPU_XLA_FLAGS back to XLA's defaults."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from flaxformer_lite import compilation
  return ' '.join(f'{flag.split("=")[0]}={"false" if flag.endswith("true") else "true"}'
                  for flag in compilation.GPU_XLA_FLAGS)


def child(args):
  import importlib.util
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from flaxformer_lite import compilation
  compilation.set_xla_flags()
  import jax
  import numpy as np

  import timing
  from flaxformer_lite import models
  from flaxformer_lite.train import loop, partitioning
  from flaxformer_lite.train.evaluation import Evaluator
  if args.cache:
    compilation.enable_cache({'FFL_COMPILE_CACHE': args.cache})
  else:
    jax.config.update('jax_enable_compilation_cache', False)
  spec = importlib.util.spec_from_file_location('experiment', EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if args.quick:
    config.model.update(d_model=32, num_heads=2, mlp_dim=64, num_decoder_layers=1, max_len=32)
    config.data.max_len = 32
    config.train.batch_size = 4
    config.eval.update(batch_size=8, max_examples=16, sample_len=4)

  dataset = loop._load_dataset(config)
  start = time.perf_counter()
  parallel = partitioning.Partitioner(config.train.parallel, config.train.model_parallel)
  model = models.build(config.model)
  first = next(loop._train_batches(config, dataset))
  state, rng = loop._init_state(config, model, first, parallel)
  state = parallel.place_state(state)
  jax.block_until_ready(state)
  setup = time.perf_counter() - start
  step = loop._compile_train_step(config, dataset, parallel)
  batch = parallel.place_batch(first)
  start = time.perf_counter()
  lowered = step.lower(state, batch, rng)
  lower = time.perf_counter() - start
  compiled = lowered.compile()
  train_compile = time.perf_counter() - start - lower
  evaluate = Evaluator(config, model, dataset, parallel.place_eval_batch,
                       sample_path=os.path.join(tempfile.mkdtemp(), 'sample.txt'))
  start = time.perf_counter()
  for _ in loop._eval_programs(config, dataset, evaluate, parallel.unplace_state(state).params):
    pass
  eval_compile = time.perf_counter() - start
  # The step donates its state: each call takes the previous call's.
  times = []
  for i in range(22):
    t0 = time.perf_counter()
    state, sums = compiled(state, batch, rng)
    jax.block_until_ready(sums)
    if i >= 2:
      times.append((time.perf_counter() - t0) * 1e3)
  print(json.dumps({'setup_s': setup, 'lower_s': lower, 'compile_s': train_compile,
                    'eval_compile_s': eval_compile, 'step_ms': timing.median(times),
                    'loss': float(np.asarray(sums['loss']) / np.asarray(sums['tokens']))}))


def run(names, timeout: float, quick: bool = False) -> dict:
  """{setting: {setup_s, lower_s, compile_s, eval_compile_s, step_ms} or why not}."""
  folder = tempfile.mkdtemp(prefix='compile_flags_')
  results = {}
  for name in names:
    flags, cache = SETTINGS[name]
    flags = _xla_defaults() if flags is None else flags
    env = {**os.environ, 'XLA_FLAGS': f'{os.environ.get("XLA_FLAGS", "")} {flags}'.strip()}
    command = [sys.executable, os.path.abspath(__file__), '--child',
               *(['--quick'] if quick else []),
               *([f'--cache={os.path.join(folder, "cache")}'] if cache else [])]
    start = time.time()
    try:
      proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
      results[name] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 \
          else (proc.stderr.strip().splitlines() or [f'exit {proc.returncode}'])[-1][:200]
    except subprocess.TimeoutExpired:
      results[name] = f'over {timeout:.0f} s'
    if isinstance(results[name], dict):
      results[name]['process_s'] = time.time() - start
  return results


def table(results) -> list[str]:
  lines = ['| setting | state built s | train step compile s | eval + sampler compile s '
           '| step ms | process s |', '| --- | ---: | ---: | ---: | ---: | ---: |']
  for name, r in results.items():
    if isinstance(r, dict):
      lines.append(f'| {name} | {r["setup_s"]:.1f} | {r["compile_s"]:.1f} | '
                   f'{r["eval_compile_s"]:.1f} | {r["step_ms"]:.2f} | {r["process_s"]:.0f} |')
    else:
      lines.append(f'| {name} | - | - | - | - | {r} |')
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--settings', nargs='+', default=list(SETTINGS), choices=list(SETTINGS))
  parser.add_argument('--timeout', type=float, default=300, help='seconds per setting')
  parser.add_argument('--quick', action='store_true', help='a tiny model, for any machine')
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--cache', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child(args)
  results = run(args.settings, args.timeout, args.quick)
  import jax
  print(f'device: {jax.devices()[0].device_kind}; jax {jax.__version__}; '
        f'{os.path.basename(EXPERIMENT)}, its own train step, eval step and sampler')
  print('\n'.join(table(results)))


if __name__ == '__main__':
  main()
