"""nanoGPT's CPU recipe on Tiny Shakespeare, characters: a 4-layer GPT.

  ./launch.sh experiments/tiny_shakespeare_cpu.py

experiments/tiny_shakespeare.py (nanoGPT's GPU recipe) at the size of
nanoGPT's README "I only have a macbook" run (--block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000
--dropout=0.0): the same corpus and split (the first 90% of the characters
train), vocabulary (the file's 65 characters), GPT-2 blocks and
initialisation, AdamW with 100 warmup steps and cosine decay to a tenth of the
peak. The peak learning rate is 3e-3 rather than nanoGPT's 1e-3 (at 1e-3:
1.892 / 1.903 / 1.907 for seeds 0/1/2; 2e-3: 1.798; 5e-3: 1.774).
Raw data: data.manual_dir (input.txt), else the shared corpora (README,
"Data"), else downloaded from karpathy/char-rnn.
Expected: validation loss 1.760 (bpc 2.54) over every character of the
validation split after 2000 steps (nanoGPT reports 1.88, averaged over 20
random batches); 2m10s on 2 CPU cores (benchmarks/RESULTS.md, "Real corpora").
"""
import os
import runpy

_GPU_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tiny_shakespeare.py')


def get_config():
  config = runpy.run_path(_GPU_RECIPE)['get_config']()
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_decoder_layers = 4
  config.model.mlp_dim = 512
  config.model.dropout_rate = 0.0
  config.model.max_len = 64

  config.train.num_steps = 2000
  config.train.batch_size = 12
  config.train.learning_rate = 3e-3
  config.train.final_learning_rate = 3e-4
  config.train.log_every = 100
  config.train.eval_every = 500
  config.train.checkpoint_every = 500

  config.data.max_len = 64  # context
  return config
