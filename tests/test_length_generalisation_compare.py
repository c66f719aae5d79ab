"""benchmarks/length_generalisation_compare.py: ranks, MRR and Spearman by hand,
and the script on a small results.csv."""
import csv
import importlib.util
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    'length_generalisation_compare',
    os.path.join(REPO, 'benchmarks', 'length_generalisation_compare.py'))
lgc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = lgc
_spec.loader.exec_module(lgc)


def test_ranks_and_mean_reciprocal_rank_by_hand():
  assert lgc.ranks({'a': 0.9, 'b': 0.5, 'c': 0.9}) == {'a': 1, 'b': 3, 'c': 1}
  per_task = {'t1': {'a': 0.9, 'b': 0.5, 'c': 0.7},   # ranks a 1, c 2, b 3
              't2': {'a': 0.1, 'b': 0.8, 'c': 0.8},   # b 1, c 1, a 3
              't3': {'a': 0.5, 'b': 0.6}}             # lacks c: left out
  mrr, tasks = lgc.mean_reciprocal_rank(per_task, ('a', 'b', 'c'))
  assert tasks == ['t1', 't2']
  assert mrr == pytest.approx({'a': (1 + 1 / 3) / 2, 'b': (1 / 3 + 1) / 2, 'c': (1 / 2 + 1) / 2})


def test_spearman_is_the_textbook_formula_without_ties_and_handles_them():
  a = {'p': 5.0, 'q': 4.0, 'r': 3.0, 's': 2.0, 't': 1.0}
  b = {'p': 0.1, 'q': 0.5, 'r': 0.3, 's': 0.2, 't': 0.05}  # ranks 4 1 2 3 5
  d2 = (1 - 4) ** 2 + (2 - 1) ** 2 + (3 - 2) ** 2 + (4 - 3) ** 2 + (5 - 5) ** 2
  assert lgc.spearman(a, b) == pytest.approx(1 - 6 * d2 / (5 * (5 ** 2 - 1)))
  assert lgc.spearman(a, a) == pytest.approx(1.0)
  assert lgc.spearman(a, {k: -v for k, v in a.items()}) == pytest.approx(-1.0)
  # Ties share their mean rank: x ranks (1, 2.5, 2.5), y (1, 2, 3); centred
  # (-1, .5, .5) and (-1, 0, 1): r = 1.5 / sqrt(1.5 * 2).
  x, y = {'u': 3.0, 'v': 1.0, 'w': 1.0}, {'u': 3.0, 'v': 2.0, 'w': 1.0}
  assert lgc.spearman(x, y) == pytest.approx(1.5 / (1.5 * 2) ** 0.5)


def test_the_script_reads_the_sweeps_csv(tmp_path, capsys):
  schemes = ('none', 't5_bias', 'alibi', 'rotary', 'sinusoidal', 'learned',
             'randomized_sinusoidal', 'randomized_rotary')
  with open(tmp_path / 'results.csv', 'w', newline='') as f:
    w = csv.writer(f)
    w.writerow(['study', 'row', 'overrides', 'seed', 'metric', 'value', 'wall_seconds'])
    for task, shift in (('parity_check', 0.0), ('reverse_string', 0.1)):
      for i, scheme in enumerate(schemes):
        for seed in range(2):  # the paper's order among its five, then the rest
          w.writerow([task, scheme, '', seed, lgc.METRIC, 0.9 - 0.1 * i + shift + 0.01 * seed, 1])
          w.writerow([task, scheme, '', seed, lgc.IN_DIST_METRIC, 0.95, 1])
          w.writerow([task, scheme, '', seed, 'test.sequence_accuracy', 0.0, 1])
  assert lgc.main(['--results', str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert ('| parity_check | 8 of 8 | 0.205 randomized_rotary (0.95) | 0.905 none (0.95) '
          '| 0.905 none (0.95) | 0.910 none (0.95) | 0.007 |') in out
  assert 'Spearman with the paper: +1.00' in out  # none > t5 > alibi > rotary > absolute
  assert '| none | 1.00 (0.95) | 0.69 |' in out
  # randomized_sinusoidal (i = 6) - sinusoidal (i = 4) = -0.2; rotary: 7 - 3 -> -0.4
  assert '| reverse_string | -0.200 (0.95 / 0.95) | -0.400 (0.95 / 0.95) |' in out
  assert 'Learned: 4 of 4 pairs (both schemes learned); randomized minus plain: -0.300' in out


# A synthetic sweep worked by hand: {task: {scheme: (long score, in-distribution
# accuracy)}}. alpha and beta are learned by every scheme; in gamma `none`
# (0.50) and randomized_sinusoidal (0.60) are not.
HAND = {
    'alpha': {'none': (0.9, 0.95), 't5_bias': (0.8, 0.95), 'alibi': (0.7, 0.95),
              'rotary': (0.6, 0.95), 'sinusoidal': (0.5, 0.95), 'learned': (0.4, 0.95),
              'randomized_sinusoidal': (0.55, 0.95), 'randomized_rotary': (0.65, 0.95)},
    'beta': {'none': (0.5, 0.95), 't5_bias': (0.9, 0.95), 'alibi': (0.8, 0.95),
             'rotary': (0.7, 0.95), 'sinusoidal': (0.6, 0.95), 'learned': (0.3, 0.95),
             'randomized_sinusoidal': (0.7, 0.95), 'randomized_rotary': (0.6, 0.95)},
    'gamma': {'none': (0.9, 0.50), 't5_bias': (0.1, 0.95), 'alibi': (0.2, 0.95),
              'rotary': (0.3, 0.95), 'sinusoidal': (0.4, 0.95), 'learned': (0.45, 0.95),
              'randomized_sinusoidal': (0.2, 0.60), 'randomized_rotary': (0.5, 0.95)},
}


def _write(path, cells):
  """results.csv from {task: {scheme: (long, in_dist)}}: two seeds, each
  metric's seeds at +-0.01 (long) and +-0.04 (in-dist) around the mean."""
  with open(path / 'results.csv', 'w', newline='') as f:
    w = csv.writer(f)
    w.writerow(['study', 'row', 'overrides', 'seed', 'metric', 'value', 'wall_seconds'])
    for task, by in cells.items():
      for scheme, (long, in_dist) in by.items():
        for seed, sign in enumerate((-1, 1)):
          w.writerow([task, scheme, '', seed, lgc.METRIC, long + 0.01 * sign, 1])
          w.writerow([task, scheme, '', seed, lgc.IN_DIST_METRIC, in_dist + 0.04 * sign, 1])


def _run(tmp_path, capsys, cells, *flags):
  _write(tmp_path, cells)
  assert lgc.main(['--results', str(tmp_path), *flags]) == 0
  return capsys.readouterr().out


def test_cells_are_annotated_and_learned_at_the_threshold():
  assert lgc.LEARNED_AT == 0.90 and lgc.IN_DIST_METRIC == 'test.accuracy'
  assert lgc.annotate('0.534', 0.71, 0.9) == '0.534 (0.71, not learned)'
  assert lgc.annotate('0.622', 0.9, 0.9) == '0.622 (0.90)'  # "at least": 0.90 is learned
  assert lgc.annotate('0.1', float('nan'), 0.9) == '0.1 (-, not learned)'
  per_task = {'t': {'a': 0.3, 'b': 0.4, 'c': 0.5}}
  in_dist = {'t': {'a': 0.95, 'b': 0.89}}  # c has no in-distribution score
  assert lgc.learned_only(per_task, in_dist, 0.9) == {'t': {'a': 0.3}}


def test_spearman_of_a_constant_ordering_is_nan():
  assert np.isnan(lgc.spearman({'a': 1.0, 'b': 1.0, 'c': 1.0}, {'a': 3.0, 'b': 2.0, 'c': 1.0}))


def test_learned_counts_by_hand(tmp_path, capsys):
  out = _run(tmp_path, capsys, HAND)
  assert '| alpha | 8 of 8 | 0.95 | all |' in out
  # gamma: (6 x 0.95 + 0.50 + 0.60) / 8 = 0.85; all: (22 x 0.95 + 1.10) / 24 = 0.917
  assert ('| gamma | 6 of 8 | 0.85 | t5_bias, alibi, rotary, sinusoidal, learned, '
          'randomized_rotary |') in out
  assert '| **all** | 22 of 24 | 0.92 | |' in out
  # The spread: gamma's highest is `none` (0.900), not learned; the highest
  # learned is randomized_rotary (0.500).
  assert ('| gamma | 6 of 8 | 0.100 t5_bias (0.95) | 0.900 none (0.50, not learned) '
          '| 0.500 randomized_rotary (0.95) | 0.910 none (0.50, not learned) | 0.014 |') in out


def test_kazemnejad_over_the_learned_tasks_by_hand(tmp_path, capsys):
  out = _run(tmp_path, capsys, HAND)
  # gamma's `none` is not learned: marked in the per-task table, and gamma
  # leaves the MRR. Over alpha (ranks none 1, t5 2, alibi 3, rotary 4, sin 5)
  # and beta (t5 1, alibi 2, rotary 3, sin 4, none 5):
  #   none (1 + 1/5) / 2 = 0.60, t5 (1/2 + 1) / 2 = 0.75, alibi (1/3 + 1/2) / 2
  #   = 0.42, rotary (1/4 + 1/3) / 2 = 0.29, sinusoidal (1/5 + 1/4) / 2 = 0.225.
  # Ours t5 > none > alibi > rotary > sin against the paper's none > t5 > ...:
  # d^2 = 1 + 1, rho = 1 - 6 * 2 / (5 * 24) = 0.90.
  assert '| gamma | 0.900 (0.50, not learned) | 0.100 (0.95) |' in out
  assert ('Absolute = `sinusoidal`: learned: 14 of 15 cells; tasks where all five are '
          'learned: 2 of 3 (alpha, beta); Spearman with the paper: +0.90') in out
  assert ('Absolute = `learned`: learned: 14 of 15 cells; tasks where all five are '
          'learned: 2 of 3 (alpha, beta); Spearman with the paper: +0.90') in out
  for row in ('| t5_bias | 0.75 (0.95) | 0.55 |', '| none | 0.60 (0.95) | 0.69 |',
              '| alibi | 0.42 (0.95) | 0.50 |', '| rotary | 0.29 (0.95) | 0.33 |',
              '| sinusoidal | 0.23 (0.95) | 0.22 |', '| learned | 0.20 (0.95) | 0.22 |'):
    assert row in out


def test_an_unlearned_cell_leaves_the_comparison(tmp_path, capsys):
  cells = {t: dict(by) for t, by in HAND.items()}
  cells['beta']['alibi'] = (0.8, 0.5)  # 0.95 -> 0.5: beta leaves the MRR
  out = _run(tmp_path, capsys, cells)
  assert '| beta | 0.500 (0.95) | 0.900 (0.95) | 0.800 (0.50, not learned) |' in out
  assert ('Absolute = `sinusoidal`: learned: 13 of 15 cells; tasks where all five are '
          'learned: 1 of 3 (alpha); Spearman with the paper: too few tasks (1) for a '
          'rank correlation') in out
  assert '| none | 1.00 (0.95) | 0.69 |' in out  # alpha alone: 1 / rank
  assert '| alibi | 0.33 (0.95) | 0.50 |' in out
  assert 'Spearman with the paper: +' not in out


def test_the_threshold_is_settable(tmp_path, capsys):
  # At 0.40 every cell is learned: gamma (ranks none 1, sin 2, rotary 3, alibi
  # 4, t5 5) joins. MRR none 2.2 / 3 = 0.73, t5 1.7 / 3 = 0.57, alibi (13/12)
  # / 3 = 0.36, sin 0.95 / 3 = 0.32, rotary (11/12) / 3 = 0.31: the paper's
  # order but rotary and the absolute row swapped, rho = 1 - 6 * 2 / 120 = 0.90.
  # Randomized minus plain: gamma's -0.20 joins, (0.30 - 0.20) / 6 = +0.017.
  out = _run(tmp_path, capsys, HAND, '--learned_at', '0.4')
  assert ('Absolute = `sinusoidal`: learned: 15 of 15 cells; tasks where all five are '
          'learned: 3 of 3 (alpha, beta, gamma); Spearman with the paper: +0.90') in out
  assert '| none | 0.73 (0.80) | 0.69 |' in out  # in-dist: (0.95 + 0.95 + 0.50) / 3
  assert '| **all** | 24 of 24 | 0.92 | |' in out
  assert ', not learned)' not in out  # the legends alone name it
  assert 'Learned: 6 of 6 pairs (both schemes learned); randomized minus plain: +0.017' in out


def test_a_constant_ordering_gets_no_correlation(tmp_path, capsys):
  tie = {s: (0.5, 0.95) for s in ('none', 't5_bias', 'alibi', 'rotary', 'sinusoidal')}
  out = _run(tmp_path, capsys, {'alpha': tie, 'beta': tie})
  assert ('tasks where all five are learned: 2 of 2 (alpha, beta); Spearman with the '
          'paper: none: our MRR ties all five (a constant ordering)') in out


def test_ruoss_over_the_learned_pairs_by_hand(tmp_path, capsys):
  out = _run(tmp_path, capsys, HAND)
  # randomized_sinusoidal - sinusoidal: alpha +0.05, beta +0.10; gamma -0.20
  # is not learned (0.60). randomized_rotary - rotary: +0.05, -0.10, +0.20.
  # Mean over the 5 learned pairs: (0.05 + 0.10 + 0.05 - 0.10 + 0.20) / 5.
  assert '| alpha | +0.050 (0.95 / 0.95) | +0.050 (0.95 / 0.95) |' in out
  assert '| gamma | -0.200 (0.60 / 0.95, not learned) | +0.200 (0.95 / 0.95) |' in out
  assert ('| **mean, learned pairs** | +0.075 over 2 of 3 tasks | +0.050 over 3 of 3 '
          'tasks |') in out
  assert ('Learned: 5 of 6 pairs (both schemes learned); randomized minus plain: '
          '+0.060 over them; paper +0.120.') in out


def test_the_committed_results_report_what_was_learned(capsys):
  assert lgc.main([]) == 0
  out = capsys.readouterr().out
  assert '| **all** | ' in out and ' of 132 |' in out
  assert 'learned: ' in out and ' of 55 cells; tasks where all five are learned: ' in out
  assert 'Learned: ' in out and ' of 22 pairs' in out
  # reverse_string: `none` sees a bag of tokens and does not fit lengths 1-40.
  rows = [line for line in out.splitlines() if line.startswith('| reverse_string |')]
  assert len(rows) == 4  # learned, spread, Kazemnejad, Ruoss
  assert all('not learned' in row for row in rows[1:])
  assert '| reverse_string | 0.453 (0.66, not learned) |' in out
