"""benchmarks/record.py: a run's metrics become a record's values, which the
READMEs read (tests/test_readme.py checks the READMEs against the records)."""
import datetime
import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(REPO, 'benchmarks', 'record.py')


def _results(tmp_path, command):
  record = {'table': 'learns', 'question': 'q', 'command': command,
            'result': 'loss {eval_loss:.3f}, accuracy {test_sequence_accuracy:.3f}, {ratio}x',
            'machine': 'an old machine', 'wall': '1m00s', 'date': '2000-01-01',
            'values': {'eval_loss': 9.0, 'test_sequence_accuracy': 0.0, 'ratio': 0.5}}
  (tmp_path / 'measurements.json').write_text(json.dumps({'run': record}))
  return tmp_path / 'measurements.json'


def _metrics(workdir):
  os.makedirs(workdir, exist_ok=True)
  points = [{'step': 10, 'split': 'eval', 'loss': 2.5},
            {'step': 20, 'split': 'eval', 'loss': 1.25},  # the last point counts
            {'step': 20, 'split': 'test', 'loss': 1.3, 'sequence_accuracy': 0.75}]
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.writelines(json.dumps(p) + '\n' for p in points)


def _record(*args):
  return subprocess.run([sys.executable, RECORD, *args], capture_output=True, text=True,
                        cwd=REPO, timeout=120)


def test_a_finished_runs_metrics_replace_the_values_it_logged(tmp_path):
  path = _results(tmp_path, 'unused')
  _metrics(tmp_path / 'run')
  done = _record('run', '--workdir', str(tmp_path / 'run'), '--results', str(tmp_path))
  assert done.returncode == 0, done.stderr
  record = json.loads(path.read_text())['run']
  assert record['values'] == {'eval_loss': 1.25, 'test_sequence_accuracy': 0.75, 'ratio': 0.5}
  assert record['wall'] == '1m00s'  # read, not run: the recorded time stays
  assert record['date'] == datetime.date.today().isoformat()
  assert record['machine'] == f'{len(os.sched_getaffinity(0))}-core CPU'
  assert 'kept as they were: ratio' in done.stdout


def test_the_records_command_runs_timed_with_its_own_workdir(tmp_path):
  fake = tmp_path / 'fake_run.py'
  fake.write_text(textwrap.dedent(f'''
      import json, os, sys, time
      workdir = sys.argv[-1].split('=', 1)[1]
      os.makedirs(workdir)
      time.sleep(1.2)
      with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
        f.write(json.dumps({{'step': 3, 'split': 'eval', 'loss': 0.5}}) + '\\n')
  '''))
  path = _results(tmp_path, f'{sys.executable} {fake}')
  done = _record('run', '--results', str(tmp_path), '--out', str(tmp_path / 'out'),
                 '--machine', 'one test machine')
  assert done.returncode == 0, done.stderr
  record = json.loads(path.read_text())['run']
  assert record['values']['eval_loss'] == 0.5
  assert record['machine'] == 'one test machine'
  assert record['wall'] in ('1 s', '2 s')
  assert (tmp_path / 'out' / 'run' / 'metrics.jsonl').exists()


def test_an_unknown_record_or_a_failed_command_changes_nothing(tmp_path):
  path = _results(tmp_path, f'{sys.executable} -c "raise SystemExit(3)"')
  before = path.read_text()
  done = _record('nope', '--results', str(tmp_path))
  assert done.returncode == 2 and "no record 'nope'" in done.stderr and 'records: run' in done.stderr
  done = _record('run', '--results', str(tmp_path), '--out', str(tmp_path / 'out'))
  assert done.returncode == 3 and 'unchanged' in done.stderr
  assert path.read_text() == before
