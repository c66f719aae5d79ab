"""Multi30k En->De on 2 CPU cores: a small Transformer, test2016 BLEU > 30.

  ./launch.sh experiments/multi30k_cpu.py

experiments/multi30k.py at a CPU size: 3+3 pre-LN layers, d=128, 4 heads, ff
512, dropout 0.1, shared embeddings (1.9M parameters), a joint En+De 4k
unigram sentencepiece vocabulary, batches of pairs of similar length of ~4k
tokens (padding included), 2000 steps (~13 epochs) of Adam at lr 2e-3 (300
warmup steps, cosine decay to 0), label smoothing 0.1; beam 4 on test2016.
Data: Multi30k task 1 (29,000 / 1,014 / 1,000 pairs; test = test2016), raw
cased text from data.manual_dir (train/val/test_2016_flickr .en/.de, .gz or
plain), else the shared corpora (README, "Data"), else downloaded from
github.com/multi30k/dataset.
Expected: test2016 BLEU 33.5 (beam 4), validation 32.4 (greedy); 36 min
on one core of 2 (another run beside it).
"""
import os
import runpy

_FULL = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'multi30k.py')


def get_config():
  config = runpy.run_path(_FULL)['get_config']()
  config.model.d_model = 128
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.0

  config.train.num_steps = 2000
  config.train.batch_tokens = 4096
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 300
  config.train.log_every = 100
  config.train.eval_every = 1000
  config.train.checkpoint_every = 500

  config.data.vocab_size = 4000
  config.eval.beam_size = 4
  return config
