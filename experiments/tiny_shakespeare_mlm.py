"""A BERT-style encoder (masked LM) on Tiny Shakespeare characters.

  ./launch.sh experiments/tiny_shakespeare_mlm.py --config.data.manual_dir=../shared/data/tiny_shakespeare

The third model family on the same corpus and split as
experiments/tiny_shakespeare_cpu.py: a 4-layer bidirectional encoder (d=128,
4 heads, GELU, learned positions) with BERT's MLM head (dense, GELU,
LayerNorm, the tied embedding and an output bias). In each window of 64
characters 15% of the positions are selected; 80% of those become [MASK], 10%
a random character, 10% stay; the loss is on the selected positions only.
Same optimiser and budget as the causal LM (2000 steps of 12 windows).
Eval: loss, accuracy and perplexity at the selected positions, for one fixed
draw of masks over every validation window (not comparable with the causal
LM's numbers: the encoder sees both sides, but only 15% of the characters
carry a loss, so it learns from ~7x fewer targets per step).
Expected: masked-character loss 2.42 (accuracy 0.335, perplexity 11.3) after
2000 steps; 1m26s of training on 2 CPU cores, 90 s wall.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'encoder_only'
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_encoder_layers = 4
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.0
  config.model.positions = 'learned'
  config.model.max_len = 64
  config.model.activation = 'gelu'
  config.model.init = 'gpt2'

  config.train.num_steps = 2000
  config.train.batch_size = 12
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 3e-3
  config.train.final_learning_rate = 3e-4
  config.train.warmup_steps = 100
  config.train.adam_b2 = 0.99
  config.train.adam_eps = 1e-8
  config.train.weight_decay = 0.1
  config.train.grad_clip = 1.0
  config.train.label_smoothing = 0.0
  config.train.log_every = 100
  config.train.eval_every = 500
  config.train.checkpoint_every = 500

  config.data.task = 'tiny_shakespeare'
  config.data.tokenizer = 'char'
  config.data.max_len = 64
  config.data.mlm_rate = 0.15
  config.eval.batch_size = 256
  return config
