"""An attentional RNN (Luong et al. 2015) learns to reverse sequences.

  ./launch.sh experiments/reverse_rnn.py                    # attention=bahdanau
  ./launch.sh experiments/reverse_rnn.py --config.model.attention=luong_general
  ./launch.sh experiments/reverse_rnn.py --config.model.rnn_cell=gru

Task: the same as experiments/reverse.py (16 symbols, lengths 1..16 + EOS,
50k training sequences; lengths 17..32 in the `long_*` test metrics).
Model (model.type=rnn_seq2seq, layers/rnn.py): one bidirectional LSTM layer
of 2 x 64 units, one LSTM decoder layer of 128 units with input feeding, one
attention head scoring the decoder state against the encoder outputs, no
dropout (the task is noiseless). Attention follows the decoder step, for
every scoring function (Luong's order; see layers/rnn.py). Training: 1000
steps of 64 sequences, Adam with linear warmup and cosine decay.
Expected on a 2-core CPU (wall time includes data preparation, compilation
and evaluation):
  attention=bahdanau       eval sequence_accuracy 1.000 (test 1.000), 83 s wall
  rnn_cell=gru (bahdanau)  eval sequence_accuracy 1.000 (test 1.000), 85 s wall
  attention=luong_general  eval sequence_accuracy 0.993 (one core, 92 s training)
Lengths 17..32 (not trained on): long_sequence_accuracy 0.11 (bahdanau), 0.12
(gru), 0.65 (luong_general). The README's attention-family table has every
scoring function on this task (benchmarks/compare_attention.py).
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'rnn_seq2seq'
  config.model.attention = 'bahdanau'
  config.model.rnn_cell = 'lstm'
  config.model.rnn_input_feeding = True
  config.model.d_model = 128
  config.model.num_heads = 1
  config.model.num_encoder_layers = 1
  config.model.num_decoder_layers = 1
  config.model.dropout_rate = 0.0

  config.train.num_steps = 1000
  config.train.batch_size = 64
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 200
  config.train.log_every = 100
  config.train.eval_every = 250
  config.train.checkpoint_every = 250

  config.data.task = 'reverse'
  config.data.num_symbols = 16
  config.data.min_len = 1
  config.data.max_len = 16
  return config
