"""The embedded default: an encoder-decoder Transformer learns to reverse sequences.

  ./launch.sh                                   # = ./launch.sh experiments/reverse.py
  ./launch.sh experiments/reverse.py --config.data.task=sort --workdir=workdirs/sort

Task: 16 symbols, lengths 1..16 (+EOS), 50k training sequences generated from
a seed (nothing downloaded); eval on 1000 held-out sequences, and on lengths
17..32 (`long_*` metrics in the test split) for length generalisation.
Model: 2+2 layers, d_model 128, 4 heads, pre-LN, sinusoidal positions, no
dropout (the task is noiseless). Training: 2500 steps of 64 sequences, Adam
with linear warmup and cosine decay to zero; the annealing is what takes exact
whole-sequence accuracy the last few points (the paper's rsqrt schedule,
--config.train.schedule=rsqrt --config.train.learning_rate=1.0, plateaus near
0.985 at 2000 steps here).
Expected: eval sequence_accuracy >= 0.99 (exact match of the whole decoded
sequence; 1.000 measured); 3m21s on 2 CPU cores (benchmarks/RESULTS.md), data
preparation and evaluation included. Lengths 17..32 are not learned
(long_sequence_accuracy ~0): absolute positions do not extrapolate.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.0

  config.train.num_steps = 2500
  config.train.batch_size = 64
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 200
  config.train.log_every = 100
  config.train.eval_every = 500
  config.train.checkpoint_every = 500

  config.data.task = 'reverse'
  config.data.num_symbols = 16
  config.data.min_len = 1
  config.data.max_len = 16
  return config
