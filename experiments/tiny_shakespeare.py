"""nanoGPT's GPU recipe on Tiny Shakespeare, characters: the "baby GPT".

  FFL_EXTRAS=cuda ./launch.sh experiments/tiny_shakespeare.py

config/train_shakespeare_char.py as published: 6 layers, 6 heads, d=384,
context 256, batch 64, 5000 steps, dropout 0.2, AdamW lr 1e-3 (100 warmup
steps, cosine decay to 1e-4 at step 5000), beta2 0.99, weight decay 0.1,
gradient clipping 1.0, GPT-2's initialisation. nanoGPT reports validation loss 1.4697 (about 3
minutes on an A100). Corpus, split and model family as in
experiments/tiny_shakespeare_cpu.py.
Computes in bfloat16 on a GPU or TPU (model.dtype='auto'), float32 on CPU.
Expected: nanoGPT's 1.4697 is the anchor. On one H200 (benchmarks/KERNELS.md,
"How soon does a run start?"): best validation loss 1.484 at step 1500, 153
steps/s, first step 11 s after launch on a warm compilation cache.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'decoder_only'
  config.model.d_model = 384
  config.model.num_heads = 6
  config.model.num_decoder_layers = 6
  config.model.mlp_dim = 1536
  config.model.dropout_rate = 0.2
  config.model.positions = 'learned'
  config.model.max_len = 256
  config.model.activation = 'gelu'
  config.model.init = 'gpt2'
  config.model.dtype = 'auto'  # bfloat16 on a GPU, as nanoGPT; parameters and loss in float32

  config.train.num_steps = 5000
  config.train.batch_size = 64
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 1e-3
  config.train.final_learning_rate = 1e-4
  config.train.warmup_steps = 100
  config.train.adam_b2 = 0.99
  config.train.adam_eps = 1e-8
  config.train.weight_decay = 0.1
  config.train.grad_clip = 1.0
  config.train.label_smoothing = 0.0
  config.train.log_every = 250
  config.train.eval_every = 250  # nanoGPT's eval_interval: the best loss comes near 1750
  config.train.checkpoint_every = 1000

  config.data.task = 'tiny_shakespeare'
  config.data.tokenizer = 'char'
  config.data.max_len = 256  # context
  config.eval.batch_size = 256
  config.eval.num_examples_to_log = 1
  return config
