"""Which position scheme generalises? ./launch.sh sweep experiments/sweeps/length_generalisation_suite.py --jobs=2 --results benchmarks/results/length_generalisation_suite

The standard length-generalisation tasks (data/algorithmic.py) x position
schemes x 3 seeds, each run experiments/algorithmic.py: trained on lengths
1..40, tested at 50, 100, ..., 500 (mqar: key-value pairs 1..40, tested at
50..250). Eight of Deletang et al. 2023's tasks over the regular,
context-free and context-sensitive groups, plus MQAR, passkey and flip-flop;
the other generators (modular_arithmetic, modular_arithmetic_brackets,
binary_addition, odds_first) join with a line in TASKS. Schemes: absolute
(sinusoidal, learned), none, the relative schemes (without absolute
positions), and Ruoss et al. 2023's randomized positions (L = 2048) on
sinusoidal and rotary.
Every run has the same short budget (1,000 steps of 32, a 2+2-layer d64
encoder-decoder; the papers train 1M steps): these are this budget's
numbers, not the papers' converged ones.
Workdirs in workdirs/length_generalisation_suite/; results.csv, tables.md
(a summary per metric: task x scheme, mean ± std [best seed]; then a table
per task) and the figures (accuracy against test length per task group) in
--results, without it in the workdirs' root; the committed ones, in
benchmarks/results/length_generalisation_suite/, come from the command above.
A run takes 25 s-5 min (median 76 s; mqar's the longest), so the 396 take
about 4 hours at --jobs=2 on 2 CPU cores; a second invocation finishes at once.
"""

RANDOMIZED_L = 2048  # Ruoss et al.: L well beyond the longest test length

SCHEMES = {
    'sinusoidal': {'model.positions': 'sinusoidal'},
    'learned': {'model.positions': 'learned'},
    'none': {'model.positions': 'none'},
    'rotary': {'model.attention': 'rotary', 'model.positions': 'none'},
    'alibi': {'model.attention': 'alibi', 'model.positions': 'none'},
    't5_bias': {'model.attention': 't5_bias', 'model.positions': 'none'},
    'shaw': {'model.attention': 'shaw', 'model.positions': 'none'},
    'transformer_xl': {'model.attention': 'transformer_xl', 'model.positions': 'none'},
    'fire': {'model.attention': 'fire', 'model.positions': 'none'},
    'kerple': {'model.attention': 'kerple', 'model.positions': 'none'},
    'randomized_sinusoidal': {'model.positions': 'sinusoidal',
                              'model.randomized_positions': RANDOMIZED_L},
    'randomized_rotary': {'model.attention': 'rotary', 'model.positions': 'none',
                          'model.randomized_positions': RANDOMIZED_L},
}

LONG = tuple(range(50, 501, 50))
TASKS = {  # task: (group, its test lengths)
    'parity_check': ('regular', LONG),
    'even_pairs': ('regular', LONG),
    'cycle_navigation': ('regular', LONG),
    'reverse_string': ('context_free', LONG),
    'stack_manipulation': ('context_free', LONG),
    'duplicate_string': ('context_sensitive', LONG),
    'missing_duplicate': ('context_sensitive', LONG),
    'bucket_sort': ('context_sensitive', LONG),
    'passkey': ('retrieval', LONG),
    'flip_flop': ('retrieval', LONG),
    'mqar': ('retrieval', tuple(range(50, 251, 50))),  # at most 256 distinct keys
}

METRICS = {
    'test.sequence_accuracy': 'exact match, lengths 1-40',
    'test.long_mean_length_accuracy': 'token accuracy, long (mean over lengths)',
    'test.long_sequence_accuracy': 'exact match, long',
}


def _panels():
  panels = {}
  for task, (group, lengths) in TASKS.items():
    panel = f'{group} (mqar: pairs)' if task == 'mqar' else group
    panels.setdefault(panel, []).append(task)
  return panels


def get_sweep():
  return {
      'seeds': [0, 1, 2],
      'out': 'workdirs/length_generalisation_suite',
      'studies': {
          task: {
              'experiment': 'experiments/algorithmic.py',
              'overrides': {'data.task': task, 'data.test_lengths': lengths},
              'rows': SCHEMES,
              'metrics': METRICS,
              'tables': {'schemes': list(SCHEMES)},
          } for task, (group, lengths) in TASKS.items()},
      'summaries': {
          'token_accuracy': {'metric': 'test.long_mean_length_accuracy',
                             'label': 'token accuracy on the long lengths (the papers\' score)'},
          'exact_match': {'metric': 'test.long_sequence_accuracy',
                          'label': 'exact match on the long lengths'},
          'in_distribution': {'metric': 'test.sequence_accuracy',
                              'label': 'exact match on lengths 1-40'},
      },
      'curves': {
          'token_accuracy_by_length': {'metric': 'test.long_accuracy_len',
                                       'label': 'token accuracy', 'xlabel': 'test length',
                                       'panels': _panels()},
          'exact_match_by_length': {'metric': 'test.long_sequence_accuracy_len',
                                    'label': 'exact match', 'xlabel': 'test length',
                                    'panels': _panels()},
      },
  }
