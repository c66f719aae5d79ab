"""nanoGPT's CPU recipe on Tiny Shakespeare, characters: a 4-layer GPT.

  ./launch.sh experiments/tiny_shakespeare_cpu.py

The same corpus, split (first 90% of the characters train, last 10%
validate), vocabulary (the 65 characters of the file) and recipe as nanoGPT's
README "I only have a macbook" run (config/train_shakespeare_char.py with
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0): GPT-2 blocks (pre-LN,
GELU, learned positions, tied embedding, GPT-2's initialisation), AdamW with
100 warmup steps and cosine decay to a tenth of the peak, beta2 0.99, weight
decay 0.1 on matrices, gradient clipping 1.0, no label smoothing.
One change: the peak learning rate is 3e-3, not nanoGPT's 1e-3. With 1e-3
this model reaches 1.892 / 1.903 / 1.907 (seeds 0/1/2), short of nanoGPT's
reported 1.88; the sweep at seed 0 (all else equal): 1e-3 1.892, 2e-3 1.798,
3e-3 1.757, 5e-3 1.774. (Flax's default initialisation, model.init=default,
at 3e-3: 1.784.) The sweep predates the written-out softmax and loss
derivatives, which changed the rounding: the same run now gives 1.769.
nanoGPT reports validation loss 1.88 after 2000 steps; eval loss here is over
every character of the validation split (non-overlapping 64-character
windows), where nanoGPT averages 20 random batches.
Raw data: data.manual_dir (input.txt), else downloaded from karpathy/char-rnn.
Expected: validation loss 1.769 (bpc 2.55) after 2000 steps; about 1 minute
of training on 2 CPU cores under ./launch.sh (1.4 minutes without its malloc
settings; see the README for the measured wall time).
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'decoder_only'
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_decoder_layers = 4
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
  config.data.max_len = 64  # context
  config.eval.batch_size = 256
  config.eval.num_examples_to_log = 1
  return config
