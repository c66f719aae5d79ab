"""Re-measure a row of benchmarks/results/measurements.json from a run.

  ./launch.sh run benchmarks/record.py default_experiment           # runs the record's command
  ./launch.sh run benchmarks/record.py default_experiment --workdir W   # reads a finished run

Without --workdir it runs the record's command with `--workdir=workdirs/record/KEY`
appended, timing it; with one it reads that run and keeps the recorded wall
time. A value named SPLIT_METRIC (`test_sequence_accuracy`, `eval_loss`) is
the last SPLIT point's METRIC in the run's metrics.jsonl; the record's other
values (a benchmark's ratios, a memory peak) are listed as not read from the
run and stay as they were. The date becomes today's, the machine this one's
(or --machine). Then benchmarks/readme_tables.py rewrites the documents' tables.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, 'benchmarks', 'results')
SPLITS = ('train', 'eval', 'test')


def last_metrics(workdir: str) -> dict[str, float]:
  """A run's metrics.jsonl -> {'eval_loss': the last eval point's loss, ...}."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} does not exist: is {workdir!r} a finished run\'s workdir?')
  out = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        point = json.loads(line)
        out.update({f'{point["split"]}_{k}': v for k, v in point.items()
                    if k not in ('step', 'split')})
  return out


def update(record: dict, metrics: dict[str, float]) -> list[str]:
  """Sets each of the record's values that the run logged; returns the names
  of those it did not (left as they were)."""
  kept = []
  for name in record['values']:
    if name in metrics:
      record['values'][name] = metrics[name]
    else:
      kept.append(name)
  return kept


def fmt_wall(seconds: float) -> str:
  seconds = int(round(seconds))
  return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds} s'


def this_machine() -> str:
  return f'{len(os.sched_getaffinity(0))}-core CPU'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('key', help='a record of measurements.json')
  parser.add_argument('--workdir', help="a finished run's workdir to read instead of running")
  parser.add_argument('--machine', help='what the run ran on (default: this CPU)')
  parser.add_argument('--results', default=RESULTS, help='the folder of measurements.json')
  parser.add_argument('--out', default=os.path.join(REPO, 'workdirs', 'record'),
                      help='where a run started here writes its workdir (OUT/KEY)')
  args = parser.parse_args(argv)
  path = os.path.join(args.results, 'measurements.json')
  with open(path) as f:
    measurements = json.load(f)
  if args.key not in measurements:
    print(f'record.py: no record {args.key!r} in {path}; records: {", ".join(measurements)}',
          file=sys.stderr)
    return 2
  record = measurements[args.key]
  workdir = args.workdir
  if workdir is None:
    workdir = os.path.join(args.out, args.key)
    command = record['command'] + ' ' + shlex.quote(f'--workdir={workdir}')
    print(f'record.py: {command}', flush=True)
    start = time.monotonic()
    rc = subprocess.call(command, shell=True, cwd=REPO)
    if rc != 0:
      print(f'record.py: the command exited {rc}; {path} is unchanged', file=sys.stderr)
      return rc
    record['wall'] = fmt_wall(time.monotonic() - start)
  kept = update(record, last_metrics(workdir))
  record['date'] = datetime.date.today().isoformat()
  record['machine'] = args.machine or this_machine()
  with open(path, 'w') as f:
    json.dump(measurements, f, indent=1, ensure_ascii=False)
    f.write('\n')
  print(f'record.py: {args.key}: {json.dumps(record["values"])}')
  if kept:
    print(f'record.py: not in the run\'s metrics, kept as they were: {", ".join(kept)}')
  if os.path.abspath(args.results) == RESULTS:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import readme_tables
    readme_tables.main([])
    print('record.py: the tables of README.md, benchmarks/RESULTS.md, benchmarks/KERNELS.md and '
          'tests/README.md rewritten (git diff shows what moved)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
