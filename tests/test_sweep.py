"""The sweep driver: runs a grid once, resumes it, tabulates it, draws it;
bad grids exit 2; a dry run lists statuses, time left and commands to paste.

A fake run (a script writing metrics.jsonl from its flags) stands in for
training where the driver's own logic is under test; one test runs the real
command line on the reverse task (twice: the second time with a changed row).
Figures are checked for what a reader needs at 100%: bars from 0, text of 9 pt
or more, legends off the data.
"""
import csv
import glob
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap

import matplotlib.text
import ml_collections
import pytest
from PIL import Image

from flaxformer_lite import sweep, sweep_plots

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REVERSE = os.path.join(REPO, 'experiments', 'reverse.py')
ALGORITHMIC = os.path.join(REPO, 'experiments', 'algorithmic.py')

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


def _grid(tmp_path, rows, seeds=(0, 1, 2), extra='', out=True):
  path = tmp_path / 'grid.py'
  out = f"'out': {str(tmp_path / 'out')!r}," if out else ''
  path.write_text(textwrap.dedent(f'''
      def get_sweep():
        return {{
            'seeds': {list(seeds)!r},
            {out}
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


def test_a_changed_row_runs_again_a_new_seed_runs_alone_a_renamed_row_leaves_the_csv(tmp_path,
                                                                                      fake):
  grid = _grid(tmp_path, {'a': {'model.d_model': 32, 'model.num_heads': 2}}, seeds=(0,))
  assert sweep.main([grid, '--no_figures']) == 0
  grid = _grid(tmp_path, {'a': {'model.d_model': 48, 'model.num_heads': 2}}, seeds=(0, 1))
  assert sweep.main([grid, '--no_figures']) == 0
  assert fake() == [str(tmp_path / 'out' / 's' / 'a' / f'seed_{s}') for s in (0, 0, 1)]
  losses = {l['seed']: float(l['value']) for l in _csv(tmp_path / 'out' / 'results.csv')
            if l['metric'] == 'eval.loss'}
  assert losses == pytest.approx({'0': 0.48, '1': 0.58})

  grid = _grid(tmp_path, {'b': {'model.d_model': 48, 'model.num_heads': 2}}, seeds=(0, 1))
  assert sweep.main([grid, '--no_figures']) == 0
  assert {l['row'] for l in _csv(tmp_path / 'out' / 'results.csv')} == {'b'}
  assert (tmp_path / 'out' / 's' / 'a' / 'seed_0' / 'metrics.jsonl').exists()  # kept on disk


def _pasted(text: str, number: int) -> list[str]:
  """Run `number`'s command in a dry run's output as bash splits it when pasted."""
  lines = text.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith(f'# {number}: ')) + 1
  end = next((i for i in range(start, len(lines)) if lines[i].startswith('#')), len(lines))
  command = '\n'.join(lines[start:end])
  words = subprocess.run(['bash', '-c', f'set -- {command}\nprintf "%s\\0" "$@"'],
                         capture_output=True, text=True, check=True).stdout
  return words.split('\0')[:-1]


def _table(text: str) -> dict:
  """A dry run's table: {run number: its other cells}."""
  cells = [re.split(r'\s{2,}', line.strip()) for line in text.splitlines()]
  return {int(c[0]): c[1:] for c in cells if c[0].isdigit()}


def test_a_dry_run_tabulates_status_and_time_left_and_prints_commands_to_paste(
    tmp_path, monkeypatch, capsys, fake):
  monkeypatch.chdir(REPO)  # where a user types ./launch.sh
  rows = {'small': {'model.d_model': 32, 'model.num_heads': 2},
          'large': {'model.d_model': 64, 'model.num_heads': 4}}
  assert sweep.main([_grid(tmp_path, rows, seeds=(0,)), '--no_figures']) == 0
  out = tmp_path / 'out' / 's'
  for row, wall in (('small', 100.0), ('large', 300.0)):  # the median: 200 s a run
    done = out / row / 'seed_0' / sweep.DONE
    done.write_text(json.dumps(dict(json.loads(done.read_text()), wall_seconds=wall)))
  (out / 'small' / 'seed_1').mkdir()  # interrupted after 2 of its 5 steps
  (out / 'small' / 'seed_1' / 'metrics.jsonl').write_text(
      json.dumps({'step': 2, 'split': 'train', 'loss': 1.0}) + '\n')
  capsys.readouterr()

  assert sweep.main([_grid(tmp_path, rows, seeds=(0, 1)), '--dry_run', '--jobs=2']) == 0
  summary = capsys.readouterr().out
  assert '  s: 4 runs: 2 done, 1 partial, 1 to run' in summary
  assert 'time left: ~2m40s at 2 at a time' in summary  # (120 + 200) s over 2 jobs
  assert '--dry_run --table' in summary and 'commands' not in summary
  assert sweep.main([_grid(tmp_path, rows, seeds=(0, 1)), '--dry_run', '--table',
                     '--jobs=2']) == 0
  text = capsys.readouterr().out
  assert len(fake()) == 2  # nothing more ran
  assert _table(text) == {1: ['s', 'small', '0', 'done', '-', '-'],
                          2: ['s', 'small', '1', 'partial', '3 of 5', '~2m00s'],  # 200 s x 3/5
                          3: ['s', 'large', '0', 'done', '-', '-'],
                          4: ['s', 'large', '1', 'to run', '5', '~3m20s']}
  assert 'time left: ~2m40s at 2 at a time' in text  # (120 + 200) s over 2 jobs
  assert 'median wall time of its 2 finished runs (3m20s)' in text
  header = next(l for l in text.splitlines() if l.split()[:2] == ['#', 'study'])
  table = [l for l in text.splitlines() if l.strip()[:1].isdigit()]
  col = header.index('status')
  assert [l[col:col + 7] for l in table] == ['done   ', 'partial', 'done   ', 'to run ']
  assert max(map(len, table)) <= 80
  assert _pasted(text, 4) == ['./launch.sh', 'experiments/reverse.py',
                              f'--workdir={out}/large/seed_1', '--config.seed=1',
                              '--config.train.num_steps=5', '--config.model.d_model=64',
                              '--config.model.num_heads=4']
  assert text.index('# 4: ') > text.index('time left:')  # the commands under the table
  assert '-m flaxformer_lite.main' not in text


def test_a_command_quotes_values_for_the_shell(tmp_path):
  run = sweep.Run('s', 'r', 0, str(tmp_path / 'my runs' / 'seed_0'), REVERSE,
                  {'seed': 0, 'data.data_dir': "/data/it's here", 'eval.contexts': [8, 16]})
  assert _pasted('# 1: s/r\n' + run.command(width=40), 1)[1:] == [
      'experiments/reverse.py', f'--workdir={tmp_path}/my runs/seed_0', '--config.seed=0',
      "--config.data.data_dir=/data/it's here", '--config.eval.contexts=[8, 16]']


def test_results_go_under_workdirs_unless_results_names_a_folder(tmp_path, monkeypatch, fake):
  monkeypatch.chdir(tmp_path)
  grid = _grid(tmp_path, {'a': {'model.d_model': 32, 'model.num_heads': 2}}, seeds=(0,),
               out=False)
  assert sweep.main([grid, '--no_figures']) == 0
  assert fake() == [os.path.join('workdirs', 'sweeps', 'grid', 's', 'a', 'seed_0')]
  home = tmp_path / 'workdirs' / 'sweeps' / 'grid'
  assert [l['metric'] for l in _csv(home / 'results.csv')] == ['eval.loss', 'test.bleu']
  assert sweep.main([grid, '--results=mine', '--no_figures']) == 0
  assert _csv(tmp_path / 'mine' / 'results.csv') == _csv(home / 'results.csv')
  assert len(fake()) == 1


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



def test_the_real_command_line_on_an_algorithmic_task_and_a_changed_row(tmp_path, tfds_dir,
                                                                        capsys):
  """The suite's path (experiments/algorithmic.py, a task tested at two
  lengths, a summary and a curves figure) on a tiny budget; then a row edited."""
  grid = tmp_path / 'grid.py'

  def write(row):
    grid.write_text(textwrap.dedent(f'''
        def get_sweep():
          return {{'seeds': [3], 'studies': {{'reverse': {{
              'experiment': {ALGORITHMIC!r},
              'overrides': {{'data.data_dir': {tfds_dir!r}, 'train.num_steps': 2,
                             'model.d_model': 16, 'model.num_heads': 2, 'model.mlp_dim': 32,
                             'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1,
                             'data.task': 'reverse_string', 'data.test_lengths': (8, 10),
                             'data.max_len': 5, 'data.num_train': 64, 'data.num_eval': 10,
                             'train.batch_size': 8, 'eval.batch_size': 10}},
              'rows': {{'relative': {row!r}}},
              'metrics': {{'eval.loss': 'loss'}}}}}},
              'summaries': {{'s': {{'metric': 'test.long_mean_length_accuracy', 'label': 'a'}}}},
              'curves': {{'c': {{'metric': 'test.long_accuracy_len', 'label': 'a',
                                 'panels': {{'p': ['reverse']}}}}}}}}
        '''))

  def dry_run_status():
    capsys.readouterr()
    assert sweep.main(args + ['--dry_run', '--table']) == 0
    return _table(capsys.readouterr().out)[1][3]

  def final_eval_loss(workdir):
    records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return [r for r in records if r['split'] == 'eval'][-1]['loss']

  write({'model.attention': 'shaw', 'model.positions': 'none',
         'model.attention_kwargs.max_distance': 2})
  args = [str(grid), f'--out={tmp_path / "out"}']
  assert sweep.main(args) == 0
  workdir = tmp_path / 'out' / 'reverse' / 'relative' / 'seed_3'
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['seed'] == 3 and saved['model']['attention_kwargs']['max_distance'] == 2
  line = [l for l in _csv(tmp_path / 'out' / 'results.csv') if l['metric'] == 'eval.loss']
  assert len(line) == 1 and float(line[0]['value']) == pytest.approx(final_eval_loss(workdir))
  test = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()
          if json.loads(l)['split'] == 'test'][-1]
  per_length = {l['metric']: float(l['value']) for l in _csv(tmp_path / 'out' / 'results.csv')
                if '_len' in l['metric']}
  for n in (8, 10):
    for key in (f'long_sequence_accuracy_len{n}', f'long_accuracy_len{n}'):
      assert per_length[f'test.{key}'] == pytest.approx(test[key])
  assert test['long_mean_length_accuracy'] == pytest.approx(
      (test['long_accuracy_len8'] + test['long_accuracy_len10']) / 2)
  assert '| reverse | ' in (tmp_path / 'out' / 'tables.md').read_text()
  assert (tmp_path / 'out' / 'c.png').exists()
  first_metrics = (workdir / 'metrics.jsonl').read_text()
  # The saved config (its vocabulary size taken from the data) is the row's.
  assert dry_run_status() == 'done'

  write({'model.attention': 'alibi', 'model.positions': 'none'})
  assert dry_run_status() == 'changed'
  assert json.loads((workdir / 'config.json').read_text())['model']['attention'] == 'shaw'
  assert sweep.main(args) == 0  # not main's refusal of a workdir of another config
  assert f'moved {workdir} to {workdir}.old-1' in capsys.readouterr().out
  old = workdir.parent / 'seed_3.old-1'
  assert json.loads((old / 'config.json').read_text())['model']['attention'] == 'shaw'
  assert (old / 'metrics.jsonl').read_text() == first_metrics
  assert json.loads((workdir / 'config.json').read_text())['model']['attention'] == 'alibi'
  line = [l for l in _csv(tmp_path / 'out' / 'results.csv') if l['metric'] == 'eval.loss']
  assert len(line) == 1 and line[0]['overrides'] == 'model.attention=alibi model.positions=none'
  assert float(line[0]['value']) == pytest.approx(final_eval_loss(workdir))
  assert dry_run_status() == 'done'


def test_every_shipped_grid_is_valid_and_writes_its_results_under_workdirs(monkeypatch,
                                                                          shared_data):
  paths = sorted(glob.glob(os.path.join(REPO, 'experiments', 'sweeps', '*.py')))
  assert paths
  monkeypatch.setenv('FFL_SHARED_DATA', shared_data)  # the corpora's paths are checked
  monkeypatch.chdir(REPO)  # grids name experiments from the repository root
  for path in paths:
    grid = sweep.load_grid(path)
    assert sweep.runs(grid, '/nonexistent')
    assert './launch.sh sweep' in open(path).read()
    _, results = sweep.locations(grid, path)
    assert results.startswith('workdirs' + os.sep), path  # not the committed benchmarks/results


def test_time_left_costs_each_run_its_studys_median_wall_time_else_its_logged_step_rate(
    tmp_path):
  config = ml_collections.ConfigDict({'train': {'num_steps': 100}})
  todo = [sweep.Run(s, 'r', 0, str(tmp_path / f'{s}{i}'), config=config)
          for i, s in enumerate('aab')]  # 'b' has no finished run
  walls = {'a': [60.0, 120.0, 300.0], 'c': [1000.0]}  # a: 120 s a run
  assert sweep.time_left(todo, walls, jobs=2) == '~2m00s left (+1 run of unknown length)'
  rates = {'b': [2.0, 4.0, 5.0]}  # 100 steps at 4 steps/s: 25 s
  assert sweep.time_left(todo, walls, 2, rates) == '~2m12s left'  # (120 + 120 + 25) / 2 s
  os.makedirs(todo[0].workdir)
  with open(os.path.join(todo[0].workdir, 'metrics.jsonl'), 'w') as f:
    f.write(json.dumps({'step': 40, 'split': 'train', 'loss': 1.0}) + '\n')
  assert sweep.seconds_left(todo[0], walls, rates) == pytest.approx(120 * 0.6)
  assert sweep.seconds_left(todo[0], walls, rates, from_scratch=True) == pytest.approx(120)
  assert sweep.seconds_left(todo[2], walls, {}) is None
  assert sweep.time_left(todo, {}, jobs=2) == 'time left unknown'


def _small_text(fig) -> list[str]:
  """The figure's visible texts below 9 pt."""
  return [t.get_text() for t in fig.findobj(matplotlib.text.Text)
          if t.get_visible() and t.get_text() and t.get_fontsize() < 9]


def _on_the_data(fig, legend) -> list:
  """The axes that `legend`'s box overlaps, once drawn."""
  fig.canvas.draw()
  box = legend.get_window_extent()
  return [ax for ax in fig.axes if box.overlaps(ax.get_window_extent())]


def _texts(fig) -> list[str]:
  return [t.get_text() for t in fig.findobj(matplotlib.text.Text)]


def test_a_bar_figure_starts_at_0_says_one_seed_and_reads_at_100_percent():
  one = sweep_plots.bar_figure('s: t', ['a', 'b'], {'acc': {'a': [1.0], 'b': [0.997]}})
  ax, = one.axes
  assert [(p.get_x(), p.get_width()) for p in ax.patches] == [(0, 1.0), (0, 0.997)]
  assert ax.get_xlim()[0] <= 0
  assert {'1.000', '0.997'} <= set(_texts(one))  # the values a bar from 0 cannot show
  assert 'one seed' in one.get_suptitle() and '±' not in one.get_suptitle()
  assert not one.legends and not _small_text(one)

  three = sweep_plots.bar_figure('s: t', ['a', 'b'], {
      'loss': {'a': [3.9, 4.0, 4.1], 'b': [4.0]}, 'BLEU': {'a': [20.0, 21.0, 22.0]}})
  assert 'mean ± sample std over 1-3 seeds' in three.get_suptitle()
  assert all(ax.get_xlim()[0] <= 0 for ax in three.axes)
  assert {'4.000', '21.00'} <= set(_texts(three))
  legend, = three.legends
  assert _on_the_data(three, legend) == [] and not _small_text(three)

  zeros = sweep_plots.bar_figure('s: t', ['a'], {'acc': {'a': [0.0, 0.0]}})
  lo, hi = zeros.axes[0].get_xlim()
  assert lo == 0 < hi  # an axis, not a singular one


def _write_csv(path, values: dict):
  """results.csv from {(row, seed, metric): value}."""
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(sweep.CSV_FIELDS)
    for (row, seed, metric), value in values.items():
      writer.writerow(['s', row, 'model.d_model=32', seed, metric, value, 60.0])


def test_plot_only_draws_the_figures_from_results_csv_and_runs_nothing(tmp_path, fake):
  grid = _grid(tmp_path, {'a': {'model.d_model': 32}, 'b': {'model.d_model': 48}})
  results = tmp_path / 'committed'
  results.mkdir()
  _write_csv(results / 'results.csv', {('a', 0, 'eval.loss'): 1.0, ('b', 0, 'eval.loss'): 0.997,
                                       ('a', 0, 'test.bleu'): 20.0, ('b', 0, 'test.bleu'): 21.5})
  before = (results / 'results.csv').read_text()
  assert sweep.main([grid, '--plot_only', f'--results={results}']) == 0
  assert fake() == [] and not (tmp_path / 'out').exists()
  assert sorted(os.listdir(results)) == ['results.csv', 's_t.png']
  assert (results / 'results.csv').read_text() == before
  image = Image.open(results / 's_t.png')
  assert image.info['dpi'][0] >= 100 and 600 <= image.size[0] <= 1600, image.size
  assert sweep.main([grid, '--plot_only', f'--results={tmp_path / "none"}']) == 2


def test_the_train_short_test_long_figure_tells_its_curves_apart_off_the_data():
  spec = importlib.util.spec_from_file_location(
      'train_short_test_long', os.path.join(REPO, 'benchmarks', 'train_short_test_long.py'))
  benchmark = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(benchmark)
  contexts = [256, 512, 1024]
  losses = {'sinusoidal': [1.75, 2.6, 3.0], 'learned': [1.98, None, None],
            'alibi': [1.65, 1.64, 1.64], 'shaw_k64': [1.59, 1.58, 1.58]}
  records = [dict(scheme=s, seed=seed, steps=10, train_context=256, context=n,
                  loss=None if v is None else v + seed / 100)
             for s, vs in losses.items() for n, v in zip(contexts, vs) for seed in (0, 1)]
  fig = benchmark._plot(records, list(losses), contexts)
  full, zoom = fig.axes
  assert full.get_ylim()[0] == 0
  assert zoom.get_ylim() == pytest.approx((1.585 * 0.995, 1.585 * 1.1))  # the best mean + 10%
  markers = [line.get_marker() for line in full.get_lines()]
  assert len(set(markers)) == len(markers) == 4
  legend, = fig.legends
  assert 'learned (n/a from 512)' in [t.get_text() for t in legend.get_texts()]
  assert _on_the_data(fig, legend) == [] and not _small_text(fig)
  assert 'mean of 2 seeds' in fig.get_suptitle()


def _two_study_grid():
  study = {'experiment': REVERSE, 'rows': {'a': {}, 'b': {}}, 'metrics': {'test.acc': 'acc'},
           'tables': {'t': ['a', 'b']}}
  return {'seeds': [0, 1], 'studies': {'x': study, 'y': dict(study)},
          'summaries': {'acc': {'metric': 'test.acc', 'label': 'accuracy'}},
          'curves': {'by_len': {'metric': 'test.acc_len', 'label': 'accuracy',
                                'xlabel': 'length', 'panels': {'both': ['x', 'y'],
                                                               'x alone': ['x']}}}}


def _lines(values: dict) -> list[dict]:
  return [dict(study=s, row=r, seed=seed, metric=m, value=v, wall_seconds=1.0)
          for (s, r, seed, m), v in values.items()]


def test_a_summary_has_a_line_per_study_a_column_per_row_and_the_best_seed():
  lines = _lines({('x', 'a', 0, 'test.acc'): 0.4, ('x', 'a', 1, 'test.acc'): 0.6,
                  ('x', 'b', 0, 'test.acc'): 0.9, ('x', 'b', 1, 'test.acc'): 0.7,
                  ('y', 'a', 0, 'test.acc'): 0.2, ('y', 'a', 1, 'test.acc'): 0.2,
                  ('y', 'b', 0, 'test.acc'): 1.0})
  text = sweep.summaries_markdown(_two_study_grid(), lines)
  table = [line for line in text.splitlines() if line.startswith('| ')]
  assert table[0] == '| study | a | b |'
  # a on x: mean 0.5, sample std sqrt(0.02) = 0.141, best 0.6
  assert table[1] == '| x | 0.500 ± 0.141 [0.600] | 0.800 ± 0.141 [0.900] |'
  assert table[2] == '| y | 0.200 ± 0.000 [0.200] | 1.000 [1.000] |'
  assert table[3] == '| **mean** | **0.350** [0.400] | **0.900** [0.950] |'
  del lines[-1]  # b has no y: no mean over the studies for it
  assert sweep.summaries_markdown(_two_study_grid(), lines).splitlines()[-1].endswith(
      '[0.400] | – |')


def test_curves_average_seeds_then_studies_per_panel_and_draw_a_figure(tmp_path):
  values = {}
  for s, offset in (('x', 0.0), ('y', 0.2)):
    for seed in (0, 1):
      for n in (50, 100):
        values[s, 'a', seed, f'test.acc_len{n}'] = offset + n / 1000 + seed / 100
      values[s, 'a', seed, 'test.acc_lenient'] = 5.0  # not a number after the prefix
  values['x', 'b', 0, 'test.acc_len50'] = 0.3  # b: on x only
  grid, lines = _two_study_grid(), _lines(values)
  both = sweep.curve_points(grid, lines, 'test.acc_len', ['x', 'y'])
  assert list(both) == ['a']
  assert both['a'][0] == [50, 100]
  assert both['a'][1] == pytest.approx([(0.055 + 0.255) / 2, (0.105 + 0.305) / 2])
  assert sweep.curve_points(grid, lines, 'test.acc_len', ['x'])['b'] == ([50], [0.3])
  paths = sweep.plot(grid, lines, str(tmp_path))
  assert os.path.join(str(tmp_path), 'by_len.png') in paths
  fig = sweep_plots.curve_figure('t', 'length', 'accuracy', {
      'both': both, 'x alone': sweep.curve_points(grid, lines, 'test.acc_len', ['x'])})
  legend, = fig.legends
  assert [t.get_text() for t in legend.get_texts()] == ['a', 'b']
  assert _on_the_data(fig, legend) == [] and not _small_text(fig)
  assert all(ax.get_ylim() == (0, 1.02) for ax in fig.axes)
  empty = sweep_plots.curve_figure('t', 'length', 'accuracy', {'p': {}})  # a half-done grid
  assert not empty.legends and 'no results yet' in _texts(empty)


def test_curves_naming_a_study_the_grid_lacks_is_a_grid_error(tmp_path):
  path = tmp_path / 'grid.py'
  grid = _two_study_grid()
  grid['curves']['by_len']['panels'] = {'p': ['x', 'z']}
  path.write_text(f'def get_sweep():\n  return {grid!r}\n')
  with pytest.raises(sweep.SweepError, match=r"panels.p names studies \['z'\]"):
    sweep.load_grid(str(path), check_configs=False)


def test_a_scatter_puts_each_row_at_its_seed_means_and_names_it_in_the_legend(tmp_path):
  values = {('x', 'a', 0, 'train.flops'): 2e9, ('x', 'a', 1, 'train.flops'): 2e9,
            ('x', 'a', 0, 'test.acc'): 0.4, ('x', 'a', 1, 'test.acc'): 0.8,
            ('x', 'b', 0, 'train.flops'): 3e9, ('x', 'b', 0, 'test.acc'): 1.0}
  grid = dict(_two_study_grid(), scatters={'cost': {'x': 'train.flops', 'y': 'test.acc',
                                                    'studies': ['x']}})
  paths = sweep.plot(grid, _lines(values), str(tmp_path))
  assert os.path.join(str(tmp_path), 'cost.png') in paths
  panels = {'x': {'a': ([2e9, 2e9], [0.4, 0.8]), 'b': ([3e9], [1.0]), 'c': ([], [])}}
  fig = sweep_plots.scatter_figure('cost', 'FLOPs', 'accuracy', panels)
  legend, = fig.legends
  assert [t.get_text() for t in legend.get_texts()] == ['a', 'b']  # c: no values
  means = {line.get_label(): line.get_xydata().tolist() for line in fig.axes[0].lines
           if not line.get_label().startswith('_')}
  assert means == {'a': [[2e9, pytest.approx(0.6)]], 'b': [[3e9, 1.0]]}
  assert _on_the_data(fig, legend) == [] and not _small_text(fig)
  grid['scatters']['cost']['studies'] = ['z']
  path = tmp_path / 'grid.py'
  path.write_text(f'def get_sweep():\n  return {grid!r}\n')
  with pytest.raises(sweep.SweepError, match=r"scatters.cost.studies names \['z'\]"):
    sweep.load_grid(str(path), check_configs=False)


def test_large_counts_print_in_si_units_beside_their_std():
  assert sweep_plots.fmt_value(3052988928.0) == '3.053G'
  assert sweep_plots.fmt_value(0.0, like=3052988928.0) == '0.000G'
  assert sweep_plots.fmt_value(441542656.0) == '441.54M'
  assert sweep_plots.fmt_value(0.372) == '0.372' and sweep_plots.fmt_value(33.51) == '33.51'


def test_counts_a_run_takes_from_its_data_do_not_make_its_row_changed(tmp_path):
  """model.vocab_size and model.num_classes of 0 become the dataset's in the
  saved config.json: the row is still the run's. Set by the row, they count."""
  import runpy
  from flaxformer_lite import config as config_lib
  config = runpy.run_path(os.path.join(REPO, 'experiments', 'two_stream.py'))['get_config']()
  saved = config_lib.from_json(config_lib.to_json(config))
  saved.model.vocab_size, saved.model.num_classes = 267, 5
  (tmp_path / 'config.json').write_text(config_lib.to_json(saved))
  run = sweep.Run('s', 'r', 0, str(tmp_path), 'experiments/two_stream.py', {}, config)
  assert sweep.config_changes(run) == [] and sweep.status(run) != 'changed'
  config.model.num_classes = 7
  assert sweep.config_changes(run) == ['model.num_classes: 5 -> 7']


def test_a_grid_names_a_users_variant_and_its_option(tmp_path, capsys, fake, tilted_variant):
  """model.import_modules among a row's overrides: the row's variant and its
  option are checked like the package's own; a module that does not import
  is a grid error naming it."""
  row = {'model.import_modules': tilted_variant, 'model.attention': 'tilted',
         'model.attention_kwargs.tilt': 2.0}
  grid = sweep.load_grid(_grid(tmp_path, {'tilted': row}))
  config = sweep.row_configs(grid['studies']['s'], 'studies.s')['tilted']
  assert (config.model.attention, config.model.attention_kwargs.tilt) == ('tilted', 2.0)
  path = _grid(tmp_path, {'tilted': {**row, 'model.import_modules': 'no_such_module'}})
  assert sweep.main([path]) == 2
  assert "row tilted: model.import_modules: no module 'no_such_module'" in capsys.readouterr().err
  assert fake() == []
