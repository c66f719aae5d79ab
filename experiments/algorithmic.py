"""One task of the length-generalisation suite: train on lengths 1..40, test on 50..500.

  ./launch.sh experiments/algorithmic.py                                   # parity_check
  ./launch.sh experiments/algorithmic.py --config.data.task=reverse_string --workdir=workdirs/alg_reverse
  ./launch.sh experiments/algorithmic.py --config.model.attention=alibi --config.model.positions=none
  ./launch.sh sweep experiments/sweeps/length_generalisation_suite.py --jobs=2   # every scheme x task x 3 seeds

A task of data/algorithmic.py (Deletang et al. 2023's Chomsky-hierarchy
tasks, MQAR, passkey, flip-flop) learnt by an encoder-decoder Transformer:
the input string in the encoder, its answer decoded after it. Training draws
lengths uniformly from 1..40 as the papers do; split test_long holds 20
examples at each of 50, 100, ..., 500. In metrics.jsonl (split 'test'):
`long_sequence_accuracy` is their exact-match accuracy (greedy decoding's,
computed in one teacher-forced pass), `long_sequence_accuracy_len<L>` per
length; `long_accuracy_len<L>` is the mean fraction of right answer tokens
(EOS not counted) and `long_mean_length_accuracy` its mean over the
lengths, the score Deletang et al. and Ruoss et al. tabulate. The budget is far below
the papers' (1,000 steps of 32 here; Deletang et al. train 1M steps of 128),
the same for every scheme. 1-2 minutes a run on one CPU core.
Expected: reverse_string with alibi about 0.8 exact match on lengths 1-40
and none beyond; every task and scheme: the suite's tables
(benchmarks/RESULTS.md).
"""
from flaxformer_lite import config as config_lib

TEST_LENGTHS = tuple(range(50, 501, 50))


def get_config():
  config = config_lib.base_config()
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.mlp_dim = 256
  config.model.dropout_rate = 0.0
  config.model.max_len = 1024

  config.train.num_steps = 1000
  config.train.batch_size = 32
  config.train.schedule = 'warmup_cosine'
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 200
  config.train.label_smoothing = 0.0
  config.train.log_every = 100
  config.train.eval_every = 1000
  config.train.checkpoint_every = 500

  config.data.task = 'parity_check'
  config.data.min_len = 1
  config.data.max_len = 40
  config.data.test_lengths = TEST_LENGTHS
  config.data.num_train = 32_000
  config.data.num_eval = 200
  config.eval.num_examples_to_log = 0
  config.eval.sequence_accuracy = 'teacher_forced'  # greedy's exact match, one pass
  config.eval.batch_size = 50
  return config
