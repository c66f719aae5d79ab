"""The real corpora end to end: Tiny Shakespeare LM and MLM, Multi30k translation.

Tiny models and a few steps: these check the plumbing (data -> objective ->
metrics), not the quality, which experiments/*.py measure.
"""
import collections
import gzip
import math
import os

import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import data, models
from flaxformer_lite.train import evaluation, loop, metrics


def _tiny(tfds_dir, shared_data, task, model_type):
  c = config_lib.base_config()
  c.model.type = model_type
  c.model.d_model, c.model.num_heads, c.model.mlp_dim = 32, 2, 64
  c.model.num_encoder_layers = c.model.num_decoder_layers = 1
  c.model.dropout_rate = 0.0
  c.train.num_steps, c.train.warmup_steps = 20, 5
  c.train.schedule, c.train.learning_rate = 'warmup_cosine', 3e-3
  c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 10, 20, 20
  c.data.task = task
  c.data.manual_dir = os.path.join(shared_data, task)
  c.data.data_dir = tfds_dir
  c.eval.num_examples_to_log = 1
  if task == 'tiny_shakespeare':
    c.data.tokenizer, c.data.max_len = 'char', 32
    c.train.batch_size, c.eval.batch_size = 16, 64
    c.train.label_smoothing = 0.0
  else:
    c.data.vocab_size, c.data.max_len = 300, 24  # few buckets: few compilations
    c.train.batch_tokens, c.eval.batch_size = 1024, 32
    c.train.num_steps = c.train.eval_every = c.train.checkpoint_every = 10
    c.eval.max_examples, c.eval.beam_size = 32, 2
  return c


def test_char_lm_on_tiny_shakespeare(tfds_dir, shared_data, tmp_path):
  c = _tiny(tfds_dir, shared_data, 'tiny_shakespeare', 'decoder_only')
  results = loop.train_and_evaluate(c, str(tmp_path / 'lm'))
  with open(os.path.join(shared_data, 'tiny_shakespeare', 'input.txt')) as f:
    text = f.read()
  # the vocabulary is the file's characters (65) after PAD, BOS, EOS
  assert c.model.vocab_size == 3 + len(set(text)) == 68
  ev = results['eval']
  assert ev['bpc'] == pytest.approx(ev['nll'] / math.log(2))
  assert ev['perplexity'] == pytest.approx(math.exp(ev['nll']), rel=1e-5)
  assert ev['nll'] < math.log(68) - 0.5  # better than uniform after 20 steps
  train = [r for r in metrics.read(str(tmp_path / 'lm')) if r['split'] == 'train']
  assert train[-1]['loss'] < train[0]['loss']


def test_lm_eval_scores_every_validation_character_once(tfds_dir, shared_data, caplog):
  c = _tiny(tfds_dir, shared_data, 'tiny_shakespeare', 'decoder_only')
  with caplog.at_level('INFO', logger='flaxformer_lite'):
    ds = data.load(c.data)
  assert 'data: tiny_shakespeare tokenized by characters (CharTokenizer), vocabulary 68' in (
      caplog.text)
  text = open(os.path.join(shared_data, 'tiny_shakespeare', 'input.txt')).read()
  n = len(text)
  assert len(ds.splits['train']) == int(0.9 * n)  # nanoGPT's split
  assert len(ds.splits['validation']) == n - int(0.9 * n)
  assert ds.tokenizer.decode(ds.splits['validation']) == text[int(0.9 * n):]
  windows = data.lm_eval_arrays(ds.splits['validation'], c.data.max_len)
  assert int(np.sum(windows['targets'] != 0)) == len(ds.splits['validation']) - 1


def test_masked_lm_on_tiny_shakespeare(tfds_dir, shared_data, tmp_path):
  c = _tiny(tfds_dir, shared_data, 'tiny_shakespeare', 'encoder_only')
  results = loop.train_and_evaluate(c, str(tmp_path / 'mlm'))
  assert c.model.vocab_size == 68 + 1  # + [MASK]
  ev = results['eval']
  assert np.isfinite(ev['loss']) and ev['nll'] < math.log(68)  # better than uniform
  train = [r for r in metrics.read(str(tmp_path / 'mlm')) if r['split'] == 'train']
  assert train[-1]['loss'] < train[0]['loss']


def _ngrams(words, n):
  return collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def _reference_bleu(hypotheses, references):
  """Papineni et al. 2002 corpus BLEU-4 on whitespace tokens, written out."""
  matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
  for h, r in zip(hypotheses, references):
    h, r = h.split(), r.split()
    hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
    for n in range(1, 5):
      hc, rc = _ngrams(h, n), _ngrams(r, n)
      matches[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
      totals[n - 1] += max(len(h) - n + 1, 0)
  if min(matches) == 0:
    return 0.0
  log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
  brevity = min(0.0, 1 - ref_len / hyp_len)
  return 100 * math.exp(log_precision + brevity)


def test_bleu_is_corpus_bleu():
  refs = ['the cat sat on the mat today', 'a man rides a red bike down the road']
  assert metrics.bleu(refs, refs) == pytest.approx(100.0)
  hyps = ['the cat sat on a mat today', 'a man rides a bike down a road']
  # words only (no punctuation), so 13a tokenization is whitespace splitting
  assert metrics.bleu(hyps, refs) == pytest.approx(_reference_bleu(hyps, refs), rel=1e-6)
  assert metrics.bleu(['ein Hund'], ['ein Hund läuft über die Wiese']) < 20  # brevity


def test_translation_on_multi30k(tfds_dir, shared_data, tmp_path):
  c = _tiny(tfds_dir, shared_data, 'multi30k', 'encoder_decoder')
  workdir = str(tmp_path / 'mt')
  results = loop.train_and_evaluate(c, workdir)
  points = metrics.read(workdir)
  test = [p for p in points if p['split'] == 'test']
  assert len(test) == 1 and 0.0 <= test[0]['bleu'] <= 100.0
  assert 'bleu' in [p for p in points if p['split'] == 'eval'][-1]
  assert results['test']['bleu'] == test[0]['bleu']


def test_translation_scores_detokenized_text_against_the_raw_references(tfds_dir, shared_data):
  """Decoding the reference ids themselves must give BLEU 100 against the raw
  text: ids, detokenization and references line up row for row."""
  c = _tiny(tfds_dir, shared_data, 'multi30k', 'encoder_decoder')
  ds = data.load(c.data)
  c.model.vocab_size = ds.vocab_size
  ev = evaluation.Evaluator(c, models.build(c.model), ds, None)
  arrays = ev.arrays('test')
  scored = ev._score('test', arrays, arrays['targets'], 0)
  assert scored['bleu'] > 99.0  # sentencepiece may normalise a rare character
  with gzip.open(os.path.join(shared_data, 'multi30k', 'test_2016_flickr.de.gz'), 'rt') as f:
    raw = f.read().splitlines()
  assert ds.references['test'] == raw
  assert len(ds.splits['test']['targets']) == 1000  # evaluation splits drop nothing


def test_config_errors_for_real_data_exit_2(run_main, tmp_path, shared_data):
  bad = run_main('--config=experiments/multi30k_cpu.py', '--config.model.type=decoder_only',
                 f'--workdir={tmp_path}/a')
  assert bad.returncode == 2 and "model.type='decoder_only'" in bad.stderr
  assert 'encoder_decoder' in bad.stderr
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'input.txt.gz').write_bytes(b'')  # wrong corpus's file
  missing = run_main('--config=experiments/multi30k_cpu.py', f'--config.data.manual_dir={empty}',
                     f'--workdir={tmp_path}/b')
  assert missing.returncode == 2
  assert 'train.en' in missing.stderr and 'github' in missing.stderr
  assert not os.path.exists(tmp_path / 'b')
  tfds = run_main('--config=experiments/tiny_shakespeare_cpu.py', '--config.data.task=tfds',
                  f'--workdir={tmp_path}/c')
  assert tfds.returncode == 2 and 'data.tfds_name' in tfds.stderr


@pytest.mark.parametrize('name,kind', [('wmt14_translate/de-en', 'seq2seq'), ('lm1b', 'lm')])
def test_tfds_catalog_datasets_load_by_name(tmp_path, name, kind):
  """Offline, with TFDS's mock data: a catalog name becomes tokenized splits."""
  import tensorflow_datasets as tfds
  d = config_lib.base_config().data
  d.task, d.tfds_name, d.data_dir = 'tfds', name, str(tmp_path)
  d.tokenizer = 'byte'
  with tfds.testing.mock_data(num_examples=12):
    ds = data.load(d)
  assert ds.kind == kind and ds.vocab_size == 259
  if kind == 'seq2seq':
    assert set(ds.splits) == {'train', 'validation', 'test'}
    for split, arrays in ds.splits.items():
      # training pairs over data.max_len are dropped and counted; evaluation keeps all
      kept = 12 - ds.dropped[split] if split == 'train' else 12
      assert arrays['inputs'].shape[0] == len(ds.references[split]) == kept
      # rows end with EOS and decode back to the raw target text
      row = arrays['targets'][0]
      assert row[np.sum(row != 0) - 1] == 2
      assert ds.tokenizer.decode(row) == ds.references[split][0]
  else:
    assert {'train', 'validation'} <= set(ds.splits)
    assert ds.splits['train'].ndim == 1 and np.sum(ds.splits['train'] == 2) == 12  # EOS each


def test_overlong_training_pairs_are_dropped_or_truncated_and_counted(tfds_dir, shared_data):
  c = _tiny(tfds_dir, shared_data, 'multi30k', 'encoder_decoder')
  c.data.max_len = 12
  dropped = data.load(c.data)
  raw = {}
  for lang in ('en', 'de'):
    with gzip.open(os.path.join(shared_data, 'multi30k', f'train.{lang}.gz'), 'rt') as f:
      raw[lang] = f.read().splitlines()
  tok = dropped.tokenizer
  too_long = sum(max(len(tok.encode(en)), len(tok.encode(de))) > 12
                 for en, de in zip(raw['en'], raw['de']))
  assert 0 < too_long < 29000
  assert dropped.dropped['train'] == too_long
  assert len(dropped.splits['train']['inputs']) == 29000 - too_long
  assert dropped.splits['train']['inputs'].shape[1] <= 13  # + EOS
  c.data.overlong = 'truncate'
  truncated = data.load(c.data)
  assert truncated.dropped['train'] == too_long  # counted all the same
  rows = truncated.splits['train']['targets']
  assert len(rows) == 29000 and rows.shape[1] == 13
  assert np.all(rows[np.arange(29000), np.sum(rows != 0, axis=1) - 1] == 2)  # EOS kept
  assert len(truncated.splits['test']['inputs']) == 1000  # evaluation splits never cut
