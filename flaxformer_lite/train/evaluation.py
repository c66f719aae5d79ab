"""Evaluator: a model's metrics on a whole split (validation, test, test_long),
by objective, with decoding (greedy or beam) and BLEU for translation."""
from __future__ import annotations

import functools
import logging

import jax
import numpy as np

from flaxformer_lite import data, decoding, models, tokens
from flaxformer_lite.data import tokenizers
from flaxformer_lite.train import metrics as metrics_lib, partitioning, steps


log = logging.getLogger('flaxformer_lite')


class Evaluator:
  """Whole-split evaluation, by objective.

  seq2seq: teacher-forced loss/perplexity/accuracy, then decoding (greedy, or
    beam search with `beam_size` > 1): sequence_accuracy for token tasks,
    sacreBLEU of the detokenized output against the raw references for text.
  lm: loss, perplexity, bits_per_token (bpc for char/byte tokenizers) over
    the split's non-overlapping windows of data.max_len tokens.
  mlm: loss/accuracy on masked positions; the masks are drawn from a fixed
    key, so every evaluation scores the same ones.
  """

  def __init__(self, config, model, dataset, place_batch=None):
    self.config, self.dataset = config, dataset
    self.place_batch = place_batch or (lambda batch: batch)  # Partitioner.place_eval_batch
    self.objective = steps.OBJECTIVES[config.model.type]
    # Each batch of eval.batch_size examples is padded with weight-0 rows to
    # split over the devices: the metrics do not depend on the device count.
    self.rows = partitioning.padded_rows(config.eval.batch_size, jax.device_count())
    self.metrics_step = jax.jit(functools.partial(
        steps.eval_step, apply_fn=model.apply, label_smoothing=config.train.label_smoothing,
        objective=self.objective, mlm_rate=config.data.mlm_rate,
        vocab_size=config.model.vocab_size, data_vocab_size=dataset.vocab_size))
    self.model, self.decode_model = model, None
    if self.objective != 'mlm':
      self.decode_model = models.build(config.model, decode=True)
    self._decoders, self._arrays = {}, {}

  def arrays(self, split) -> dict:
    """A split as padded arrays (LM streams cut into windows), cached."""
    if split not in self._arrays:
      values = self.dataset.splits[split]
      if self.dataset.kind == 'lm':
        values = data.lm_eval_arrays(values, self.config.data.max_len)
      if self.config.eval.max_examples:
        values = {k: v[:self.config.eval.max_examples] for k, v in values.items()}
      self._arrays[split] = values
    return self._arrays[split]

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
    arrays, sums = self.arrays(split), None
    eval_rng = jax.random.key(self.config.seed + 1)
    decode = self.objective == 'seq2seq'
    max_len = self.decode_len(arrays) if decode else 0
    decoder = self._decoder(max_len, beam_size) if decode else None
    predicted, size = [], self.config.eval.batch_size
    for i, batch in enumerate(data.eval_batches(arrays, size, rows=self.rows)):
      batch = self.place_batch(batch)
      s = self.metrics_step(params, batch, jax.random.fold_in(eval_rng, i))
      sums = s if sums is None else metrics_lib.add_sums(sums, s)
      if decode:
        real = min(size, len(arrays['inputs']) - i * size)
        predicted.append(partitioning.to_host(decoder(params, batch['inputs']))[:real])
    out = metrics_lib.summarise(sums)
    if self.objective == 'lm':
      out['bits_per_token'] = out['nll'] / np.log(2.0)
      if isinstance(self.dataset.tokenizer, (tokenizers.CharTokenizer, tokenizers.ByteTokenizer)):
        out['bpc'] = out['bits_per_token']
      if log_examples:
        self._log_sample(params, arrays)
    if decode:
      out.update(self._score(split, arrays, np.concatenate(predicted), log_examples))
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
      return {'sequence_accuracy': float(np.mean(same))}
    hypotheses = [tokenizer.decode(row) for row in predicted]
    references = self.dataset.references[split][:num]
    for i in range(log_examples):
      log.info('  source    %s\n  reference %s\n  decoded   %s',
               tokenizer.decode(arrays['inputs'][i]), references[i], hypotheses[i])
    return {'bleu': metrics_lib.bleu(hypotheses, references)}

  def _log_sample(self, params, arrays):
    """A greedy continuation of the split's first window's first half."""
    context = self.config.data.max_len
    if 'sample' not in self._decoders:
      self._decoders['sample'] = jax.jit(functools.partial(
          decoding.greedy_generate, self.decode_model, max_steps=context - context // 2))
    prompt = arrays['inputs'][:1, :context // 2]
    out = np.asarray(self._decoders['sample'](params, prompt))
    tokenizer = self.dataset.tokenizer
    log.info('  prompt %r\n  greedy %r', tokenizer.decode(prompt[0]),
             tokenizer.decode(out[0]))


def _tokens(ids) -> str:
  return ' '.join(str(int(t)) for t in ids if t != tokens.PAD_ID)
