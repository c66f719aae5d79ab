"""Evaluator: eval batches sized in tokens, a language model scored at several
contexts (against the model applied to the windows by hand), the greedy sample
(against full passes), on the long-context path."""
import os

import jax
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import data, models
from flaxformer_lite.train import checkpoints, loop, metrics, state as state_lib
from flaxformer_lite.train.evaluation import Evaluator, sample_lengths


def _lm_config(**eval_values):
  c = config_lib.base_config()
  c.model.type, c.model.vocab_size = 'decoder_only', 40
  c.model.d_model, c.model.num_heads, c.model.mlp_dim, c.model.num_decoder_layers = 16, 2, 32, 1
  c.data.task, c.data.tokenizer, c.data.max_len = 'tiny_shakespeare', 'char', 16
  c.eval.update(eval_values)
  return c


def test_eval_rows_come_from_batch_tokens_at_each_width(tiny_config):
  lm = data.Dataset(40, {'validation': np.arange(3, 400, dtype=np.int32)}, {}, kind='lm')
  c = _lm_config(batch_tokens=100, contexts=(64, 256))
  evaluate = Evaluator(c, models.build(c.model), lm)
  assert evaluate.contexts() == (16, 64, 256)
  rows = [evaluate.batch_rows(evaluate.arrays('validation', n))[0] for n in evaluate.contexts()]
  assert rows == [100 // 16, 100 // 64, 1]  # at least one window a batch
  c.eval.batch_tokens = 0
  assert evaluate.batch_rows(evaluate.arrays('validation', 64))[0] == c.eval.batch_size

  pairs = data.load(tiny_config.data)  # synthetic: every split padded to max_len + EOS = 7
  tiny_config.model.vocab_size = pairs.vocab_size
  tiny_config.eval.batch_tokens = 30
  evaluate = Evaluator(tiny_config, models.build(tiny_config.model), pairs)
  assert evaluate.contexts() == (None,)
  assert evaluate.batch_rows(evaluate.arrays('validation'))[0] == 30 // 7
  assert evaluate.batch_rows(evaluate.arrays('test_long'))[0] == 30 // 14


def test_sample_lengths_default_to_halves_of_the_context():
  e = config_lib.base_config().eval
  assert sample_lengths(e, 17) == (8, 9)
  e.sample_prompt, e.sample_len = 14000, 2000
  assert sample_lengths(e, 4096) == (14000, 2000)


def _hand_nll(model, params, stream, context: int, windows: int) -> float:
  """Mean next-token nll over the first `windows` non-overlapping windows of
  `stream`, the model applied to each window on its own."""
  total = 0.0
  for i in range(windows):
    x = stream[i * context:(i + 1) * context]
    y = stream[i * context + 1:(i + 1) * context + 1]
    logits = model.apply({'params': params}, x[None])[0]
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64))
    total -= float(np.sum(np.asarray(logp)[np.arange(context), y]))
  return total / (windows * context)


def _hand_greedy(model, params, prompt, steps):
  """The greedy continuation by full passes over prompt + what is generated
  (causal: the positions after the last token do not change its logits): [steps]."""
  ids = np.zeros(len(prompt) + steps, np.int32)
  ids[:len(prompt)] = prompt
  apply = jax.jit(lambda ids: model.apply({'params': params}, ids[None])[0])
  for t in range(len(prompt), len(ids)):
    ids[t] = int(np.argmax(apply(ids)[t - 1]))
  return ids[len(prompt):].tolist()


def test_long_context_lm_run_scores_each_context_and_writes_the_sample(
    tfds_dir, shared_data, tmp_path):
  """A 2-step char LM on Tiny Shakespeare on the long-context path: ALiBi, no
  absolute positions, attention dropout, and the chunked kernel everywhere
  (dense_max_mib=0, chunk 8: training with dropout, evaluation, the prompt
  and each decoding step). Evaluated at its context 16 and at 64:
  metrics.jsonl holds loss and loss_64 (etc.), each the mean nll of the
  restored model applied to the first windows by hand on the dense kernel;
  sample.txt holds the greedy continuation of eval.sample_len characters
  that full dense passes give."""
  c = _lm_config(contexts=(64,), batch_tokens=48, max_examples=5, sample_prompt=40,
                 sample_len=24, num_examples_to_log=1)
  c.model.vocab_size = 0
  c.model.positions, c.model.attention, c.model.attention_dropout_rate = 'none', 'alibi', 0.1
  c.model.attention_kwargs.update(kernel='auto', dense_max_mib=0, chunk_size=8)
  c.data.manual_dir, c.data.data_dir = os.path.join(shared_data, 'tiny_shakespeare'), tfds_dir
  c.train.num_steps, c.train.batch_size, c.train.label_smoothing = 2, 4, 0.0
  c.train.log_every = c.train.eval_every = c.train.checkpoint_every = 2
  workdir = str(tmp_path / 'lm')
  loop.train_and_evaluate(c, workdir)

  record, = [r for r in metrics.read(workdir) if r['split'] == 'eval']
  dense = config_lib.from_json(config_lib.to_json(c))
  dense.model.vocab_size = data.load(c.data).vocab_size
  dense.model.attention_kwargs.kernel = 'dense'
  model = models.build(dense.model)
  example = {'inputs': np.ones((1, 16), np.int32), 'targets': np.ones((1, 16), np.int32)}
  ckpt = checkpoints.Checkpointer(workdir, keep=1)
  state, _ = ckpt.restore(state_lib.create(model, dense, example, jax.random.key(0)))
  ckpt.close()
  dataset = data.load(c.data)
  stream = dataset.splits['validation']
  for context, suffix in ((16, ''), (64, '_64')):
    nll = _hand_nll(model, state.params, stream, context, windows=5)
    assert record[f'nll{suffix}'] == pytest.approx(nll, rel=1e-5)
    assert record[f'loss{suffix}'] == pytest.approx(nll, rel=1e-5)  # no label smoothing
    assert record[f'bpc{suffix}'] == pytest.approx(nll / np.log(2), rel=1e-5)
  with open(os.path.join(workdir, 'sample.txt')) as f:
    sample = f.read()
  assert sample == dataset.tokenizer.decode(_hand_greedy(model, state.params, stream[:40], 24))


def test_teacher_forced_exact_match_is_greedy_decodings_and_scores_each_test_length(
    tiny_config):
  """eval.sequence_accuracy='teacher_forced' against decoding (the reference):
  the same exact match per example and per test length, on a split whose
  targets are, row by row, the model's own greedy output (exact), that output
  with one token changed, or the task's answer (a random model misses it).
  The answer-token accuracy per length against a numpy count over the
  model's teacher-forced logits (EOS not counted, an empty answer scored as
  its exact match), with a last eval batch that is part padding."""
  c = tiny_config
  c.data.task, c.data.max_len, c.data.test_lengths = 'reverse_string', 6, (8, 10)
  c.data.num_train, c.data.num_eval = 64, 12
  c.eval.batch_size = 5
  dataset = data.load(c.data)
  c.model.vocab_size = dataset.vocab_size
  lengths = dataset.length_groups['test_long']
  long = dataset.splits['test_long']
  assert sorted(lengths.tolist()) == [8] * 6 + [10] * 6
  assert ((long['inputs'] != 0).sum(1) == lengths + 1).all()  # the task's length + EOS

  model = models.build(c.model)
  params = model.init(jax.random.key(3), long['inputs'][:1], long['targets'][:1])['params']
  decoded = Evaluator(c, model, dataset)
  greedy = np.asarray(decoded._decoder(long['targets'].shape[1], 1)(params, long['inputs']))
  targets = long['targets'].copy()
  targets[0::3] = greedy[0::3]  # exact
  targets[1::3] = greedy[1::3]
  targets[1::3, 1] = np.where(greedy[1::3, 1] == 3, 4, 3)  # one answer token changed
  targets[5, :] = 0
  targets[5, 0] = 2  # an empty answer: EOS alone
  dataset.splits['test_long'] = {'inputs': long['inputs'], 'targets': targets}

  reference = decoded(params, 'test_long')
  c.eval.sequence_accuracy = 'teacher_forced'
  forced = Evaluator(c, model, dataset)(params, 'test_long')
  per_length = [k for k in reference if k.startswith('sequence_accuracy')]
  assert len(per_length) == 3  # overall, 8, 10
  for k in per_length:
    assert forced[k] == reference[k], k
  assert 0 < forced['sequence_accuracy'] < 1

  logits = np.asarray(model.apply({'params': params}, long['inputs'],
                                  np.pad(targets, ((0, 0), (1, 0)), constant_values=1)[:, :-1]))
  hits = []
  for row, t in zip(np.argmax(logits, -1), targets):
    answer = (t != 0) & (t != 2)
    exact = np.all((row == t) | (t == 0))
    hits.append(np.mean(row[answer] == t[answer]) if answer.any() else float(exact))
  hits = np.array(hits)
  for n in (8, 10):
    assert forced[f'accuracy_len{n}'] == pytest.approx(hits[lengths == n].mean())
  assert forced['mean_length_accuracy'] == pytest.approx(
      (hits[lengths == 8].mean() + hits[lengths == 10].mean()) / 2)
