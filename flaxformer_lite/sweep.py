"""A grid of experiment overrides x seeds: run it, resume it, tabulate it.

  ./launch.sh sweep experiments/sweeps/position_study.py [--jobs=2] [--dry_run]
  nohup ./launch.sh sweep GRID.py > sweep.log 2>&1 &          # in the background
  ./launch.sh sweep GRID.py --plot_only --results DIR         # DIR/results.csv -> figures

A grid file holds values only; its get_sweep() returns

  {'seeds': [0, 1, 2],
   'out': 'workdirs/my_sweep',   # one workdir per run: OUT/STUDY/ROW/seed_S
                                 # (default: workdirs/sweeps/GRID_NAME)
   'results': 'my_results',      # results.csv, tables.md, STUDY_TABLE.png (default: out)
   'studies': {STUDY: {
       'experiment': 'experiments/multi30k_cpu.py',
       'overrides': {'train.num_steps': 300},          # every row of the study
       'rows': {ROW: {'model.attention': 'shaw'}},     # what differs between rows
       'metrics': {'test.bleu': 'test BLEU'},          # SPLIT.KEY of metrics.jsonl -> label
                                                       # (SPLIT: train, eval or test)
       'tables': {TABLE: [ROW, ...]},                  # default: one table of every row
   }},
   # optional, across studies of the same rows:
   'summaries': {NAME: {'metric': 'test.accuracy', 'label': 'accuracy'}},
   'curves': {NAME: {'metric': 'test.accuracy_len', 'label': 'accuracy',
                     'xlabel': 'length', 'panels': {PANEL: [STUDY, ...]}}},
   'scatters': {NAME: {'x': 'train.step_flops', 'xlabel': 'FLOPs per train step',
                       'y': 'test.accuracy', 'ylabel': 'accuracy', 'studies': [STUDY, ...]}}}

Each run is `./launch.sh EXPERIMENT --workdir=OUT/STUDY/ROW/seed_S
--config.seed=S --config.KEY=VALUE ...` (run as `python -m
flaxformer_lite.main`), its output in the workdir's run.log; `--dry_run`
prints every run's status, estimated time and that command. A finished run
leaves sweep_run.json in its workdir (the command and its wall time); a later
invocation skips it, so re-running the command resumes a half-done grid (an
interrupted run resumes from its last checkpoint) and, with nothing left,
only rewrites the results. A workdir whose config.json differs from its row's
config (a changed row or experiment file) is moved to WORKDIR.old-N, kept,
and the row runs from scratch. Runs go `--jobs` at a time, each pinned to its
own share of the cores (Linux). results.csv has one line per (study, row,
seed, metric) of the grid's rows with the run's wall time; tables.md gives
mean ± sample std over seeds per table; each table's figure is a bar per row
(mean from 0, error bar std, a dot per seed) per metric. A summary is a
table of one metric with a line per study and a column per row: mean ±
std over seeds with the best seed's value, and the mean over studies. A
curves entry is the figure NAME.png: the metrics SPLIT.PREFIX<number>
against the number, a panel per PANEL averaging its studies, a curve per row.
A scatters entry is the figure NAME.png: metric y against metric x, a panel
per study, a point per row (the means over seeds, ± std bars both ways).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import runpy
import shlex
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from flaxformer_lite import sweep_plots
from flaxformer_lite.train.metrics import fmt_time

DONE = 'sweep_run.json'
ENTRY = ('-m', 'flaxformer_lite.main')  # what a run executes, after the interpreter
CSV_FIELDS = ('study', 'row', 'overrides', 'seed', 'metric', 'value', 'wall_seconds')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = {
    'done': 'finished with this config (skipped)',
    'to run': 'nothing in its workdir yet',
    'partial': 'started: resumes from its newest checkpoint',
    'changed': 'its workdir holds a run of another config: moved to WORKDIR.old-N '
               '(kept), then run from scratch',
}
COMMAND_WIDTH = 100


class SweepError(ValueError):
  """A bad grid file; exit code 2."""


@dataclasses.dataclass
class Run:
  """One (study, row, seed): `flags` maps config keys to values (the seed,
  the study's overrides, the row's); `config` is the resulting full config
  (a ConfigDict; None where unknown), compared with the workdir's config.json."""
  study: str
  row: str
  seed: int
  workdir: str
  experiment: str = ''
  flags: dict = dataclasses.field(default_factory=dict)
  config: Any = None

  @property
  def name(self) -> str:
    return f'{self.study}/{self.row} seed {self.seed}'

  @property
  def argv(self) -> list[str]:
    """The subprocess's command line."""
    return [sys.executable, *ENTRY, f'--config={self.experiment}', f'--workdir={self.workdir}',
            *(f'--config.{k}={_value(v)}' for k, v in self.flags.items())]

  def command(self, width: int = COMMAND_WIDTH) -> str:
    """The same run as a shell command to paste: `./launch.sh EXPERIMENT
    --workdir=... --config.k=v ...` (launch.sh's full path outside the
    repository root), values quoted, lines past `width` continued with a
    backslash."""
    words = [_launcher(), shlex.quote(_from_repo(self.experiment)),
             '--workdir=' + shlex.quote(_from_repo(self.workdir))]
    words += [f'--config.{k}=' + shlex.quote(_value(v)) for k, v in self.flags.items()]
    lines, line = [], words[0]
    for word in words[1:]:
      if len(line) + 1 + len(word) + 2 > width:
        lines.append(line + ' \\')
        line = '    ' + word
      else:
        line += ' ' + word
    return '\n'.join(lines + [line])

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


def _value(v) -> str:
  return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def _launcher() -> str:
  """launch.sh as the user can type it from here."""
  here = os.path.abspath(os.getcwd())
  return './launch.sh' if here == REPO else shlex.quote(os.path.join(REPO, 'launch.sh'))


def _from_repo(path: str) -> str:
  """`path` as launch.sh (which runs in the repository root) reads it:
  relative inside the repository, absolute outside."""
  full = os.path.abspath(path)
  inside = os.path.commonpath([full, REPO]) == REPO
  return os.path.relpath(full, REPO) if inside else full


def load_grid(path: str, check_configs: bool = True) -> dict:
  """The grid file's get_sweep(), checked: every key is known, every table's
  rows exist and (check_configs) every row's config is valid."""
  if not os.path.exists(path):
    raise SweepError(f'grid file {path!r} not found')
  grid = runpy.run_path(path).get('get_sweep')
  if grid is None:
    raise SweepError(f'grid file {path!r} defines no get_sweep()')
  grid = grid()
  _keys(grid, {'seeds', 'out', 'results', 'studies', 'summaries', 'curves', 'scatters'},
        'the grid', required={'seeds', 'studies'})
  if not grid['studies']:
    raise SweepError(f'{path}: studies is empty')
  for name, summary in grid.get('summaries', {}).items():
    _keys(summary, {'metric', 'label'}, f'summaries.{name}', required={'metric', 'label'})
  for name, curves in grid.get('curves', {}).items():
    where = f'curves.{name}'
    _keys(curves, {'metric', 'label', 'xlabel', 'panels'}, where,
          required={'metric', 'label', 'panels'})
    for panel, studies in curves['panels'].items():
      missing = [s for s in studies if s not in grid['studies']]
      if missing:
        raise SweepError(f'{where}.panels.{panel} names studies {missing} that the grid lacks; '
                         f'studies: {", ".join(grid["studies"])}')
  for name, scatter in grid.get('scatters', {}).items():
    where = f'scatters.{name}'
    _keys(scatter, {'x', 'xlabel', 'y', 'ylabel', 'studies'}, where,
          required={'x', 'y', 'studies'})
    missing = [s for s in scatter['studies'] if s not in grid['studies']]
    if missing:
      raise SweepError(f'{where}.studies names {missing}, which the grid lacks; studies: '
                       f'{", ".join(grid["studies"])}')
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
    if check_configs:
      _check_overrides(study, where)
  return grid


def _keys(d: dict, valid: set, where: str, required: set):
  unknown = sorted(set(d) - valid)
  if unknown:
    raise SweepError(f'{where} has unknown keys {unknown}; valid: {", ".join(sorted(valid))}')
  missing = sorted(required - set(d))
  if missing:
    raise SweepError(f'{where} lacks {missing}')


def row_configs(study: dict, where: str) -> dict:
  """{row: the experiment's config with the study's and the row's overrides}
  (SweepError naming a key that does not exist or a value of the wrong type)."""
  from flaxformer_lite import config as config_lib
  if not os.path.exists(study['experiment']):
    raise SweepError(f'{where}.experiment={study["experiment"]!r} not found')
  get_config = runpy.run_path(study['experiment'])['get_config']
  out = {}
  for row, overrides in study['rows'].items():
    given = {**study['overrides'], **overrides}
    try:  # before get_config(), as on the command line: their variants' options are keys
      config_lib.import_modules(given.get('model.import_modules', ''))
    except config_lib.ConfigError as e:
      raise SweepError(f'{where} row {row}: {e}') from None
    config = get_config()
    for key, value in given.items():
      message = config_lib.unknown_key_message(config, key)
      if message:
        raise SweepError(f'{where} row {row}: override {message}')
      node, leaf = config_lib.parent_of(config, key)
      try:
        node[leaf] = value
      except TypeError as e:
        raise SweepError(f'{where} row {row}: {key}={value!r}: {e}') from None
    out[row] = config
  return out


def _check_overrides(study: dict, where: str):
  """Every row's config is valid (main.validate on the experiment with the
  overrides): a typo or a bad value fails here, not hours into the grid."""
  from flaxformer_lite import config as config_lib, main
  for row, config in row_configs(study, where).items():
    try:
      main.validate(config)
    except config_lib.ConfigError as e:
      raise SweepError(f'{where} row {row}: {e}') from None


def runs(grid: dict, out: str) -> list[Run]:
  """Every (study, row, seed), seeds innermost: a half-done grid has whole rows."""
  result = []
  for study_name, study in grid['studies'].items():
    configs = row_configs(study, f'studies.{study_name}')
    for row, overrides in study['rows'].items():
      for seed in grid['seeds']:
        config = configs[row].copy_and_resolve_references()
        config.seed = seed
        result.append(Run(study_name, row, seed, os.path.join(out, study_name, row, f'seed_{seed}'),
                          study['experiment'],
                          {'seed': seed, **study['overrides'], **overrides}, config))
  return result


def config_changes(run: Run) -> list[str]:
  """'key: saved -> row' for each value of the workdir's config.json that
  differs from the run's config where main would refuse to resume (empty
  without a saved config). A model.vocab_size or model.num_classes of 0
  means the dataset's: the run saved the number it took."""
  from flaxformer_lite import config as config_lib
  path = os.path.join(run.workdir, 'config.json')
  if run.config is None or not os.path.exists(path):
    return []
  with open(path) as f:
    saved = config_lib.from_json(f.read())
  diffs = config_lib.differences(saved, run.config)
  from_data = [f'model.{k}:' for k in ('vocab_size', 'num_classes') if not run.config.model[k]]
  return [d for d in diffs if not d.startswith(tuple(from_data))]


def status(run: Run) -> str:
  """One of STATUSES."""
  if config_changes(run):
    return 'changed'
  if run.done():
    return 'done'
  started = any(os.path.exists(os.path.join(run.workdir, f))
                for f in ('config.json', 'metrics.jsonl'))
  return 'partial' if started else 'to run'


def move_aside(workdir: str, log=print) -> str:
  """Renames `workdir` to the first free `workdir.old-N`; returns the new path."""
  n = 1
  while os.path.exists(f'{workdir}.old-{n}'):
    n += 1
  os.rename(workdir, f'{workdir}.old-{n}')
  log(f'sweep: moved {workdir} to {workdir}.old-{n}: it holds a run of another config')
  return f'{workdir}.old-{n}'


def _records(workdir: str):
  path = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          yield json.loads(line)


def final_metrics(workdir: str) -> dict:
  """{'SPLIT.KEY': value} of the last train, eval and test records of
  metrics.jsonl (train: the last logged window's loss, steps_per_sec,
  step_flops, ...)."""
  out = {}
  for r in _records(workdir):
    if r['split'] in ('train', 'eval', 'test'):
      out.update({f'{r["split"]}.{k}': v for k, v in r.items()
                  if k not in ('step', 'split') and isinstance(v, (int, float))})
  return out


def recorded_walls(all_runs: list[Run]) -> dict:
  """{study: [wall seconds]} of the runs that sweep_run.json records as done."""
  walls = {}
  for run in all_runs:
    record = run.done()
    if record and 'wall_seconds' in record:
      walls.setdefault(run.study, []).append(record['wall_seconds'])
  return walls


def step_rates(all_runs: list[Run]) -> dict:
  """{study: [steps/s]} logged by its runs' training (metrics.jsonl 'train' records)."""
  rates = {}
  for run in all_runs:
    for r in _records(run.workdir):
      if r['split'] == 'train' and r.get('steps_per_sec'):
        rates.setdefault(run.study, []).append(r['steps_per_sec'])
  return rates


def steps_left(run: Run, from_scratch: bool = False) -> tuple[int, int] | None:
  """(steps to go, train.num_steps); the steps done are the last step in its
  metrics.jsonl unless from_scratch. None without a config."""
  if run.config is None:
    return None
  steps = run.config.train.num_steps
  done = 0 if from_scratch else max((r['step'] for r in _records(run.workdir)), default=0)
  return max(steps - done, 0), steps


def seconds_left(run: Run, walls: dict, rates: dict, from_scratch: bool = False) -> float | None:
  """A run's remaining seconds: the median wall time of its study's finished
  runs times the share of its steps left (steps_left); else its steps left at
  the median steps/s its study's runs logged (training only: evaluation comes
  on top); else None."""
  left, steps = steps_left(run, from_scratch) or (None, None)
  share = left / steps if steps else 1.0
  if walls.get(run.study):
    return statistics.median(walls[run.study]) * share
  if rates.get(run.study) and steps:
    return left / statistics.median(rates[run.study])
  return None


def _total(estimates: list[float | None], jobs: int) -> tuple[float | None, int]:
  """(the known runs' seconds, `jobs` at once, or None if none is known; the
  number of runs of unknown length)."""
  known = [s for s in estimates if s is not None]
  return (sum(known) / jobs if known else None), len(estimates) - len(known)


def time_left(todo: list[Run], walls: dict, jobs: int, rates: dict | None = None) -> str:
  """'~1h05m left' for `todo`, `jobs` at once (seconds_left per run), with
  the runs of unknown length counted apart."""
  seconds, unknown = _total([seconds_left(r, walls, rates or {}) for r in todo], jobs)
  if seconds is None:
    return 'time left unknown'
  text = f'~{fmt_time(seconds)} left'
  return text + (f' (+{unknown} run{"s" * (unknown > 1)} of unknown length)' if unknown else '')


def estimate_basis(study: str, walls: dict, rates: dict) -> str:
  """What seconds_left bases a study's runs on, in words."""
  if walls.get(study):
    return (f'median wall time of its {len(walls[study])} finished runs '
            f'({fmt_time(statistics.median(walls[study]))}) x the share of steps left')
  if rates.get(study):
    return (f'steps left at {statistics.median(rates[study]):.2f} steps/s, as its runs logged '
            '(training only: evaluation comes on top)')
  return '? until one of its runs finishes or logs a step rate'


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


def execute(todo: list[Run], jobs: int, log=print, walls=None, rates=None) -> list[Run]:
  """Runs `todo`, `jobs` at a time; a progress line per finished run with the
  time left (time_left from `walls`, {study: seconds} of finished runs, which
  grows as runs finish, and `rates`). Returns the runs that failed.
  SIGINT/SIGTERM stop the runs (they checkpoint on SIGTERM) and raise
  KeyboardInterrupt."""
  slots, running, failed = _core_sets(jobs), {}, []
  walls = {k: list(v) for k, v in (walls or {}).items()}
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
          outcome = f'done in {fmt_time(wall)}'
        else:
          failed.append(run)
          outcome = f'FAILED (exit {code}; {os.path.join(run.workdir, "run.log")})'
        left = total - finished
        log(f'[{finished}/{total}] {run.name}: {outcome}; {left} to go'
            + (f', {time_left(queue + [r for _, r, _, _ in running.values()], walls, jobs, rates)}'
               if left else ''))
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return failed


def _aligned(header: list[str], rows: list[list[str]], right: set = frozenset()) -> list[str]:
  """Text table lines, each column as wide as its widest cell (`right`: the
  right-aligned columns' indices)."""
  widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
  def line(cells):
    return '  '.join(str(c).rjust(w) if i in right else str(c).ljust(w)
                     for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
  return [line(header), *map(line, rows)]


def dry_run_summary(all_runs: list[Run], statuses: dict, walls: dict, rates: dict,
                    jobs: int) -> str:
  """Runs per study and status, the time left and what it rests on: a dry
  run's answer without its table (dry_run_report)."""
  out = []
  for study in dict.fromkeys(r.study for r in all_runs):
    runs_of = [r for r in all_runs if r.study == study]
    counts = {}
    for r in runs_of:
      counts[statuses[r.name]] = counts.get(statuses[r.name], 0) + 1
    out.append(f'  {study}: {_count(len(runs_of), "run")}: '
               + ', '.join(f'{n} {state}' for state, n in counts.items()))
  todo = [r for r in all_runs if statuses[r.name] != 'done']
  seconds, unknown = _total([seconds_left(r, walls, rates, statuses[r.name] == 'changed')
                             for r in todo], jobs)
  if not todo:
    out.append('time left: none (every run is done)')
  elif seconds is None:
    out.append('time left: unknown until a run finishes or logs a step rate')
  else:
    out.append(f'time left: ~{fmt_time(seconds)} at {jobs} at a time'
               + (f', and {unknown} runs of unknown length' if unknown else ''))
  out.append('(--dry_run --table: every run with its status, time left and command)')
  return '\n'.join(out)


def dry_run_report(all_runs: list[Run], statuses: dict, walls: dict, rates: dict,
                   jobs: int) -> str:
  """The table of runs (number, study, row, seed, status, steps and time
  left), what the estimates rest on, the statuses' meaning, then each run's
  command."""
  table, left = [], []
  for i, run in enumerate(all_runs, 1):
    state = statuses[run.name]
    steps, seconds = '-', '-'
    if state != 'done':
      scratch = state == 'changed'
      estimate = seconds_left(run, walls, rates, scratch)
      left.append(estimate)
      seconds = '?' if estimate is None else f'~{fmt_time(estimate)}'
      to_go = steps_left(run, scratch)
      steps = '?' if to_go is None else (f'{to_go[0]}' if to_go[0] == to_go[1]
                                         else f'{to_go[0]} of {to_go[1]}')
    table.append([str(i), run.study, run.row, str(run.seed), state, steps, seconds])
  out = _aligned(['#', 'study', 'row', 'seed', 'status', 'steps left', 'time left'], table,
                 right={0, 3, 5, 6})
  seconds, unknown = _total(left, jobs)
  total = '?' if seconds is None else f'~{fmt_time(seconds)}'
  out += ['', f'time left: {total} at {jobs} at a time'
          + (f', and {unknown} runs of unknown length' if unknown else '')
          + '; per run, estimated from:']
  out += [f'  {study}: {estimate_basis(study, walls, rates)}'
          for study in dict.fromkeys(r.study for r in all_runs)]
  out += ['status:'] + [f'  {k}: {v}' for k, v in STATUSES.items() if k in statuses.values()]
  out += ['', 'commands (one run each; paste in any shell):']
  for i, run in enumerate(all_runs, 1):
    out += [f'# {i}: {run.name} ({statuses[run.name]})', run.command()]
  return '\n'.join(out)


def collect(grid: dict, all_runs: list[Run]) -> list[dict]:
  """results.csv's lines: every final eval/test metric of every finished run,
  and the train metrics that the grid names (its studies' metrics, summaries
  and scatters)."""
  named = {m for study in grid['studies'].values() for m in study['metrics']}
  named |= {s['metric'] for s in grid.get('summaries', {}).values()}
  named |= {s[k] for s in grid.get('scatters', {}).values() for k in ('x', 'y')}
  lines = []
  for run in all_runs:
    record = run.done()
    if record is None:
      continue
    for metric, value in sorted(final_metrics(run.workdir).items()):
      if metric.startswith('train.') and metric not in named:
        continue
      lines.append({'study': run.study, 'row': run.row, 'overrides': run.overrides(grid),
                    'seed': run.seed, 'metric': metric, 'value': value,
                    'wall_seconds': round(record['wall_seconds'], 1)})
  return lines


def read_results(path: str) -> list[dict]:
  """results.csv's lines back, seed an int, value and wall_seconds floats."""
  with open(path, newline='') as f:
    return [dict(line, seed=int(line['seed']), value=float(line['value']),
                 wall_seconds=float(line['wall_seconds'])) for line in csv.DictReader(f)]


def _by_row(lines, study, metric) -> dict:
  out = {}
  for line in lines:
    if line['study'] == study and line['metric'] == metric:
      out.setdefault(line['row'], []).append(line['value'])
  return out


def tables_markdown(grid: dict, lines: list[dict]) -> str:
  """One markdown table per (study, table): mean ± std (n seeds) per metric,
  and the mean wall time of a run."""
  fmt = sweep_plots.fmt_value
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
            mean, std, n = sweep_plots.summarise(values)
            cells.append(f'{fmt(mean)} ± {fmt(std, like=mean)} (n={n})' if n > 1
                         else f'{fmt(mean)} (n=1)')
          else:
            cells.append('–')
        wall = walls.get(row)
        cells.append(fmt_time(sum(wall) / len(wall)) if wall else '–')
        out.append(f'| {row} | ' + ' | '.join(cells) + ' |')
      out.append('')
  return '\n'.join(out)


def _grid_rows(grid: dict) -> list[str]:
  """Every row name of the grid, in the order the studies first give them."""
  return list(dict.fromkeys(r for study in grid['studies'].values() for r in study['rows']))


def summaries_markdown(grid: dict, lines: list[dict]) -> str:
  """A table per summary: a line per study, a column per row; each cell the
  mean ± std over seeds and [the best seed's value]; a last line of the
  means over the studies (of the means, and of the best seeds)."""
  fmt = sweep_plots.fmt_value
  rows, out = _grid_rows(grid), []
  for name, summary in grid.get('summaries', {}).items():
    out.append(f'### {name}: {summary["label"]} ({summary["metric"]})\n')
    out.append('mean ± sample std over seeds [best seed]; the last line averages the lines '
               'above it (a row missing a study is left out).\n')
    out.append('| study | ' + ' | '.join(rows) + ' |')
    out.append('|---' * (len(rows) + 1) + '|')
    means = {r: [] for r in rows}
    bests = {r: [] for r in rows}
    for study in grid['studies']:
      values = _by_row(lines, study, summary['metric'])
      cells = []
      for row in rows:
        v = values.get(row)
        if not v:
          cells.append('–')
          continue
        mean, std, n = sweep_plots.summarise(v)
        means[row].append(mean), bests[row].append(max(v))
        cells.append((f'{fmt(mean)} ± {fmt(std, like=mean)}' if n > 1 else fmt(mean))
                     + f' [{fmt(max(v))}]')
      if any(c != '–' for c in cells):
        out.append(f'| {study} | ' + ' | '.join(cells) + ' |')
    complete = len(grid['studies'])
    out.append('| **mean** | ' + ' | '.join(
        f'**{fmt(sum(means[r]) / len(means[r]))}** [{fmt(sum(bests[r]) / len(bests[r]))}]'
        if len(means[r]) == complete else '–' for r in rows) + ' |')
    out.append('')
  return '\n'.join(out)


def curve_points(grid: dict, lines: list[dict], prefix: str, studies: list[str]) -> dict:
  """{row: (xs, ys)}: for each number x of a metric PREFIX<x>, the mean over
  `studies` of the mean over seeds; only x that every study of the row has."""
  by = {}
  for line in lines:
    if line['study'] in studies and line['metric'].startswith(prefix):
      x = line['metric'][len(prefix):]
      if x.isdigit():
        by.setdefault(line['row'], {}).setdefault(int(x), {}).setdefault(
            line['study'], []).append(line['value'])
  out = {}
  for row in _grid_rows(grid):
    points = sorted((x, sum(sum(v) / len(v) for v in per.values()) / len(per))
                    for x, per in by.get(row, {}).items() if len(per) == len(studies))
    if points:
      out[row] = ([x for x, _ in points], [y for _, y in points])
  return out


def plot(grid: dict, lines: list[dict], results: str) -> list[str]:
  """A figure per (study, table), STUDY_TABLE.png in `results`, and one per
  curves or scatters entry, NAME.png; returns the paths written."""
  paths = []
  for name, study in grid['studies'].items():
    for table, rows in study['tables'].items():
      panels = {label: _by_row(lines, name, metric) for metric, label in study['metrics'].items()}
      fig = sweep_plots.bar_figure(f'{name}: {table}', rows, panels)
      paths.append(sweep_plots.save(fig, os.path.join(results, f'{name}_{table}.png')))
  for name, curves in grid.get('curves', {}).items():
    panels = {f'{panel} ({len(studies)} studies)' if len(studies) > 1 else panel:
              curve_points(grid, lines, curves['metric'], studies)
              for panel, studies in curves['panels'].items()}
    seeds = sorted({l['seed'] for l in lines})
    fig = sweep_plots.curve_figure(
        f'{name}: {curves["label"]}, the mean over {sweep_plots.seeds_phrase([len(seeds)])} '
        "and each panel's studies", curves.get('xlabel', 'x'), curves['label'], panels)
    paths.append(sweep_plots.save(fig, os.path.join(results, f'{name}.png')))
  for name, scatter in grid.get('scatters', {}).items():
    panels = {study: {row: (_by_row(lines, study, scatter['x']).get(row, []),
                            _by_row(lines, study, scatter['y']).get(row, []))
                      for row in grid['studies'][study]['rows']}
              for study in scatter['studies']}
    fig = sweep_plots.scatter_figure(name, scatter.get('xlabel', scatter['x']),
                                     scatter.get('ylabel', scatter['y']), panels)
    paths.append(sweep_plots.save(fig, os.path.join(results, f'{name}.png')))
  return paths


def write_results(grid: dict, all_runs: list[Run], results: str, *, figures=True) -> list[dict]:
  os.makedirs(results, exist_ok=True)
  lines = collect(grid, all_runs)
  with open(os.path.join(results, 'results.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    writer.writeheader()
    writer.writerows(lines)
  with open(os.path.join(results, 'tables.md'), 'w') as f:
    f.write('\n'.join(t for t in (summaries_markdown(grid, lines), tables_markdown(grid, lines))
                      if t))
  if figures and lines:
    plot(grid, lines, results)
  return lines


def locations(grid: dict, grid_path: str, out: str | None = None,
              results: str | None = None) -> tuple[str, str]:
  """(the workdirs' root, the results' folder): the flags, else the grid's
  values, else workdirs/sweeps/GRID_NAME for both."""
  name = os.path.splitext(os.path.basename(grid_path))[0]
  out = out or grid.get('out') or os.path.join('workdirs', 'sweeps', name)
  return out, results or grid.get('results') or out


def _plot_only(grid: dict, results: str) -> int:
  """Redraws the figures from results/results.csv; runs nothing."""
  path = os.path.join(results, 'results.csv')
  if not os.path.exists(path):
    print(f'sweep: --plot_only needs {path}; run the sweep first or pass --results DIR',
          file=sys.stderr)
    return 2
  for figure in plot(grid, read_results(path), results):
    print(f'sweep: wrote {figure}')
  return 0


def _count(n: int, noun: str) -> str:
  plural = noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'
  return f'{n} {noun if n == 1 else plural}'


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('grid', help='a grid file: get_sweep() -> dict (see this module)')
  parser.add_argument('--out', help="workdirs' root (default: the grid's 'out', else "
                      'workdirs/sweeps/GRID_NAME)')
  parser.add_argument('--results', help="where results.csv, tables.md and the figures go "
                      "(default: the grid's 'results', else the workdirs' root)")
  parser.add_argument('--jobs', type=int, default=1, help='runs at a time (one per core or two)')
  parser.add_argument('--dry_run', action='store_true',
                      help='runs per study and status, and the time left; runs nothing')
  parser.add_argument('--table', action='store_true',
                      help="with --dry_run: every run's status, time left and command")
  parser.add_argument('--plot_only', action='store_true',
                      help="redraw the figures from the results' results.csv; runs nothing")
  parser.add_argument('--no_figures', action='store_true')
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    grid = load_grid(args.grid, check_configs=not args.plot_only)
  except SweepError as e:
    print(f'sweep: {e}', file=sys.stderr)
    return 2
  if args.jobs < 1:
    print(f'sweep: --jobs={args.jobs} must be >= 1', file=sys.stderr)
    return 2
  out, results = locations(grid, args.grid, args.out, args.results)
  if args.plot_only:
    return _plot_only(grid, results)
  all_runs = runs(grid, out)
  statuses = {r.name: status(r) for r in all_runs}
  todo = [r for r in all_runs if statuses[r.name] != 'done']
  walls, rates = recorded_walls(all_runs), step_rates(all_runs)
  print(f'sweep: {_count(len(all_runs), "run")} ({_count(len(grid["studies"]), "study")}, '
        f'{_count(len(grid["seeds"]), "seed")}): {len(all_runs) - len(todo)} done, '
        f'{len(todo)} to run {args.jobs} at a time\n  workdirs in {out}\n'
        f'  results (results.csv, tables.md, figures) in {results}', flush=True)
  if args.dry_run:
    report = dry_run_report if args.table else dry_run_summary
    print(report(all_runs, statuses, walls, rates, args.jobs))
    return 0
  for run in todo:
    if statuses[run.name] == 'changed':
      move_aside(run.workdir, log=lambda s: print(s, flush=True))
  failed = []
  try:
    failed = execute(todo, args.jobs, log=lambda s: print(s, flush=True), walls=walls,
                     rates=rates)
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
