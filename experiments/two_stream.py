"""Two streams fused through attention bottlenecks (Nagrani et al. 2021), on a task that needs both.

  ./launch.sh experiments/two_stream.py
  ./launch.sh experiments/two_stream.py --config.model.fusion=early --config.model.fusion_layer=0
  ./launch.sh experiments/two_stream.py --config.data.task=claims_control
  ./launch.sh sweep experiments/sweeps/two_stream_fusion.py --jobs=2   # every fusion x 3 seeds

Stream A is 32 symbols drawn from a random half of 8; stream B is 4 claims
"s occurs in A", each true with probability 1/2; the label is how many hold
(data/two_stream.py; chance: the majority class, 0.37). model.type=two_stream:
each stream has its own embeddings and 4 pre-LN encoder layers (d 64), fused
from layer 2 through 4 shared bottleneck tokens; the classifier reads both
streams' mean states. In metrics.jsonl: eval and test `accuracy` (one
prediction per example); train records carry `step_flops` (XLA's cost
analysis of the train step). About 3 minutes on one CPU core.
Expected: test accuracy above 0.99 (early fusion and the bottleneck alike);
with --config.model.fusion_layer=4 (the streams meet only in the classifier)
near chance. The grid's table: benchmarks/RESULTS.md.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.type = 'two_stream'
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.num_encoder_layers = 4
  config.model.mlp_dim = 256
  config.model.dropout_rate = 0.0
  config.model.fusion = 'bottleneck'
  config.model.fusion_layer = 2
  config.model.fusion_bottlenecks = 4

  config.train.num_steps = 1000
  config.train.batch_size = 64
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 150
  config.train.label_smoothing = 0.0
  config.train.log_every = 100
  config.train.eval_every = 500
  config.train.checkpoint_every = 500

  config.data.task = 'presence_claims'
  config.data.max_len = 32  # stream A
  config.data.num_symbols = 8
  config.data.num_claims = 4  # stream B
  config.data.num_train = 64_000
  config.data.num_eval = 2_000
  config.eval.num_examples_to_log = 0
  config.eval.batch_size = 500
  return config
