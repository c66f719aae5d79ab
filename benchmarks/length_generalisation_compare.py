"""The length-generalisation suite against the papers' orderings, over the
cells that were learned.

  .venv/bin/python benchmarks/length_generalisation_compare.py
      [--results benchmarks/results/length_generalisation_suite] [--learned_at 0.90]

Reads the sweep's results.csv (experiments/sweeps/length_generalisation_suite.py).
A (task, scheme) cell is *learned* when its in-distribution token accuracy
(test.accuracy: the test split at the trained lengths 1-40, mean over the
seeds) is at least --learned_at, 0.90 by default (Deletang et al. 2023 count
a task as solved above 90% accuracy). test.accuracy counts every target
token, the end token included, so on a task whose answer is one token 0.90
means about 80% right answers. The papers compare models that fit their
training lengths; a model that did not has a long-length score that says
nothing about its positions, so the comparisons below use learned cells only.

It prints four sections of markdown tables. Every cell that reports a
(task, scheme) score carries that cell's in-distribution accuracy in
parentheses, and ", not learned" when it is below the threshold (a legend
under each table):

  1. per task: how many of the schemes are learned, which, and their mean
     in-distribution accuracy;
  2. the papers' score, the token accuracy averaged over the long test
     lengths (test.long_mean_length_accuracy), per task: the schemes' spread
     (lowest and highest mean over seeds, the highest among the learned
     schemes, the best seed) and the mean spread over seeds;
  3. Kazemnejad et al. 2023's question: their five schemes' long scores per
     task, then the mean reciprocal rank (MRR) of the five, ranked among
     themselves (1 = best) over the tasks where every one of the five is
     learned, beside the paper's MRR, and Spearman's rank correlation of the
     two orderings; with fewer than 2 such tasks, or when our MRR ties all
     five, it says there are too few for a rank correlation instead;
  4. Ruoss et al. 2023's question: randomized positions minus the same
     scheme without, per task, and on average over the pairs where both
     schemes are learned, beside the paper's +12.0%.

Each comparison says how many cells (or pairs) were learned out of how many.
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
# The papers compare models that fit their training lengths: this metric says whether one did.
IN_DIST_METRIC = 'test.accuracy'
# Deletang et al. 2023 count a task as solved above 90% accuracy.
LEARNED_AT = 0.90

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
  average rank); nan when either scoring is constant (no ordering)."""
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
  denominator = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
  return float((ra * rb).sum() / denominator) if denominator > 0 else float('nan')


def _means(scores):
  """{task: {scheme: [per seed]}} -> {task: {scheme: mean over seeds}}."""
  return {t: {s: float(np.mean(v)) for s, v in by.items()} for t, by in scores.items()}


def accuracy_of(in_dist: dict[str, dict[str, float]], task: str, scheme: str) -> float:
  """The cell's in-distribution accuracy (mean over seeds); nan when it has none."""
  return in_dist.get(task, {}).get(scheme, float('nan'))


def is_learned(accuracy: float, at: float) -> bool:
  """Whether an in-distribution accuracy reaches the threshold (nan: no)."""
  return bool(accuracy >= at)  # nan >= at is False


def learned_only(per_task: dict[str, dict[str, float]], in_dist: dict[str, dict[str, float]],
                 at: float) -> dict[str, dict[str, float]]:
  """{task: {scheme: score}} less the cells that are not learned."""
  return {t: {s: v for s, v in by.items() if is_learned(accuracy_of(in_dist, t, s), at)}
          for t, by in per_task.items()}


def annotate(text: str, accuracy: float, at: float) -> str:
  """A table cell with its in-distribution accuracy: '0.534 (0.71, not
  learned)' below `at`, '0.622 (1.00)' at or above it."""
  shown = '-' if np.isnan(accuracy) else f'{accuracy:.2f}'
  return f'{text} ({shown})' if is_learned(accuracy, at) else f'{text} ({shown}, not learned)'


def legend(at: float) -> str:
  return (f'In parentheses: in-distribution token accuracy ({IN_DIST_METRIC}, mean over '
          f'seeds); "not learned": below {at:.2f}.')


def learned_table(in_dist: dict[str, dict[str, float]], at: float) -> list[str]:
  """Per task: how many schemes are learned, the mean in-distribution accuracy
  over all the task's schemes, and which are learned; then the total over all
  cells."""
  lines = ['| task | learned | mean in-dist accuracy | learned schemes |', '|---|---:|---:|---|']
  total = cells = 0
  for task, by in in_dist.items():
    names = [s for s, a in by.items() if is_learned(a, at)]
    total, cells = total + len(names), cells + len(by)
    shown = 'all' if len(names) == len(by) else ', '.join(names) or '-'
    lines.append(f'| {task} | {len(names)} of {len(by)} | {np.mean(list(by.values())):.2f} | '
                 f'{shown} |')
  everything = [a for by in in_dist.values() for a in by.values()]
  lines.append(f'| **all** | {total} of {cells} | {np.mean(everything):.2f} | |')
  return lines


def spread_table(scores, in_dist, at: float) -> list[str]:
  """Per task, the long score's spread over the schemes; each cell names its
  scheme and carries that scheme's in-distribution accuracy."""
  lines = ['| task | learned | lowest mean | highest mean | highest learned | best seed '
           '| mean std over seeds (all schemes) |', '|---|---:|---|---|---|---|---:|']
  for task, by in scores.items():
    means = {s: float(np.mean(v)) for s, v in by.items()}

    def cell(scheme, value, task=task):
      return annotate(f'{value:.3f} {scheme}', accuracy_of(in_dist, task, scheme), at)

    lowest, best = min(means, key=means.get), max(means, key=means.get)
    seed_best = max(by, key=lambda s: max(by[s]))
    learned = {s: v for s, v in means.items() if is_learned(accuracy_of(in_dist, task, s), at)}
    best_learned = (cell(max(learned, key=learned.get), max(learned.values()))
                    if learned else '-')
    stds = [np.std(v, ddof=1) for v in by.values() if len(v) > 1]
    lines.append(f'| {task} | {len(learned)} of {len(by)} | {cell(lowest, means[lowest])} | '
                 f'{cell(best, means[best])} | {best_learned} | '
                 f'{cell(seed_best, max(by[seed_best]))} | '
                 f'{np.mean(stds) if stds else float("nan"):.3f} |')
  return lines + ['', legend(at)]


def mrr_table(scores, in_dist, at: float) -> list[str]:
  """Kazemnejad et al.'s five schemes: their long scores per task, then, for
  each absolute scheme of ours, the MRR over the tasks where all five are
  learned and its Spearman correlation with the paper's."""
  per_task = _means(scores)
  compared = ('none', 't5_bias', 'alibi', 'rotary') + ABSOLUTE
  lines = ['| task | ' + ' | '.join(compared) + ' |', '|---|' + '---|' * len(compared)]
  for task, by in per_task.items():
    lines.append(f'| {task} | ' + ' | '.join(
        annotate(f'{by[s]:.3f}', accuracy_of(in_dist, task, s), at) if s in by else '-'
        for s in compared) + ' |')
  lines += ['', legend(at), '']
  for absolute in ABSOLUTE:
    ours = ('none', 't5_bias', 'alibi', 'rotary', absolute)
    finished = [t for t, by in per_task.items() if all(s in by for s in ours)]
    if not finished:
      continue
    learned = sum(is_learned(accuracy_of(in_dist, t, s), at) for t in finished for s in ours)
    mrr, tasks = mean_reciprocal_rank(learned_only(per_task, in_dist, at), ours)
    head = (f'Absolute = `{absolute}`: learned: {learned} of {len(ours) * len(finished)} '
            f'cells; tasks where all five are learned: {len(tasks)} of {len(finished)}')
    if not tasks:
      lines += [head + '. No MRR: no task has all five learned.', '']
      continue
    paper = {s: PAPER_MRR['absolute' if s == absolute else s] for s in ours}
    if len(tasks) < 2:
      verdict = f'too few tasks ({len(tasks)}) for a rank correlation'
    else:
      rho = spearman(mrr, paper)  # nan when our MRR ties all five
      verdict = 'none: our MRR ties all five (a constant ordering)' if np.isnan(rho) \
          else f'{rho:+.2f}'
    lines += [f'{head} ({", ".join(tasks)}); Spearman with the paper: {verdict}', '',
              '| scheme | our MRR | paper MRR |', '|---|---|---:|']
    lines += [f'| {s} | ' + annotate(f'{mrr[s]:.2f}',
                                     float(np.mean([in_dist[t][s] for t in tasks])), at) +
              f' | {paper[s]:.2f} |' for s in sorted(ours, key=lambda s: -mrr[s])]
    lines += ['', 'Our MRR\'s in-distribution accuracy: the mean over the tasks it counts.', '']
  return lines


def randomized_table(scores, in_dist, at: float) -> list[str]:
  """Randomized positions minus the same scheme without, per task; each cell
  carries both schemes' in-distribution accuracies (randomized / plain). The
  means count only the pairs where both are learned."""
  per_task = _means(scores)
  lines = ['| task | ' + ' | '.join(f'{r} - {b}' for r, b in RANDOMIZED.items()) + ' |',
           '|---|' + '---|' * len(RANDOMIZED)]
  gains = {r: [] for r in RANDOMIZED}
  pairs = {r: 0 for r in RANDOMIZED}
  for task, by in per_task.items():
    cells = []
    for r, b in RANDOMIZED.items():
      if r not in by or b not in by:
        cells.append('-')
        continue
      ar, ab = accuracy_of(in_dist, task, r), accuracy_of(in_dist, task, b)
      both = is_learned(ar, at) and is_learned(ab, at)
      pairs[r] += 1
      if both:
        gains[r].append(by[r] - by[b])
      shown = ' / '.join('-' if np.isnan(a) else f'{a:.2f}' for a in (ar, ab))
      cells.append(f'{by[r] - by[b]:+.3f} ({shown})' if both else
                   f'{by[r] - by[b]:+.3f} ({shown}, not learned)')
    if any(c != '-' for c in cells):
      lines.append(f'| {task} | ' + ' | '.join(cells) + ' |')
  lines.append('| **mean, learned pairs** | ' + ' | '.join(
      (f'{np.mean(gains[r]):+.3f} over {len(gains[r])} of {pairs[r]} tasks' if gains[r] else
       f'none of {pairs[r]} tasks') for r in RANDOMIZED) + ' |')
  every = [g for r in RANDOMIZED for g in gains[r]]
  learned = (f'{np.mean(every):+.3f} over them' if every else 'no mean')
  return lines + ['', f'In parentheses: in-distribution token accuracy ({IN_DIST_METRIC}, '
                  f'mean over seeds), randomized / plain; "not learned": either below '
                  f'{at:.2f}, left out of the means.', '',
                  f'Learned: {len(every)} of {sum(pairs.values())} pairs (both schemes '
                  f'learned); randomized minus plain: {learned}; paper '
                  f'{PAPER_RANDOMIZED_GAIN:+.3f}.']


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--results', default=RESULTS)
  parser.add_argument('--learned_at', type=float, default=LEARNED_AT,
                      help=f'in-distribution {IN_DIST_METRIC} at which a cell counts as learned')
  args = parser.parse_args(argv)
  path = os.path.join(args.results, 'results.csv')
  scores, in_dist = load(path), _means(load(path, IN_DIST_METRIC))
  at = args.learned_at
  print(f'## Learned in distribution ({IN_DIST_METRIC} >= {at:.2f}, mean over seeds)\n')
  print('\n'.join(learned_table(in_dist, at)))
  print(f'\n## Spread ({METRIC}, mean over seeds)\n')
  print('\n'.join(spread_table(scores, in_dist, at)))
  print('\n## Kazemnejad et al. 2023: mean reciprocal rank over the learned tasks\n')
  print('\n'.join(mrr_table(scores, in_dist, at)))
  print('## Ruoss et al. 2023: randomized positions minus the same scheme without\n')
  print('\n'.join(randomized_table(scores, in_dist, at)))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
