"""Length generalisation of position schemes: train on lengths 1..16, test on 17..32.

The reverse task of experiments/reverse.py, with the position scheme as the
variable. Shaw et al. 2018 claim relative positions generalise to lengths
not seen in training; `long_sequence_accuracy` (split 'test' in
metrics.jsonl) measures it on lengths 17..32.

  ./launch.sh experiments/reverse_relative.py                      # shaw, k=16
  ./launch.sh experiments/reverse_relative.py --config.model.attention=t5_bias --workdir=workdirs/rr_t5
  ./launch.sh experiments/reverse_relative.py --config.model.attention=alibi --workdir=workdirs/rr_alibi
  ./launch.sh experiments/reverse_relative.py --config.model.attention=rotary --workdir=workdirs/rr_rotary
  ./launch.sh experiments/reverse_relative.py --config.model.attention=dot_product \
      --config.model.positions=sinusoidal --workdir=workdirs/rr_sinusoidal
  # clipping ablation (the paper's Table 2):
  ./launch.sh experiments/reverse_relative.py --config.model.attention_kwargs.max_distance=2 --workdir=workdirs/rr_k2

Expected (2 CPU cores, about 3 minutes each): in-distribution sequence
accuracy near 1.0 for every scheme; the long-length numbers are in the README.
"""
import os
import runpy

_REVERSE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'reverse.py')


def get_config():
  config = runpy.run_path(_REVERSE)['get_config']()  # same task, model and budget
  config.model.attention = 'shaw'
  config.model.positions = 'none'  # relative schemes carry all position information
  return config
