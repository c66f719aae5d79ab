"""Evaluator: a model's metrics on a whole split (validation, test, test_long),
by objective, with decoding (greedy or beam) and BLEU for translation."""
from __future__ import annotations

import functools
import logging
import os

import jax
import numpy as np

from flaxformer_lite import compilation, data, decoding, models, tokens
from flaxformer_lite.data import tokenizers
from flaxformer_lite.train import metrics as metrics_lib, partitioning, preemption, steps


log = logging.getLogger('flaxformer_lite')


# Tokens of a long sample prompt that the log shows: its end, which the sample continues.
LOGGED_PROMPT = 200


def sample_lengths(eval_config, context: int) -> tuple[int, int]:
  """(prompt, continuation) tokens of a language model's greedy sample:
  eval.sample_prompt and eval.sample_len, 0 meaning half of `context`
  (data.max_len) and the rest of it."""
  prompt = eval_config.sample_prompt or max(1, context // 2)
  return prompt, eval_config.sample_len or context - context // 2


class Evaluator:
  """Whole-split evaluation, by objective.

  seq2seq: teacher-forced loss/perplexity/accuracy, then decoding (greedy, or
    beam search with `beam_size` > 1): sequence_accuracy for token tasks,
    sacreBLEU of the detokenized output against the raw references for text.
  lm: loss, perplexity, bits_per_token (bpc for char/byte tokenizers) over
    the split's non-overlapping windows of data.max_len tokens, and of each
    other length in eval.contexts (its metrics suffixed _<length>); with
    log_examples, a greedy sample (`sample_lengths`) logged and its text
    written to `sample_path`.
  mlm: loss/accuracy on masked positions; the masks are drawn from a fixed
    key, so every evaluation scores the same ones.
  classify: loss and accuracy, one prediction per example.
  Batches hold eval.batch_size examples, or eval.batch_tokens tokens. The
  metrics step is compiled once per batch shape (`compiled_step`): the
  memory guard (train/loop.py) analyses the executables evaluation runs.
  """

  def __init__(self, config, model, dataset, place_batch=None, sample_path=None):
    self.config, self.dataset, self.sample_path = config, dataset, sample_path
    self.place_batch = place_batch or (lambda batch: batch)  # Partitioner.place_eval_batch
    self.objective = steps.OBJECTIVES[config.model.type]
    # Token tasks scored by teacher forcing: the metrics step gives each row's score too.
    self.row_scores = (self.objective == 'seq2seq' and dataset.tokenizer is None and
                       config.eval.sequence_accuracy == 'teacher_forced')
    self.metrics_step = jax.jit(functools.partial(
        steps.eval_step, apply_fn=model.apply, label_smoothing=config.train.label_smoothing,
        objective=self.objective, mlm_rate=config.data.mlm_rate,
        vocab_size=config.model.vocab_size, data_vocab_size=dataset.vocab_size,
        mask_id=dataset.mask_id, row_scores=self.row_scores,
        lm_mask=models.model_mask(config.model)))
    self.model, self.decode_model = model, None
    if self.objective in ('seq2seq', 'lm'):
      self.decode_model = models.build(config.model, decode=True)
    self._decoders, self._arrays, self._compiled, self._lowered = {}, {}, {}, {}

  def contexts(self) -> tuple:
    """The window lengths a token stream is scored at (data.max_len, then
    eval.contexts' others); (None,) for sentence pairs."""
    if self.dataset.kind != 'lm':
      return (None,)
    return tuple(dict.fromkeys((self.config.data.max_len, *self.config.eval.contexts)))

  def arrays(self, split, context=None) -> dict:
    """A split as padded arrays, cached; a token stream as its non-overlapping
    windows of `context` tokens (None: data.max_len)."""
    if (split, context) not in self._arrays:
      values = self.dataset.splits[split]
      if self.dataset.kind == 'lm':
        values = data.lm_eval_arrays(values, context or self.config.data.max_len)
      if self.config.eval.max_examples:
        values = {k: v[:self.config.eval.max_examples] for k, v in values.items()}
      self._arrays[split, context] = values
    return self._arrays[split, context]

  def batch_rows(self, arrays) -> tuple[int, int]:
    """(examples per batch, rows per batch): eval.batch_size examples, or with
    eval.batch_tokens > 0 as many as fit in it at the arrays' width (at least
    one); the rows add weight-0 PAD rows so that a batch splits over the
    devices, and the metrics do not depend on the device count."""
    tokens = self.config.eval.batch_tokens
    size = max(1, tokens // arrays['inputs'].shape[1]) if tokens else self.config.eval.batch_size
    return size, partitioning.padded_rows(size, jax.device_count())

  def _batches(self, split, context=None):
    arrays = self.arrays(split, context)
    size, rows = self.batch_rows(arrays)
    return data.eval_batches(arrays, size, rows=rows)

  def compiled_step(self, params, split, context=None):
    """The metrics step compiled for the split's batches at `context`: once per
    batch shape, however many splits and evaluations share it."""
    batch = self.place_batch(next(self._batches(split, context)))
    shape = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if shape not in self._compiled:
      self._lowered[shape], self._compiled[shape] = compilation.compile_logged(
          f'eval step ({split})', self.metrics_step, params, batch, jax.random.key(0))
    return self._compiled[shape]

  def sample_step(self, params, split):
    """(the greedy sample's generation compiled for this split's prompt, the
    prompt [1, P]: the split's first tokens). The decoding cache holds
    prompt + continuation tokens (decoding.greedy_generate)."""
    prompt_len, length = sample_lengths(self.config.eval, self.config.data.max_len)
    prompt = self.dataset.splits[split][None, :prompt_len]
    if ('sample', prompt.shape) not in self._compiled:
      generate = jax.jit(functools.partial(decoding.greedy_generate, self.decode_model,
                                           max_steps=length,
                                           eos_id=tokenizers.end_id(self.dataset.tokenizer)))
      key = ('sample', prompt.shape)
      self._lowered[key], self._compiled[key] = compilation.compile_logged(
          f'greedy sample ({length} tokens)', generate, params, prompt)
    return self._compiled['sample', prompt.shape], prompt

  def lowered(self, compiled):
    """The jax Lowered that `compiled` (compiled_step's or sample_step's) was
    compiled from: the memory guard compiles it again to read its buffers."""
    return next(self._lowered[key] for key, c in self._compiled.items() if c is compiled)

  def _decoder(self, max_len, beam_size):
    key = (max_len, beam_size)
    if key not in self._decoders:
      self._decoders[key] = jax.jit(functools.partial(
          steps.decode_step, model=self.model, decode_model=self.decode_model,
          max_len=max_len, beam_size=beam_size, alpha=self.config.eval.beam_alpha))
    return self._decoders[key]

  def decode_len(self, arrays) -> int:
    """Tokens to decode: eval.max_decode_len, else the target width for token
    tasks and 1.5 x the source width + 10 for text (within model.max_len for
    learned positions)."""
    e, m = self.config.eval, self.config.model
    if e.max_decode_len:
      return e.max_decode_len
    if self.dataset.tokenizer is None:
      return arrays['targets'].shape[1]
    n = int(1.5 * arrays['inputs'].shape[1]) + 10
    return min(n, m.max_len) if m.positions == 'learned' else n

  def __call__(self, params, split, *, beam_size=1, log_examples=0) -> dict:
    if self.objective == 'seq2seq':
      return self._translation(params, split, beam_size, log_examples)
    out = {}
    for context in self.contexts():
      suffix = '' if context in (None, self.config.data.max_len) else f'_{context}'
      out.update({k + suffix: v for k, v in self.window_metrics(params, split, context).items()})
    if self.objective == 'lm' and log_examples:
      self._log_sample(params, split)
    return out

  def window_metrics(self, params, split, context: int) -> dict:
    """A token stream's metrics over its non-overlapping windows of `context`
    tokens (every token but the first predicted once; the first
    eval.max_examples windows if set): loss, nll, perplexity, accuracy, and
    for a causal LM bits_per_token (bpc for characters or bytes)."""
    out = metrics_lib.summarise(self._sums(params, split, context))
    if self.objective == 'lm':
      out['bits_per_token'] = out['nll'] / np.log(2.0)
      if isinstance(self.dataset.tokenizer, (tokenizers.CharTokenizer, tokenizers.ByteTokenizer)):
        out['bpc'] = out['bits_per_token']
    return out

  def _sums(self, params, split, context=None, each_batch=None):
    """The metric sums over the split's batches; each_batch(i, batch, rows),
    when given, is called with every placed batch (rows: its row scores, or
    None; steps.eval_step)."""
    step, sums = self.compiled_step(params, split, context), None
    eval_rng = jax.random.key(self.config.seed + 1)
    for i, batch in enumerate(self._batches(split, context)):
      batch = self.place_batch(batch)
      s, rows = step(params, batch, jax.random.fold_in(eval_rng, i)), None
      if self.row_scores:
        s, rows = s
      # One batch in flight: a signal stops the evaluation within a batch.
      preemption.wait(sums)
      sums = s if sums is None else metrics_lib.add_sums(sums, s)
      if each_batch:
        each_batch(i, batch, rows)
    return preemption.wait(sums)  # the last batch too: one batch can take most of a split

  def _translation(self, params, split, beam_size, log_examples) -> dict:
    """Teacher-forced metrics, then the decoded split scored against its
    targets; with eval.sequence_accuracy='teacher_forced' (token tasks) the
    exact match of greedy decoding from one teacher-forced pass instead."""
    arrays = self.arrays(split)
    if self.row_scores:
      scores = []

      def score(i, batch, rows):
        real = self._real(arrays, i)
        scores.append(np.stack([np.asarray(partitioning.to_host(r), np.int64)[:real]
                                for r in preemption.wait(rows)], axis=1))

      out = metrics_lib.summarise(self._sums(params, split, each_batch=score))
      right, answer, exact = np.concatenate(scores).T
      # An empty answer (the target is EOS alone) scores as its exact match.
      accuracy = np.where(answer > 0, right / np.maximum(answer, 1), exact)
      out.update(self._sequence_accuracy(split, exact.astype(bool), accuracy))
      return out
    decoder = self._decoder(self.decode_len(arrays), beam_size)
    predicted = []

    def decode(i, batch, rows):
      predicted.append(partitioning.to_host(preemption.wait(decoder(params, batch['inputs'])))[
          :self._real(arrays, i)])

    out = metrics_lib.summarise(self._sums(params, split, each_batch=decode))
    out.update(self._score(split, arrays, np.concatenate(predicted), log_examples))
    return out

  def _real(self, arrays, i) -> int:
    """The examples of batch i that are the split's (not padding rows)."""
    size, _ = self.batch_rows(arrays)
    return min(size, len(arrays['inputs']) - i * size)

  def _sequence_accuracy(self, split, same, row_accuracy=None) -> dict:
    """sequence_accuracy from each example's exact match `same` [N] bool; for
    a split of several test lengths also per length, as the papers tabulate:
    sequence_accuracy_len<L>, and with `row_accuracy` [N] (each example's
    fraction of right answer tokens, EOS not counted) accuracy_len<L> and
    their mean over the lengths, mean_length_accuracy."""
    out = {'sequence_accuracy': float(np.mean(same))}
    if split in self.dataset.length_groups:
      lengths = self.dataset.length_groups[split][:len(same)]
      for n in np.unique(lengths):
        out[f'sequence_accuracy_len{n}'] = float(np.mean(same[lengths == n]))
        if row_accuracy is not None:
          out[f'accuracy_len{n}'] = float(np.mean(row_accuracy[lengths == n]))
      if row_accuracy is not None:  # Deletang et al.'s score: lengths weigh the same
        out['mean_length_accuracy'] = float(np.mean(
            [out[f'accuracy_len{n}'] for n in np.unique(lengths)]))
    return out

  def _score(self, split, arrays, predicted, log_examples) -> dict:
    num = len(arrays['inputs'])
    tokenizer = self.dataset.tokenizer
    if tokenizer is None:  # token tasks: exact match of the whole sequence
      targets = arrays['targets']
      width = min(predicted.shape[1], targets.shape[1])
      same = np.all(predicted[:, :width] == targets[:, :width], axis=1)
      for i in range(log_examples):
        log.info('  input %s\n  target %s\n  decoded %s', _tokens(arrays['inputs'][i]),
                 _tokens(targets[i]), _tokens(predicted[i]))
      return self._sequence_accuracy(split, same)
    hypotheses = [tokenizer.decode(row) for row in predicted]
    references = self.dataset.references[split][:num]
    for i in range(log_examples):
      log.info('  source    %s\n  reference %s\n  decoded   %s',
               tokenizer.decode(arrays['inputs'][i]), references[i], hypotheses[i])
    return {'bleu': metrics_lib.bleu(hypotheses, references)}

  def _log_sample(self, params, split):
    """Logs a greedy continuation of the split's first tokens (the end of a
    long prompt) and writes its text to sample_path."""
    generate, prompt = self.sample_step(params, split)
    ids = np.asarray(preemption.wait(generate(params, prompt)))
    continuation = self.dataset.tokenizer.decode(ids[0])
    shown = prompt[0, -LOGGED_PROMPT:]
    log.info('  prompt (%d tokens%s) %r\n  greedy %r', prompt.shape[1],
             f', the last {len(shown)}' if len(shown) < prompt.shape[1] else '',
             self.dataset.tokenizer.decode(shown), continuation)
    if self.sample_path and jax.process_index() == 0:
      # Whole or not at all: a re-run keeps a finished evaluation's sample.
      with open(self.sample_path + '.tmp', 'w') as f:
        f.write(continuation)
      os.replace(self.sample_path + '.tmp', self.sample_path)


def _tokens(ids) -> str:
  return ' '.join(str(int(t)) for t in ids if t != tokens.PAD_ID)
