"""Long context on Tiny Shakespeare, characters: the CPU recipe at 4096 characters.

  ./launch.sh experiments/tiny_shakespeare_long.py

experiments/tiny_shakespeare_cpu.py (a 4-layer GPT, d=128, 4 heads) trained
on windows of 4096 characters instead of 64, with no absolute positions and
ALiBi's distance biases (Press et al. 2022), which extrapolate past the
training length (benchmarks/RESULTS.md, "Train short, test long"), attention
dropout 0.1, and the kernel left to 'auto'. Evaluated over the whole
validation split in non-overlapping windows of 4096 characters (loss, bpc)
and of 16384 (loss_16384, bpc_16384), in eval batches of 131,072 characters
(32 x 4096, 8 x 16384: about 1.9 GiB each by the memory guard's estimate on
CPU). The final evaluation logs a greedy continuation of 2,000 characters
after the validation split's first 14,000 and writes it to
WORKDIR/sample.txt. A step that would not fit in memory stops the run before
training (exit 2).
Expected: validation loss 2.052 nats per character at 4096, 2.051 at 16384
(ALiBi extrapolates) after 200 steps of 4 x 4096 characters; 25 min
on 2 CPU cores (19 training, 5 evaluating and sampling), peak RSS 4.7 GiB.
The greedy continuation of a model this short-trained falls into a loop
("the the the ..."): greedy decoding, not a kernel's fault (the test of
cached decoding against full passes, tests/train/test_evaluation.py).
"""
import os
import runpy

_CPU_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tiny_shakespeare_cpu.py')

def get_config():
  config = runpy.run_path(_CPU_RECIPE)['get_config']()
  config.model.positions = 'none'
  config.model.attention = 'alibi'
  config.model.attention_kwargs.kernel = 'auto'
  config.model.attention_dropout_rate = 0.1
  config.model.max_len = 4096

  config.train.num_steps = 200  # of 4 x 4096 characters
  config.train.batch_size = 4
  config.train.warmup_steps = 20
  config.train.log_every = 10
  config.train.eval_every = 200
  config.train.checkpoint_every = 50

  config.data.max_len = 4096  # context
  config.eval.contexts = (4096, 16384)
  config.eval.batch_tokens = 131072
  config.eval.sample_prompt = 14000
  config.eval.sample_len = 2000
  return config
