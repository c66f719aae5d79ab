"""CPU time of a run's start (trace, lower and compile the train, eval and
decode steps, two steps of training, evaluation) with CPython's default
thresholds for its cyclic collector and with the command line's
(main.GC_THRESHOLDS), the two taking turns in one process.

Each run is the default experiment through loop.train_and_evaluate with
--steps training steps, in a fresh workdir, JAX's in-memory caches emptied
before it and no persistent compilation cache: every run traces, lowers and
compiles all of its steps, as a new command does.

  ./launch.sh run benchmarks/gc_thresholds.py              # CPU: ~4 min
  ./launch.sh run benchmarks/gc_thresholds.py --repeats 5 --d_model 16
"""
import argparse
import gc
import logging
import runpy
import statistics
import tempfile
import time

import jax
from absl import logging as absl_logging

from flaxformer_lite import main as main_lib
from flaxformer_lite.train import loop


class _CollectorClock:
  """Seconds spent inside the cyclic collector (gc.callbacks), and its runs."""

  def __init__(self):
    self.seconds, self.runs, self._start = 0.0, 0, 0.0
    gc.callbacks.append(self._callback)

  def _callback(self, phase, info):
    del info
    if phase == 'start':
      self._start = time.perf_counter()
    else:
      self.seconds += time.perf_counter() - self._start
      self.runs += 1


def one_run(config, thresholds, clock: _CollectorClock) -> tuple[float, float, int]:
  """(CPU seconds, seconds in the collector, its runs) of one run at `thresholds`."""
  jax.clear_caches()
  gc.collect()
  gc.set_threshold(*thresholds)
  before = (time.process_time(), clock.seconds, clock.runs)
  with tempfile.TemporaryDirectory() as workdir:
    loop.train_and_evaluate(config, workdir)
  return (time.process_time() - before[0], clock.seconds - before[1], clock.runs - before[2])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--experiment', default='experiments/reverse.py')
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--d_model', type=int, default=0, help='0: the experiment\'s own')
  args = parser.parse_args()
  jax.config.update('jax_enable_compilation_cache', False)
  logging.getLogger('flaxformer_lite').setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.ERROR)  # tfds' note on each run's data config
  config = runpy.run_path(args.experiment)['get_config']()
  with config.unlocked():
    config.train.num_steps = args.steps
    config.train.eval_every = config.train.checkpoint_every = args.steps
    if args.d_model:
      config.model.d_model, config.model.mlp_dim = args.d_model, 2 * args.d_model
  settings = {'default': gc.get_threshold(), 'main.GC_THRESHOLDS': main_lib.GC_THRESHOLDS}
  clock = _CollectorClock()
  one_run(config, settings['default'], clock)  # imports and first-use work, not counted
  results = {name: [] for name in settings}
  for _ in range(args.repeats):
    for name, thresholds in settings.items():
      results[name].append(one_run(config, thresholds, clock))
  base = statistics.median(r[0] for r in results['default'])
  print(f'{args.experiment}, {args.steps} steps, {args.repeats} runs each, taking turns')
  print(f'{"thresholds":>34} | {"CPU s (median)":>14} | {"CPU s (range)":>13} | '
        f'{"in collector s":>14} | {"collections":>11} | ratio')
  print(f'{"-" * 34} | {"-" * 14} | {"-" * 13} | {"-" * 14} | {"-" * 11} | -----')
  for name, thresholds in settings.items():
    cpu = statistics.median(r[0] for r in results[name])
    collector = statistics.median(r[1] for r in results[name])
    runs = statistics.median(r[2] for r in results[name])
    spread = f'{min(r[0] for r in results[name]):.1f}-{max(r[0] for r in results[name]):.1f}'
    label = f'{name} {thresholds}'
    print(f'{label:>34} | {cpu:>14.2f} | {spread:>13} | {collector:>14.2f} | {runs:>11.0f} | '
          f'{cpu / base:.2f}')


if __name__ == '__main__':
  main()
