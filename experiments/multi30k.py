"""Multi30k En->De, the full recipe: a 4+4-layer Transformer, beam 5.

  FFL_EXTRAS=cuda ./launch.sh experiments/multi30k.py
  ./launch.sh experiments/multi30k.py --config.model.attention=shaw --config.model.positions=none
  ./launch.sh experiments/multi30k.py --config.model.attention=t5_bias --config.model.positions=none

The anchor: a 4-layer d=128 fairseq Transformer reaches 41.0 test2016 BLEU
En->De with beam 5. Here: 4+4 pre-LN layers, d=256, 4 heads, ff 1024, dropout
0.3 (small data), label smoothing 0.1, ~8k-token batches, 12k steps of Adam
with warmup and cosine decay, a joint 8k unigram sentencepiece vocabulary;
beam 5, alpha 0.6, sacreBLEU (13a, cased) on detokenized output against the
raw test2016 references. Any attention variant is one flag (relative
variants usually with --config.model.positions=none).
Expected: not measured here (meant for an accelerator; several hours on 2 CPU
cores). experiments/multi30k_cpu.py is the measured CPU recipe (33.5 BLEU).
Data as in experiments/multi30k_cpu.py.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'encoder_decoder'
  config.model.d_model = 256
  config.model.num_heads = 4
  config.model.num_encoder_layers = 4
  config.model.num_decoder_layers = 4
  config.model.mlp_dim = 1024
  config.model.dropout_rate = 0.3
  config.model.attention_dropout_rate = 0.1
  config.model.max_len = 256

  config.train.num_steps = 12000
  config.train.batch_tokens = 8192
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 1000
  config.train.label_smoothing = 0.1
  config.train.log_every = 200
  config.train.eval_every = 2000
  config.train.checkpoint_every = 1000

  config.data.task = 'multi30k'
  config.data.source_lang = 'en'
  config.data.target_lang = 'de'
  config.data.tokenizer = 'sentencepiece'
  config.data.vocab_size = 8000
  config.data.spm_model_type = 'unigram'
  config.data.max_len = 64
  config.eval.batch_size = 200
  config.eval.beam_size = 5
  config.eval.beam_alpha = 0.6
  config.eval.num_examples_to_log = 2
  return config
