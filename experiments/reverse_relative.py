"""Length generalisation of position schemes: train on lengths 1..16, test on 17..32.

The reverse task of experiments/reverse.py, with the position scheme as the
variable. Shaw et al. 2018 claim relative positions generalise to lengths
not seen in training; `long_sequence_accuracy` (split 'test' in
metrics.jsonl) measures it on lengths 17..32.

  ./launch.sh experiments/reverse_relative.py                      # shaw, k=16
  ./launch.sh experiments/reverse_relative.py --config.model.attention=t5_bias --workdir=workdirs/rr_t5
  ./launch.sh experiments/reverse_relative.py --config.model.attention_kwargs.max_distance=2 --workdir=workdirs/rr_k2
  ./launch.sh sweep experiments/sweeps/length_generalisation.py --jobs=2   # every scheme, Shaw's k

Expected: in-distribution sequence accuracy near 1.0 for every scheme; the
long-length numbers (the sweep's tables) are in the README. About 5
minutes a run on one CPU core.
"""
import os
import runpy

_REVERSE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'reverse.py')


def get_config():
  config = runpy.run_path(_REVERSE)['get_config']()  # same task, model and budget
  config.model.attention = 'shaw'
  config.model.positions = 'none'  # relative schemes carry all position information
  return config
