"""The embedded default: an encoder-decoder Transformer learns to reverse sequences.

  ./launch.sh                                   # = ./launch.sh experiments/reverse.py
  ./launch.sh experiments/reverse.py --config.data.task=sort --workdir=workdirs/sort

Task: 16 symbols, lengths 1..16 (+EOS), 50k training sequences generated from
a seed (nothing downloaded); eval on 1000 held-out sequences, and on lengths
17..32 (`long_*` metrics in the test split) for length generalisation.
Model: 2+2 layers, d_model 128, 4 heads, pre-LN, sinusoidal positions.
Expected: eval sequence_accuracy >= 0.99 (exact match of the whole decoded
sequence); about 3 minutes on 2 CPU cores, data preparation included.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.1

  config.train.num_steps = 2000
  config.train.batch_size = 64
  config.train.learning_rate = 1.0
  config.train.warmup_steps = 400
  config.train.log_every = 100
  config.train.eval_every = 1000
  config.train.checkpoint_every = 500

  config.data.task = 'reverse'
  config.data.num_symbols = 16
  config.data.min_len = 1
  config.data.max_len = 16
  return config
