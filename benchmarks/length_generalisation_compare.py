"""The length-generalisation suite against the papers' orderings.

  .venv/bin/python benchmarks/length_generalisation_compare.py
      [--results benchmarks/results/length_generalisation_suite]

Reads the sweep's results.csv (experiments/sweeps/length_generalisation_suite.py)
and prints three markdown tables on the papers' score, the token accuracy
averaged over the long test lengths (test.long_mean_length_accuracy):

  1. per task: the schemes' spread (lowest and highest mean over seeds), the
     best scheme by mean and by best seed, and the mean spread over seeds;
  2. Kazemnejad et al. 2023's question: the mean reciprocal rank (MRR) of
     their five schemes over the tasks every one of them finished, ranked
     among those five (1 = best), beside the paper's MRR, and Spearman's
     rank correlation of the two orderings;
  3. Ruoss et al. 2023's question: randomized positions minus the same
     scheme without, per task, and on average beside the paper's +12.0%.

A task enters a table once each scheme the table needs has at least one
finished seed; the sweep resumes, so the tables fill in as it runs.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, 'results', 'length_generalisation_suite')
METRIC = 'test.long_mean_length_accuracy'

# Kazemnejad et al. 2023, decoder-only, MRR over their tasks and scales. Their
# absolute embedding is tabulated here against both of ours (sinusoidal and
# learned), each in turn.
PAPER_MRR = {'none': 0.69, 't5_bias': 0.55, 'alibi': 0.50, 'rotary': 0.33, 'absolute': 0.22}
ABSOLUTE = ('sinusoidal', 'learned')
# Ruoss et al. 2023: randomized positions add this much test accuracy on
# average over the 15 tasks and their encodings.
PAPER_RANDOMIZED_GAIN = 0.120
RANDOMIZED = {'randomized_sinusoidal': 'sinusoidal', 'randomized_rotary': 'rotary'}


def load(path: str, metric: str = METRIC) -> dict[str, dict[str, list[float]]]:
  """results.csv -> {task: {scheme: [the metric, one per finished seed]}}."""
  scores: dict[str, dict[str, list[float]]] = collections.defaultdict(
      lambda: collections.defaultdict(list))
  with open(path, newline='') as f:
    for row in csv.DictReader(f):
      if row['metric'] == metric and row['value'] not in ('', 'nan'):
        scores[row['study']][row['row']].append(float(row['value']))
  return {task: dict(by_scheme) for task, by_scheme in scores.items()}


def ranks(scores: dict[str, float]) -> dict[str, int]:
  """{scheme: rank}, 1 for the highest score; tied schemes share the better
  rank (1 + how many schemes score strictly higher)."""
  return {s: 1 + sum(other > v for other in scores.values()) for s, v in scores.items()}


def mean_reciprocal_rank(per_task: dict[str, dict[str, float]],
                         schemes: tuple[str, ...]) -> tuple[dict[str, float], list[str]]:
  """({scheme: mean over tasks of 1 / its rank among `schemes`}, the tasks
  used: those where every one of `schemes` has a score)."""
  tasks = [t for t, by in per_task.items() if all(s in by for s in schemes)]
  mrr = {s: float(np.mean([1.0 / ranks({x: per_task[t][x] for x in schemes})[s]
                           for t in tasks])) if tasks else float('nan') for s in schemes}
  return mrr, tasks


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
  """Spearman's rank correlation of two scorings of the same keys (ties: the
  average rank)."""
  keys = sorted(a)

  def average_ranks(x):
    values = np.asarray([x[k] for k in keys])
    order = (-values).argsort(kind='stable')
    r = np.empty(len(keys))
    r[order] = np.arange(1, len(keys) + 1)
    for v in np.unique(values):  # ties share their mean rank
      r[values == v] = r[values == v].mean()
    return r

  ra, rb = average_ranks(a), average_ranks(b)
  ra, rb = ra - ra.mean(), rb - rb.mean()
  return float((ra * rb).sum() / np.sqrt((ra ** 2).sum() * (rb ** 2).sum()))


def _means(scores):
  return {t: {s: float(np.mean(v)) for s, v in by.items()} for t, by in scores.items()}


def spread_table(scores) -> list[str]:
  lines = ['| task | schemes | lowest mean | highest mean | best by mean | best seed (scheme) '
           '| mean std over seeds |', '|---|---:|---:|---:|---|---|---:|']
  for task, by in scores.items():
    means = {s: np.mean(v) for s, v in by.items()}
    best = max(means, key=means.get)
    seed_best = max(by, key=lambda s: max(by[s]))
    stds = [np.std(v, ddof=1) for v in by.values() if len(v) > 1]
    lines.append(f'| {task} | {len(by)} | {min(means.values()):.3f} | {means[best]:.3f} | '
                 f'{best} | {max(by[seed_best]):.3f} ({seed_best}) | '
                 f'{np.mean(stds) if stds else float("nan"):.3f} |')
  return lines


def mrr_table(scores) -> list[str]:
  per_task = _means(scores)
  lines = []
  for absolute in ABSOLUTE:
    ours = ('none', 't5_bias', 'alibi', 'rotary', absolute)
    mrr, tasks = mean_reciprocal_rank(per_task, ours)
    if not tasks:
      continue
    paper = {s: PAPER_MRR['absolute' if s == absolute else s] for s in ours}
    lines += [f'Absolute = `{absolute}`, over {len(tasks)} tasks ({", ".join(tasks)}); '
              f'Spearman with the paper: {spearman(mrr, paper):+.2f}', '',
              '| scheme | our MRR | paper MRR |', '|---|---:|---:|']
    lines += [f'| {s} | {mrr[s]:.2f} | {paper[s]:.2f} |'
              for s in sorted(ours, key=lambda s: -mrr[s])]
    lines.append('')
  return lines


def randomized_table(scores) -> list[str]:
  per_task = _means(scores)
  lines = ['| task | ' + ' | '.join(f'{r} - {b}' for r, b in RANDOMIZED.items()) + ' |',
           '|---|' + '---:|' * len(RANDOMIZED)]
  gains = []
  for task, by in per_task.items():
    cells = []
    for r, b in RANDOMIZED.items():
      if r in by and b in by:
        gains.append(by[r] - by[b])
        cells.append(f'{by[r] - by[b]:+.3f}')
      else:
        cells.append('-')
    if any(c != '-' for c in cells):
      lines.append(f'| {task} | ' + ' | '.join(cells) + ' |')
  mean = float(np.mean(gains)) if gains else float('nan')
  lines.append(f'| **mean** | {mean:+.3f} over {len(gains)} pairs; paper '
               f'{PAPER_RANDOMIZED_GAIN:+.3f} |' + ' |' * (len(RANDOMIZED) - 1))
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--results', default=RESULTS)
  args = parser.parse_args(argv)
  scores = load(os.path.join(args.results, 'results.csv'))
  print(f'## Spread ({METRIC}, mean over seeds)\n')
  print('\n'.join(spread_table(scores)))
  print('\n## Kazemnejad et al. 2023: mean reciprocal rank\n')
  print('\n'.join(mrr_table(scores)))
  print('## Ruoss et al. 2023: randomized positions minus the same scheme without\n')
  print('\n'.join(randomized_table(scores)))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
