"""The sweep driver: runs a grid once, resumes it, tabulates it; bad grids exit 2.

A fake run (a script writing metrics.jsonl from its flags) stands in for
training where the driver's own logic is under test; one test runs the real
command line on the reverse task.
"""
import csv
import glob
import json
import os
import statistics
import sys
import textwrap

import pytest

from flaxformer_lite import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REVERSE = os.path.join(REPO, 'experiments', 'reverse.py')

# Loss = d_model / 100 + seed / 10, BLEU = 10 * num_heads + seed; fails once
# where the file FAIL_ONCE names the workdir.
FAKE_RUN = '''
import json, os, sys
flags = dict(a[2:].split('=', 1) for a in sys.argv[1:])
workdir = flags['workdir']
os.makedirs(workdir, exist_ok=True)
with open(os.environ['CALLS'], 'a') as f:
  f.write(workdir + '\\n')
fail = os.environ.get('FAIL_ONCE')
if fail and os.path.exists(fail) and open(fail).read() == workdir:
  os.remove(fail)
  sys.exit(1)
seed, d, h = (int(flags['config.' + k]) for k in ('seed', 'model.d_model', 'model.num_heads'))
with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
  f.write(json.dumps({'step': 5, 'split': 'train', 'loss': 9.0}) + '\\n')
  f.write(json.dumps({'step': 5, 'split': 'eval', 'loss': d / 100 + seed / 10}) + '\\n')
  f.write(json.dumps({'step': 5, 'split': 'test', 'bleu': 10.0 * h + seed}) + '\\n')
'''


def _grid(tmp_path, rows, seeds=(0, 1, 2), extra=''):
  path = tmp_path / 'grid.py'
  path.write_text(textwrap.dedent(f'''
      def get_sweep():
        return {{
            'seeds': {list(seeds)!r},
            'out': {str(tmp_path / 'out')!r},
            'studies': {{'s': {{
                'experiment': {REVERSE!r},
                'overrides': {{'train.num_steps': 5}},
                'rows': {rows!r},
                'metrics': {{'eval.loss': 'loss', 'test.bleu': 'BLEU'}},
                'tables': {{'t': {list(rows)!r}}},
                {extra}
            }}}},
        }}
      '''))
  return str(path)


@pytest.fixture
def fake(tmp_path, monkeypatch):
  script = tmp_path / 'fake_run.py'
  script.write_text(FAKE_RUN)
  monkeypatch.setattr(sweep, 'ENTRY', (str(script),))
  calls = tmp_path / 'calls.txt'
  calls.write_text('')
  monkeypatch.setenv('CALLS', str(calls))
  return lambda: calls.read_text().split()


def _csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def test_grid_runs_each_cell_once_resumes_after_a_failure_and_tabulates(tmp_path, monkeypatch,
                                                                         fake):
  rows = {'small': {'model.d_model': 32, 'model.num_heads': 2},
          'large': {'model.d_model': 64, 'model.num_heads': 4}}
  grid = _grid(tmp_path, rows)
  failing = str(tmp_path / 'out' / 's' / 'large' / 'seed_1')
  (tmp_path / 'fail').write_text(failing)
  monkeypatch.setenv('FAIL_ONCE', str(tmp_path / 'fail'))

  assert sweep.main([grid, '--jobs=2']) == 1  # one run failed; the others are done
  assert sorted(fake()) == sorted(str(tmp_path / 'out' / 's' / r / f'seed_{s}')
                                  for r in rows for s in range(3))
  lines = _csv(tmp_path / 'out' / 'results.csv')
  assert {(l['row'], l['seed']) for l in lines} == {(r, str(s)) for r in rows for s in range(3)} - {
      ('large', '1')}

  assert sweep.main([grid, '--jobs=2']) == 0  # only the failed run again
  assert fake().count(failing) == 2 and len(fake()) == 7
  lines = _csv(tmp_path / 'out' / 'results.csv')
  for l in lines:
    d, h = rows[l['row']]['model.d_model'], rows[l['row']]['model.num_heads']
    expected = {'eval.loss': d / 100 + int(l['seed']) / 10, 'test.bleu': 10.0 * h + int(l['seed'])}
    assert float(l['value']) == pytest.approx(expected[l['metric']])
    assert l['overrides'] == f'model.d_model={d} model.num_heads={h}'
    assert float(l['wall_seconds']) > 0
  assert len(lines) == 2 * 3 * 2  # rows x seeds x metrics

  table = (tmp_path / 'out' / 'tables.md').read_text()
  for row, o in rows.items():
    losses = [o['model.d_model'] / 100 + s / 10 for s in range(3)]
    cell = f'{statistics.mean(losses):.3f} ± {statistics.stdev(losses):.3f} (n=3)'
    assert f'| {row} | {cell} |' in table
  assert os.path.getsize(tmp_path / 'out' / 's_t.png') > 1000

  bleu = [10.0 * 4 + s for s in range(3)]  # 'large': two decimals above 10
  assert f'{statistics.mean(bleu):.2f} ± {statistics.stdev(bleu):.2f} (n=3)' in table

  before = (tmp_path / 'out' / 'results.csv').read_text()
  monkeypatch.setattr(sys, 'executable', '/another/venv/bin/python')
  assert sweep.main([grid]) == 0  # nothing left: nothing runs, the same results
  assert len(fake()) == 7
  assert (tmp_path / 'out' / 'results.csv').read_text() == before


def test_a_changed_row_runs_again_and_a_new_seed_runs_alone(tmp_path, fake):
  grid = _grid(tmp_path, {'a': {'model.d_model': 32, 'model.num_heads': 2}}, seeds=(0,))
  assert sweep.main([grid, '--no_figures']) == 0
  grid = _grid(tmp_path, {'a': {'model.d_model': 48, 'model.num_heads': 2}}, seeds=(0, 1))
  assert sweep.main([grid, '--no_figures']) == 0
  assert fake() == [str(tmp_path / 'out' / 's' / 'a' / f'seed_{s}') for s in (0, 0, 1)]
  losses = {l['seed']: float(l['value']) for l in _csv(tmp_path / 'out' / 'results.csv')
            if l['metric'] == 'eval.loss'}
  assert losses == pytest.approx({'0': 0.48, '1': 0.58})


@pytest.mark.parametrize('rows, extra, named', [
    ({'a': {'model.d_modle': 32}}, '', ['model.d_modle', 'model.d_model']),
    ({'a': {'model.attention': 'shaww'}}, '', ['shaww', 'dot_product']),
    ({'a': {'model.d_model': 'wide'}}, '', ['model.d_model', 'wide']),
    ({'a': {}}, "'tables': {'t': ['a', 'b']},", ['b', 'rows: a']),
    ({'a': {}}, "'colour': 1,", ['colour', 'valid']),
])
def test_a_bad_grid_exits_2_naming_the_value_before_anything_runs(tmp_path, capsys, fake, rows,
                                                                   extra, named):
  path = tmp_path / 'grid.py'
  text = open(_grid(tmp_path, rows)).read()
  if extra:
    text = text.replace("'tables': {'t': ['a']},", extra)
  path.write_text(text)
  assert sweep.main([str(path)]) == 2
  err = capsys.readouterr().err
  for word in named:
    assert word in err
  assert fake() == []


def test_job_slots_split_the_cores(monkeypatch):
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1, 2, 3, 5}, raising=False)
  assert sweep._core_sets(2) == [{0, 1}, {2, 3}]
  assert sweep._core_sets(6) == [None] * 6


def test_the_real_command_line_on_the_reverse_task(tmp_path, tfds_dir):
  grid = tmp_path / 'grid.py'
  grid.write_text(textwrap.dedent(f'''
      def get_sweep():
        return {{'seeds': [3], 'studies': {{'reverse': {{
            'experiment': {REVERSE!r},
            'overrides': {{'data.data_dir': {tfds_dir!r}, 'train.num_steps': 2,
                           'model.d_model': 16, 'model.num_heads': 2, 'model.mlp_dim': 32,
                           'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1,
                           'data.max_len': 5, 'data.num_train': 64, 'data.num_eval': 10,
                           'train.batch_size': 8, 'eval.batch_size': 10}},
            'rows': {{'shaw_k2': {{'model.attention': 'shaw', 'model.positions': 'none',
                                   'model.attention_kwargs.max_distance': 2}}}},
            'metrics': {{'eval.loss': 'loss'}}}}}}}}
      '''))
  assert sweep.main([str(grid), f'--out={tmp_path / "out"}', '--no_figures']) == 0
  workdir = tmp_path / 'out' / 'reverse' / 'shaw_k2' / 'seed_3'
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['seed'] == 3 and saved['model']['attention_kwargs']['max_distance'] == 2
  records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  final_eval = [r for r in records if r['split'] == 'eval'][-1]
  line = [l for l in _csv(tmp_path / 'out' / 'results.csv') if l['metric'] == 'eval.loss']
  assert len(line) == 1 and float(line[0]['value']) == pytest.approx(final_eval['loss'])


def test_every_shipped_grid_is_valid(monkeypatch, shared_data):
  paths = sorted(glob.glob(os.path.join(REPO, 'experiments', 'sweeps', '*.py')))
  assert paths
  monkeypatch.setenv('FFL_SHARED_DATA', shared_data)  # the corpora's paths are checked
  monkeypatch.chdir(REPO)  # grids name experiments from the repository root
  for path in paths:
    grid = sweep.load_grid(path)
    assert sweep.runs(grid, '/nonexistent')
    assert './launch.sh sweep' in open(path).read()


def test_time_left_costs_each_run_its_studys_mean_wall_time():
  todo = [sweep.Run(s, 'r', 0, '', []) for s in ('a', 'a', 'b')]  # 'b' has none finished
  walls = {'a': [60.0, 120.0], 'c': [300.0]}  # a: 90 s each; all: 160 s
  assert sweep.time_left(todo, walls, jobs=2) == f'~{(90 + 90 + 160) // 2 // 60}m50s left'
  assert sweep.time_left(todo, {}, jobs=2) == 'time left unknown'
