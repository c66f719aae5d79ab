"""A grid of experiment overrides x seeds: run it, resume it, tabulate it.

  ./launch.sh sweep experiments/sweeps/position_study.py [--jobs=2] [--dry_run]
  nohup ./launch.sh sweep GRID.py > sweep.log 2>&1 &          # in the background

A grid file holds values only; its get_sweep() returns

  {'seeds': [0, 1, 2],
   'out': 'workdirs/my_sweep',       # one workdir per run: OUT/STUDY/ROW/seed_S
   'results': 'my_results',          # results.csv, tables.md, STUDY_TABLE.png (default: out)
   'studies': {STUDY: {
       'experiment': 'experiments/multi30k_cpu.py',
       'overrides': {'train.num_steps': 300},          # every row of the study
       'rows': {ROW: {'model.attention': 'shaw'}},     # what differs between rows
       'metrics': {'test.bleu': 'test BLEU'},          # SPLIT.KEY of metrics.jsonl -> label
       'tables': {TABLE: [ROW, ...]},                  # default: one table of every row
   }}}

Each run is `python -m flaxformer_lite.main --config=EXPERIMENT
--workdir=OUT/STUDY/ROW/seed_S --config.seed=S --config.KEY=VALUE ...`, its
output in the workdir's run.log. A finished run leaves sweep_run.json in its
workdir (the command and its wall time); a later invocation skips it, so
re-running the command resumes a half-done grid (an interrupted run resumes
from its last checkpoint) and, with nothing left, only rewrites the results.
Runs go `--jobs` at a time, each pinned to its own share of the cores (Linux).
results.csv has one line per (study, row, seed, metric) with the run's wall
time; tables.md gives mean ± sample std over seeds per table; each table's
figure is a bar per row (mean, error bar std, a dot per seed) per metric.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import runpy
import signal
import subprocess
import sys
import time

from flaxformer_lite.train.metrics import fmt_time

DONE = 'sweep_run.json'
ENTRY = ('-m', 'flaxformer_lite.main')  # what a run executes, after the interpreter
CSV_FIELDS = ('study', 'row', 'overrides', 'seed', 'metric', 'value', 'wall_seconds')


class SweepError(ValueError):
  """A bad grid file; exit code 2."""


@dataclasses.dataclass
class Run:
  study: str
  row: str
  seed: int
  workdir: str
  argv: list

  @property
  def name(self) -> str:
    return f'{self.study}/{self.row} seed {self.seed}'

  def overrides(self, grid) -> str:
    rows = grid['studies'][self.study]['rows'][self.row]
    return ' '.join(f'{k}={v}' for k, v in rows.items())

  def done(self) -> dict | None:
    """The finished run's record when the same command finished in the workdir."""
    path = os.path.join(self.workdir, DONE)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      record = json.load(f)
    # The interpreter aside: a moved or rebuilt venv runs the same command.
    return record if record.get('argv', [None])[1:] == self.argv[1:] else None


def load_grid(path: str) -> dict:
  """The grid file's get_sweep(), checked: every key is known, every table's
  rows exist, every row's config is valid."""
  if not os.path.exists(path):
    raise SweepError(f'grid file {path!r} not found')
  grid = runpy.run_path(path).get('get_sweep')
  if grid is None:
    raise SweepError(f'grid file {path!r} defines no get_sweep()')
  grid = grid()
  _keys(grid, {'seeds', 'out', 'results', 'studies'}, 'the grid', required={'seeds', 'studies'})
  if not grid['studies']:
    raise SweepError(f'{path}: studies is empty')
  for name, study in grid['studies'].items():
    where = f'studies.{name}'
    _keys(study, {'experiment', 'overrides', 'rows', 'metrics', 'tables'}, where,
          required={'experiment', 'rows', 'metrics'})
    study.setdefault('overrides', {})
    study.setdefault('tables', {name: list(study['rows'])})
    for table, rows in study['tables'].items():
      missing = [r for r in rows if r not in study['rows']]
      if missing:
        raise SweepError(f'{where}.tables.{table} names rows {missing} that {where}.rows '
                         f'lacks; rows: {", ".join(study["rows"])}')
    for metric in study['metrics']:
      if metric.count('.') != 1:
        raise SweepError(f'{where}.metrics: {metric!r} is not SPLIT.KEY (e.g. eval.loss, test.bleu)')
    _check_overrides(study, where)
  return grid


def _keys(d: dict, valid: set, where: str, required: set):
  unknown = sorted(set(d) - valid)
  if unknown:
    raise SweepError(f'{where} has unknown keys {unknown}; valid: {", ".join(sorted(valid))}')
  missing = sorted(required - set(d))
  if missing:
    raise SweepError(f'{where} lacks {missing}')


def _check_overrides(study: dict, where: str):
  """Every row's config is valid (main.validate on the experiment with the
  overrides): a typo or a bad value fails here, not hours into the grid."""
  from flaxformer_lite import config as config_lib, main
  if not os.path.exists(study['experiment']):
    raise SweepError(f'{where}.experiment={study["experiment"]!r} not found')
  get_config = runpy.run_path(study['experiment'])['get_config']
  for row, overrides in study['rows'].items():
    config = get_config()
    for key, value in {**study['overrides'], **overrides}.items():
      message = config_lib.unknown_key_message(config, key)
      if message:
        raise SweepError(f'{where} row {row}: override {message}')
      *parents, leaf = key.split('.')
      node = config
      for parent in parents:
        node = node[parent]
      try:
        node[leaf] = value
      except TypeError as e:
        raise SweepError(f'{where} row {row}: {key}={value!r}: {e}') from None
    try:
      main.validate(config)
    except config_lib.ConfigError as e:
      raise SweepError(f'{where} row {row}: {e}') from None


def _value(v) -> str:
  return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def runs(grid: dict, out: str) -> list[Run]:
  """Every (study, row, seed), seeds innermost: a half-done grid has whole rows."""
  result = []
  for study_name, study in grid['studies'].items():
    for row, overrides in study['rows'].items():
      for seed in grid['seeds']:
        workdir = os.path.join(out, study_name, row, f'seed_{seed}')
        argv = [sys.executable, *ENTRY, f'--config={study["experiment"]}',
                f'--workdir={workdir}', f'--config.seed={seed}']
        argv += [f'--config.{k}={_value(v)}' for k, v in {**study['overrides'], **overrides}.items()]
        result.append(Run(study_name, row, seed, workdir, argv))
  return result


def final_metrics(workdir: str) -> dict:
  """{'SPLIT.KEY': value} of the last eval and test records of metrics.jsonl."""
  out = {}
  path = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        if r['split'] in ('eval', 'test'):
          out.update({f'{r["split"]}.{k}': v for k, v in r.items()
                      if k not in ('step', 'split') and isinstance(v, (int, float))})
  return out


def _core_sets(jobs: int) -> list:
  """Each job slot's cores: the available ones cut into `jobs` equal parts
  (None where affinity cannot be set, or there are fewer cores than jobs)."""
  if not hasattr(os, 'sched_getaffinity'):
    return [None] * jobs
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < jobs:
    return [None] * jobs
  per = len(cores) // jobs
  return [set(cores[i * per:(i + 1) * per]) for i in range(jobs)]


def time_left(todo: list[Run], walls: dict, jobs: int) -> str:
  """'~1h05m left': each run to go costs the mean wall time of its study's
  finished runs (of all finished runs for a study with none yet), `jobs` at once."""
  every = [w for ws in walls.values() for w in ws]
  if not every:
    return 'time left unknown'
  mean = lambda ws: sum(ws) / len(ws)
  seconds = sum(mean(walls.get(r.study) or every) for r in todo) / jobs
  return f'~{fmt_time(seconds)} left'


def execute(todo: list[Run], jobs: int, log=print) -> list[Run]:
  """Runs `todo`, `jobs` at a time; a progress line per finished run with the
  time left. Returns the runs that failed. SIGINT/SIGTERM stop the runs (they
  checkpoint on SIGTERM) and raise KeyboardInterrupt."""
  slots, running, failed, walls = _core_sets(jobs), {}, [], {}  # walls: study -> seconds
  queue, total, finished = list(todo), len(todo), 0
  stop = []

  def on_signal(signum, frame):
    del frame
    stop.append(signum)
  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while queue or running:
      if stop:
        for proc, _, _, _ in running.values():
          proc.send_signal(signal.SIGTERM)
        for proc, _, _, _ in running.values():
          proc.wait()
        raise KeyboardInterrupt
      free = [i for i in range(jobs) if i not in running]
      while queue and free:
        slot, run = free.pop(0), queue.pop(0)
        os.makedirs(run.workdir, exist_ok=True)
        logfile = open(os.path.join(run.workdir, 'run.log'), 'a')
        proc = subprocess.Popen(run.argv, stdout=logfile, stderr=subprocess.STDOUT)
        if slots[slot]:  # before the child has imported anything that starts threads
          os.sched_setaffinity(proc.pid, slots[slot])
        running[slot] = (proc, run, logfile, time.time())
      time.sleep(0.2)
      for slot, (proc, run, logfile, start) in list(running.items()):
        code = proc.poll()
        if code is None:
          continue
        logfile.close()
        del running[slot]
        finished += 1
        wall = time.time() - start
        if code == 0:
          walls.setdefault(run.study, []).append(wall)
          with open(os.path.join(run.workdir, DONE), 'w') as f:
            json.dump({'argv': run.argv, 'wall_seconds': wall}, f)
          status = f'done in {fmt_time(wall)}'
        else:
          failed.append(run)
          status = f'FAILED (exit {code}; {os.path.join(run.workdir, "run.log")})'
        left = total - finished
        log(f'[{finished}/{total}] {run.name}: {status}; {left} to go'
            + (f', {time_left(queue + [r for _, r, _, _ in running.values()], walls, jobs)}'
               if left else ''))
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return failed


def collect(grid: dict, all_runs: list[Run]) -> list[dict]:
  """results.csv's lines: every final eval/test metric of every finished run."""
  lines = []
  for run in all_runs:
    record = run.done()
    if record is None:
      continue
    for metric, value in sorted(final_metrics(run.workdir).items()):
      lines.append({'study': run.study, 'row': run.row, 'overrides': run.overrides(grid),
                    'seed': run.seed, 'metric': metric, 'value': value,
                    'wall_seconds': round(record['wall_seconds'], 1)})
  return lines


def summarise(values: list[float]) -> tuple[float, float, int]:
  """(mean, sample standard deviation (n - 1; nan for one value), n)."""
  n = len(values)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
  return mean, std, n


def _by_row(lines, study, metric) -> dict:
  out = {}
  for line in lines:
    if line['study'] == study and line['metric'] == metric:
      out.setdefault(line['row'], []).append(line['value'])
  return out


def tables_markdown(grid: dict, lines: list[dict]) -> str:
  """One markdown table per (study, table): mean ± std (n seeds) per metric,
  and the mean wall time of a run."""
  out = []
  for name, study in grid['studies'].items():
    for table, rows in study['tables'].items():
      metrics = study['metrics']
      out.append(f'### {name}: {table}\n')
      out.append('| row | ' + ' | '.join(metrics.values()) + ' | wall per run |')
      out.append('|---' * (len(metrics) + 2) + '|')
      walls = _by_row([dict(l, metric='wall', value=l['wall_seconds']) for l in lines
                       if l['metric'] == next(iter(metrics))], name, 'wall')
      for row in rows:
        cells = []
        for metric in metrics:
          values = _by_row(lines, name, metric).get(row)
          if values:
            mean, std, n = summarise(values)
            digits = 2 if abs(mean) >= 10 else 3  # BLEU to 0.01, losses to 0.001
            cells.append(f'{mean:.{digits}f} ± {std:.{digits}f} (n={n})' if n > 1
                         else f'{mean:.{digits}f} (n=1)')
          else:
            cells.append('–')
        wall = walls.get(row)
        cells.append(fmt_time(sum(wall) / len(wall)) if wall else '–')
        out.append(f'| {row} | ' + ' | '.join(cells) + ' |')
      out.append('')
  return '\n'.join(out)


def plot(grid: dict, lines: list[dict], results: str) -> list[str]:
  """A figure per (study, table); returns the paths written."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  paths = []
  for name, study in grid['studies'].items():
    for table, rows in study['tables'].items():
      metrics = study['metrics']
      fig, axes = plt.subplots(1, len(metrics), figsize=(1.0 + 0.9 * len(rows) * len(metrics), 3.6),
                               squeeze=False)
      for ax, (metric, label) in zip(axes[0], metrics.items()):
        values = _by_row(lines, name, metric)
        for x, row in enumerate(rows):
          v = values.get(row, [])
          if not v:
            continue
          mean, std, _ = summarise(v)
          ax.bar(x, mean, color='C0', alpha=0.6)
          if len(v) > 1:
            ax.errorbar(x, mean, yerr=std, color='k', capsize=4)
          ax.plot([x] * len(v), v, 'k.', markersize=4)
        ax.set_xticks(range(len(rows)), rows, rotation=30, ha='right')
        ax.set_title(label, fontsize=10)
        present = [x for r in rows for x in values.get(r, [])]
        if present:  # bars from a floor near the data: the differences are the point
          lo, hi = min(present), max(present)
          pad = (hi - lo) * 0.3 or abs(hi) * 0.05 or 1.0
          ax.set_ylim(max(lo - pad, 0) if lo >= 0 else lo - pad, hi + pad)
      fig.suptitle(f'{name}: {table} (mean ± std over seeds; dots: seeds)', fontsize=10)
      fig.tight_layout()
      path = os.path.join(results, f'{name}_{table}.png')
      fig.savefig(path, dpi=110)
      plt.close(fig)
      paths.append(path)
  return paths


def write_results(grid: dict, all_runs: list[Run], results: str, *, figures=True) -> list[dict]:
  os.makedirs(results, exist_ok=True)
  lines = collect(grid, all_runs)
  with open(os.path.join(results, 'results.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    writer.writeheader()
    writer.writerows(lines)
  with open(os.path.join(results, 'tables.md'), 'w') as f:
    f.write(tables_markdown(grid, lines))
  if figures and lines:
    plot(grid, lines, results)
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('grid', help='a grid file: get_sweep() -> dict (see this module)')
  parser.add_argument('--out', help="workdirs' root (default: the grid's 'out')")
  parser.add_argument('--results', help="where results.csv, tables.md and the figures go "
                      "(default: the grid's 'results', else --out)")
  parser.add_argument('--jobs', type=int, default=1, help='runs at a time (one per core or two)')
  parser.add_argument('--dry_run', action='store_true', help='list the runs and what is done')
  parser.add_argument('--no_figures', action='store_true')
  args = parser.parse_args(argv)
  try:
    grid = load_grid(args.grid)
  except SweepError as e:
    print(f'sweep: {e}', file=sys.stderr)
    return 2
  out = args.out or grid.get('out')
  if not out:
    print("sweep: no --out and the grid sets no 'out'", file=sys.stderr)
    return 2
  if args.jobs < 1:
    print(f'sweep: --jobs={args.jobs} must be >= 1', file=sys.stderr)
    return 2
  results = args.results or grid.get('results') or out
  all_runs = runs(grid, out)
  todo = [r for r in all_runs if r.done() is None]
  print(f'sweep: {len(all_runs)} runs ({len(grid["studies"])} studies, '
        f'{len(grid["seeds"])} seeds), {len(all_runs) - len(todo)} done, {len(todo)} to run '
        f'{args.jobs} at a time; workdirs in {out}', flush=True)
  if args.dry_run:
    for r in all_runs:
      print(f'  {"done" if r.done() else "todo"}  {r.name}: {" ".join(r.argv[1:])}')
    return 0
  failed = []
  try:
    failed = execute(todo, args.jobs, log=lambda s: print(s, flush=True))
  except KeyboardInterrupt:
    print('sweep: stopped; the unfinished runs checkpointed. Re-run the same command to '
          'resume.', file=sys.stderr)
    write_results(grid, all_runs, results, figures=not args.no_figures)
    return 1
  lines = write_results(grid, all_runs, results, figures=not args.no_figures)
  print(f'sweep: {len(lines)} lines in {os.path.join(results, "results.csv")}; tables in '
        f'{os.path.join(results, "tables.md")}', flush=True)
  if failed:
    print(f'sweep: {len(failed)} runs failed: ' + ', '.join(r.name for r in failed)
          + '. Their logs are run.log in their workdirs; re-running the command retries them.',
          file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
