"""Multi30k En->De on 2 CPU cores: a small Transformer, test2016 BLEU >= 30.

  ./launch.sh experiments/multi30k_cpu.py --config.data.manual_dir=../shared/data/multi30k

Data: Multi30k task 1 (29,000 / 1,014 / 1,000 pairs; test = test2016), raw
cased text, a joint En+De 4k unigram sentencepiece vocabulary trained on the
training split once and cached next to the prepared data. Batches of
sentences of similar length, ~4k tokens (padding included) each.
Model: encoder-decoder, 3+3 pre-LN layers, d=128, 4 heads, ff 512, dropout
0.1, shared embeddings (1.9M parameters). 2000 steps (~13 epochs) of Adam,
lr 2e-3, 300 warmup steps, cosine decay to 0, label smoothing 0.1.
Evaluation: greedy-decoded validation BLEU at every eval, beam search
(beam 4, GNMT alpha 0.6) on test2016 at the end; sacreBLEU (13a, cased) of
the detokenized output against the raw references.
Raw data: data.manual_dir (train/val/test_2016_flickr .en/.de, .gz or plain),
else downloaded from github.com/multi30k/dataset.
Expected: test2016 BLEU 34.2 (beam 4; validation, greedy: 32.6) after 11m14s
of training on 2 CPU cores; 11m53s for the whole run from raw files (data
preparation, tokenizer training and evaluation included). Without
./launch.sh's malloc settings (README, "CPU allocator"): 16m25s / 17m03s.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'encoder_decoder'
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.1
  config.model.max_len = 256

  config.train.num_steps = 2000
  config.train.batch_tokens = 4096
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 300
  config.train.label_smoothing = 0.1
  config.train.log_every = 100
  config.train.eval_every = 1000
  config.train.checkpoint_every = 500

  config.data.task = 'multi30k'
  config.data.source_lang = 'en'
  config.data.target_lang = 'de'
  config.data.tokenizer = 'sentencepiece'
  config.data.vocab_size = 4000
  config.data.spm_model_type = 'unigram'
  config.data.max_len = 64
  config.eval.batch_size = 200
  config.eval.beam_size = 4
  config.eval.num_examples_to_log = 2
  return config
