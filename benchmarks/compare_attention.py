"""Train several attention variants on one task and budget; print one table.

  .venv/bin/python benchmarks/compare_attention.py                                # reverse.py, every Transformer variant
  .venv/bin/python benchmarks/compare_attention.py --experiment experiments/reverse_rnn.py
  .venv/bin/python benchmarks/compare_attention.py --variants dot_product,local --set train.num_steps=500

Every run uses the experiment's config with only `model.attention` (and the
`--set` overrides) changed, in its own fresh workdir under --root. Columns:
eval sequence accuracy (exact match of the whole greedy-decoded sequence),
token accuracy, test sequence accuracy at the unseen lengths (test_long),
training steps/sec (mean of the logged windows; compilation excluded),
parameters. Variants whose `models` exclude the experiment's model type are
skipped, with the reason. Runs one after another in this process, so
steps/sec are comparable only within one table.
"""
import argparse
import ast
import os
import runpy
import shutil
import statistics
import sys
import tempfile

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from flaxformer_lite.attention import registry  # noqa: E402
from flaxformer_lite.train import loop, metrics  # noqa: E402


def _override(config, assignment: str):
  """'train.num_steps=500' -> config.train.num_steps = 500 (python literal or string)."""
  path, _, text = assignment.partition('=')
  *parents, leaf = path.split('.')
  node = config
  for p in parents:
    node = node[p]
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  node[leaf] = value


def run_variant(experiment: str, variant: str, overrides, workdir: str) -> dict:
  config = runpy.run_path(experiment)['get_config']()
  config.model.attention = variant
  for o in overrides:
    _override(config, o)
  results = loop.train_and_evaluate(config, workdir)
  rows = metrics.read(workdir)
  speeds = [r['steps_per_sec'] for r in rows if r['split'] == 'train']
  return {
      'eval_seq': results['eval']['sequence_accuracy'],
      'eval_tok': results['eval']['accuracy'],
      'long_seq': results.get('test', {}).get('long_sequence_accuracy', float('nan')),
      # The first window holds compilation: leave it out when there are others.
      'steps_per_sec': statistics.mean(speeds[1:] or speeds),
      'params': results['num_params'],
      'seconds': results['train_seconds'],
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--experiment', default=os.path.join(REPO, 'experiments', 'reverse.py'))
  p.add_argument('--variants', default='', help='comma-separated; default: all that fit')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='config override applied to every run, e.g. train.num_steps=500')
  p.add_argument('--root', default='', help='workdirs go here (default: a temp dir, removed)')
  a = p.parse_args()

  config = runpy.run_path(a.experiment)['get_config']()
  for o in a.set:
    _override(config, o)
  model_type = config.model.type
  names = a.variants.split(',') if a.variants else registry.names()
  root = a.root or tempfile.mkdtemp(prefix='compare_attention_')
  table = {}
  for name in names:
    variant = registry.get(name)
    if model_type not in variant.models:
      print(f'skip {name}: models={",".join(variant.models)}, not {model_type}', flush=True)
      continue
    workdir = os.path.join(root, name)
    shutil.rmtree(workdir, ignore_errors=True)
    table[name] = run_variant(a.experiment, name, a.set, workdir)
    print(f'{name}: {table[name]}', flush=True)
  if not a.root:
    shutil.rmtree(root, ignore_errors=True)

  print(f'\n{os.path.relpath(a.experiment, REPO)} {" ".join(a.set)} '
        f'(model {model_type}, {config.train.num_steps} steps, backend {jax.default_backend()})\n')
  print('| attention | eval seq acc | eval token acc | test_long seq acc | steps/s | params |')
  print('| --- | ---: | ---: | ---: | ---: | ---: |')
  for name, r in table.items():
    print(f'| {name} | {r["eval_seq"]:.3f} | {r["eval_tok"]:.3f} | {r["long_seq"]:.3f} | '
          f'{r["steps_per_sec"]:.1f} | {r["params"]:,} |')


if __name__ == '__main__':
  main()
