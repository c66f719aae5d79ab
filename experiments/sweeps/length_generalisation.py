"""Which positions reverse sequences longer than any seen? ./launch.sh sweep experiments/sweeps/length_generalisation.py --jobs=2

experiments/reverse_relative.py (the reverse task, trained on lengths 1-16 and
tested on 17-32, split test_long) with the position scheme as the variable:
  positions: absolute sinusoidal against every relative scheme;
  clipping:  Shaw et al. 2018's clipping distance k (their Table 2).
Relative schemes run without absolute positions. One seed: add seeds to see
the spread (a few points at this budget).
Workdirs, results.csv, tables.md and a figure per table: in
workdirs/length_generalisation/. The committed results in
benchmarks/results/length_generalisation/ come from `--results
benchmarks/results/length_generalisation`; `--plot_only` with it redraws their
figures from their results.csv.
Expected: sequence accuracy near 1.0 in distribution for every scheme but
shaw k=0; on the long lengths sinusoidal ~0, the relative schemes well above.
"""


def shaw(k):
  return {'model.attention': 'shaw', 'model.attention_kwargs.max_distance': k}


POSITIONS = {
    'sinusoidal': {'model.attention': 'dot_product', 'model.positions': 'sinusoidal'},
    'shaw_k16': shaw(16),
    't5_bias': {'model.attention': 't5_bias'},
    'alibi': {'model.attention': 'alibi'},
    'rotary': {'model.attention': 'rotary'},
    'transformer_xl': {'model.attention': 'transformer_xl'},
    'deberta': {'model.attention': 'deberta'},
}
CLIPPING = {f'shaw_k{k}': shaw(k) for k in (0, 1, 2, 4, 16, 64)}


def get_sweep():
  return {
      'seeds': [0],
      'out': 'workdirs/length_generalisation',
      'studies': {
          'reverse': {
              'experiment': 'experiments/reverse_relative.py',
              'overrides': {'eval.num_examples_to_log': 0},
              'rows': {**POSITIONS, **CLIPPING},
              'metrics': {'test.sequence_accuracy': 'test seq. acc. (lengths 1-16)',
                          'test.long_accuracy': 'long token acc. (17-32)',
                          'test.long_sequence_accuracy': 'long seq. acc. (17-32)'},
              'tables': {'positions': list(POSITIONS), 'clipping': list(CLIPPING)},
          },
      },
  }
