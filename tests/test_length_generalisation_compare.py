"""benchmarks/length_generalisation_compare.py: ranks, MRR and Spearman by hand,
and the script on a small results.csv."""
import csv
import importlib.util
import os
import sys

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
          w.writerow([task, scheme, '', seed, 'test.sequence_accuracy', 0.0, 1])
  assert lgc.main(['--results', str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert '| parity_check | 8 | 0.205 | 0.905 | none | 0.910 (none) | 0.007 |' in out
  assert 'Spearman with the paper: +1.00' in out  # none > t5 > alibi > rotary > absolute
  assert '| none | 1.00 | 0.69 |' in out
  # randomized_sinusoidal (i = 6) - sinusoidal (i = 4) = -0.2; rotary: 7 - 3 -> -0.4
  assert '| reverse_string | -0.200 | -0.400 |' in out
  assert '| **mean** | -0.300 over 4 pairs; paper +0.120 |' in out
