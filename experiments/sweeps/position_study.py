"""Shaw et al. 2018's questions on real data, 3 seeds: ./launch.sh sweep experiments/sweeps/position_study.py --jobs=2

Multi30k En->De (experiments/multi30k_cpu.py at a shorter budget, the same
for every row: 400 steps of ~2k tokens, packed, ~2 epochs):
  positions: absolute sinusoidal vs the relative schemes and none (Table 1);
  clipping:  shaw's clipping distance k (Table 2);
  keys_values: shaw's relative keys only, values only, both (Table 3).
Tiny Shakespeare (experiments/tiny_shakespeare_cpu.py, nanoGPT's CPU recipe
with Flax's initialisation for every scheme): the positions rows.
Relative schemes run without absolute positions (model.positions=none), as in
the paper; cross-attention stays dot-product.
Workdirs, results.csv, tables.md and a figure per table: in
workdirs/position_study/. The committed results in
benchmarks/results/position_study/ come from `--results
benchmarks/results/position_study`; `--plot_only` with it redraws their figures
from their results.csv. Expected (mean over 3
seeds): test2016 BLEU 15.5 sinusoidal, 15.0 shaw k=16, 16.6 rotary, 13.7 no
positions; shaw k=0 13.3, k=1-4 ~16; Tiny Shakespeare 1.699 sinusoidal, 1.623
shaw. 2h11m on 2 CPU cores with --jobs=2.
"""

import os

DATA = os.environ.get('FFL_SHARED_DATA', '../shared/data')  # the corpora (../shared/data/README)
MULTI30K = os.path.join(DATA, 'multi30k')
TINY_SHAKESPEARE = os.path.join(DATA, 'tiny_shakespeare')


def shaw(**options):
  return {'model.positions': 'none', 'model.attention': 'shaw',
          **{f'model.attention_kwargs.{k}': v for k, v in options.items()}}


POSITIONS = {
    'sinusoidal': {'model.positions': 'sinusoidal', 'model.attention': 'dot_product'},
    'shaw_k16': shaw(max_distance=16),
    't5_bias': {'model.positions': 'none', 'model.attention': 't5_bias'},
    'alibi': {'model.positions': 'none', 'model.attention': 'alibi'},
    'rotary': {'model.positions': 'none', 'model.attention': 'rotary'},
    'nope': {'model.positions': 'none', 'model.attention': 'dot_product'},
}
CLIPPING = {f'shaw_k{k}': shaw(max_distance=k) for k in (0, 1, 2, 4, 16, 64)}
KEYS_VALUES = {
    'shaw_keys': shaw(max_distance=16, relative_values=False),
    'shaw_values': shaw(max_distance=16, relative_keys=False),
    'shaw_k16': shaw(max_distance=16),
}


def get_sweep():
  return {
      'seeds': [0, 1, 2],
      'out': 'workdirs/position_study',
      'studies': {
          'tiny_shakespeare': {
              'experiment': 'experiments/tiny_shakespeare_cpu.py',
              'overrides': {'data.manual_dir': TINY_SHAKESPEARE, 'model.init': 'default',
                            'eval.num_examples_to_log': 0},
              'rows': POSITIONS,
              'metrics': {'eval.loss': 'validation loss (nats/char)'},
          },
          'multi30k': {
              'experiment': 'experiments/multi30k_cpu.py',
              'overrides': {
                  'data.manual_dir': MULTI30K, 'data.pack': True,
                  'train.num_steps': 400, 'train.batch_tokens': 2048, 'train.warmup_steps': 80,
                  'train.log_every': 50, 'train.eval_every': 400, 'train.checkpoint_every': 100,
                  'eval.num_examples_to_log': 0,
              },
              'rows': {**POSITIONS, **CLIPPING, **KEYS_VALUES},
              'metrics': {'test.bleu': 'test2016 BLEU (beam 4)', 'eval.loss': 'validation loss'},
              'tables': {'positions': list(POSITIONS), 'clipping': list(CLIPPING),
                         'keys_values': list(KEYS_VALUES)},
          },
      },
  }
