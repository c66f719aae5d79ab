"""load(config.data) -> Dataset: prepares a task's data once and reads it back.

Three kinds of data:
  'seq2seq'     splits of padded arrays {'inputs', 'targets'} [N, L] (synthetic
                tasks, translation: multi30k, wmt14/17 from the TFDS catalog);
  'lm'          splits as one token stream [T] (tiny_shakespeare, lm1b);
  'two_stream'  splits {'inputs' [N, n], 'inputs_b' [N, m], 'targets' [N, 1]}:
                two token streams and a class (data/two_stream.py).
Text is tokenized here (sentencepiece, char or byte; tokenizers.py) with the
tokenizer trained once on the training split and cached next to the data.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any

import numpy as np

from flaxformer_lite.data import corpora, pipeline, shared, synthetic, tokenizers, two_stream
from flaxformer_lite.data.corpora import DataError

REAL_TASKS = ('multi30k', 'tiny_shakespeare', 'tfds')
BUILDER_NAMES = {'multi30k': 'multi30k', 'tiny_shakespeare': 'tiny_shakespeare_char'}
TASKS = synthetic.TASK_NAMES + two_stream.TASKS + REAL_TASKS
KINDS = ('seq2seq', 'lm', 'two_stream')
OVERLONG = ('drop', 'truncate')
log = logging.getLogger('flaxformer_lite')


@dataclasses.dataclass
class Dataset:
  """vocab_size: largest id + 1; kind: 'seq2seq' | 'lm' | 'two_stream'.

  splits: name -> {'inputs': [N, L], 'targets': [N, L]} (seq2seq) or a token
  stream [T] (lm). dropped: training examples dropped or truncated for
  length, by split. bad_lines: lines the builder skipped ({split: {reason:
  count}}). tokenizer: encode/decode text (None for synthetic tasks).
  references: split -> the raw target texts, row for row (text seq2seq).
  length_groups: split -> each row's task length [N], for a split whose
  metrics are also reported per length (test_long of data.test_lengths).
  num_classes: the classes of a 'two_stream' task's label (else 0).
  mask_id: the tokenizer's [MASK] id, for masked-LM training (0: none; the
  model then reserves an id of its own).
  """
  vocab_size: int
  splits: dict
  dropped: dict
  kind: str = 'seq2seq'
  tokenizer: Any = None
  references: dict = dataclasses.field(default_factory=dict)
  bad_lines: dict = dataclasses.field(default_factory=dict)
  length_groups: dict = dataclasses.field(default_factory=dict)
  num_classes: int = 0
  mask_id: int = 0


def default_data_dir() -> str:
  return os.environ.get('TFDS_DATA_DIR') or os.path.expanduser('~/tensorflow_datasets')


def load(data_config, tokenizer_from: str = '') -> Dataset:
  """Prepares (once) and reads the dataset named by config.data
  (data.tokenizer=pretrained: with the tokenizer of checkpoint `tokenizer_from`).

  In a multi-process job process 0 prepares it (TFDS files, the tokenizer)
  while the others wait, then they read what it wrote: two processes that
  both found it missing would both write it, and the second's rename onto
  the first's fails. Independent processes take turns by a lock on the data dir.
  """
  import jax  # not at module level: loading a tokenizer needs no JAX
  if jax.process_count() == 1:
    with data_dir_lock(data_config['data_dir'] or default_data_dir()):
      return _load(data_config, tokenizer_from)
  from jax.experimental import multihost_utils
  dataset = _load(data_config, tokenizer_from) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices('flaxformer_lite: dataset prepared')
  return dataset if dataset is not None else _load(data_config, tokenizer_from)


@contextlib.contextmanager
def data_dir_lock(data_dir: str):
  """Holds an exclusive lock on data_dir: independent processes sharing it (a
  sweep's parallel runs) prepare a dataset one at a time, and the later ones
  read what the first wrote instead of racing it. No-op where fcntl is missing."""
  try:
    import fcntl
  except ImportError:
    yield
    return
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, '.flaxformer_lite.lock'), 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _load(data_config, tokenizer_from: str = '') -> Dataset:
  task = data_config['task']
  if task not in TASKS:
    raise DataError(f'data.task={task!r} is not a known task; valid: {", ".join(TASKS)}')
  data_dir = data_config['data_dir'] or default_data_dir()
  if task in synthetic.TASK_NAMES:
    return _load_synthetic(data_config, data_dir)
  if task in two_stream.TASKS:
    return _load_two_stream(data_config)
  d = data_config
  manual_dir = os.path.abspath(os.path.expanduser(d['manual_dir'])) if d['manual_dir'] else ''
  if not manual_dir:
    manual_dir = shared.manual_dir(task)
    if manual_dir:
      log.info('data: %s from %s', task, manual_dir)
  if task == 'multi30k':
    builder = corpora.multi30k(data_dir, manual_dir)
  elif task == 'tiny_shakespeare':
    builder = corpora.tiny_shakespeare(data_dir, manual_dir)
  else:
    builder = corpora.catalog(d['tfds_name'], data_dir, manual_dir)
  features = set(builder.info.features.keys())
  bad = corpora.bad_line_counts(builder)
  for split, counts in bad.items():
    if any(counts.values()):
      log.warning('%s %s: skipped lines %s', builder.name, split, counts)
  if {d['source_lang'], d['target_lang']} <= features:
    return _load_translation(d, builder, bad, tokenizer_from)
  if 'text' in features:
    return _load_lm(d, builder, bad, tokenizer_from)
  raise DataError(
      f'{builder.name} has features {sorted(features)}: neither a translation pair '
      f'data.source_lang={d["source_lang"]!r} / data.target_lang={d["target_lang"]!r} '
      f'nor a "text" feature for language modelling')


def _load_synthetic(d, data_dir) -> Dataset:
  """The generated splits (prepared as TFDS files, or in memory without TFDS)
  padded to fixed widths: train, validation and test to one width (data.max_len
  + EOS for reverse/copy/sort, else the longest of the three), test_long to its
  own (twice that, else its longest)."""
  if synthetic.tfds is None:
    log.info('data: %s generated in memory (tensorflow_datasets is not installed)', d['task'])
    examples = synthetic.in_memory(d)
  else:
    builder = synthetic.builder(d, data_dir)
    corpora.prepare(builder)
    examples = corpora.read_examples(builder, ('train', 'validation', 'test', 'test_long'))

  def longest(splits, feature):
    return max(len(ex[feature]) for s in splits for ex in examples[s])

  widths = {}
  for group in (('train', 'validation', 'test'), ('test_long',)):
    for split in group:
      if d['task'] in synthetic.TASKS and not d.get('test_lengths'):
        width = (2 if split == 'test_long' else 1) * (d['max_len'] + 1)
        widths[split] = {'inputs': width, 'targets': width}
      else:
        widths[split] = {k: longest(group, k) for k in ('inputs', 'targets')}
  splits, dropped = {}, {}
  for split, exs in examples.items():
    splits[split], dropped[split] = pipeline.pad_examples(exs, widths[split])
    if dropped[split]:
      log.warning('%s: dropped %d over-long examples', split, dropped[split])
  groups = {}
  if d.get('test_lengths'):
    groups['test_long'] = np.array([ex['length'] for ex in examples['test_long']], np.int32)
  return Dataset(synthetic.vocab_size(d), splits, dropped, length_groups=groups)


def _load_two_stream(d) -> Dataset:
  """Generated in memory (a second at most): train, validation and test."""
  n, m, k = d['max_len'], d['num_claims'], d['num_symbols']
  splits = {}
  for split_seed, split in enumerate(('train', 'validation', 'test')):
    num = d['num_train'] if split == 'train' else d['num_eval']
    a, b, label = two_stream.examples(d['task'], num, n=n, m=m, k=k, seed=[d['seed'], split_seed])
    splits[split] = {'inputs': a, 'inputs_b': b, 'targets': label[:, None]}
  return Dataset(two_stream.vocab_size(n, k), splits, {s: 0 for s in splits}, 'two_stream',
                 num_classes=two_stream.num_classes(m))


def _tokenizer(d, builder, texts_fn, tokenizer_from=''):
  """data.tokenizer's tokenizer ('pretrained': the one of the checkpoint
  `tokenizer_from`, model.init_from)."""
  kind = d['tokenizer']
  if kind == 'pretrained':
    from flaxformer_lite import pretrained
    try:
      tokenizer = pretrained.tokenizer(tokenizer_from)
    except pretrained.PretrainedError as e:
      raise DataError(f'data.tokenizer=pretrained: {e}') from None
  else:
    suffix = {'sentencepiece': f'spm_{d["spm_model_type"]}_{d["vocab_size"]}',
              'char': 'char', 'byte': 'byte'}.get(kind, kind)
    try:
      tokenizer = tokenizers.create(kind, cache_prefix=os.path.join(builder.data_dir, suffix),
                                    texts_fn=texts_fn, vocab_size=d['vocab_size'],
                                    model_type=d['spm_model_type'])
    except ValueError as e:
      raise DataError(f'data.tokenizer: {e}') from None
  log.info('%s', tokenizer_line(d, tokenizer, tokenizer_from))
  return tokenizer


def tokenizer_line(d, tokenizer, tokenizer_from='') -> str:
  """The log's data line for a corpus as tokenized: the task, the tokenizer
  that was used (a pretrained checkpoint's by its path; the TFDS builder's
  name, such as tiny_shakespeare_char, says nothing about it) and its
  vocabulary."""
  how = {'pretrained': f'the tokenizer of {tokenizer_from}', 'char': 'characters',
         'byte': 'bytes', 'sentencepiece': f'sentencepiece ({d["spm_model_type"]})'
         }.get(d['tokenizer'], d['tokenizer'])
  return (f'data: {d["task"]} tokenized by {how} ({type(tokenizer).__name__}), vocabulary '
          f'{tokenizer.vocab_size:,}')


def _encode(tokenizer, text: str, max_len: int | None, overlong: str):
  """Text -> ids + EOS (the tokenizer's); (ids, whether it was over max_len
  tokens + EOS)."""
  ids = tokenizer.encode(text)
  long = max_len is not None and len(ids) > max_len
  if long and overlong == 'truncate':
    ids = ids[:max_len]
  return np.append(ids, tokenizers.end_id(tokenizer)).astype(np.int32), long


def _splits(builder) -> list[str]:
  """The builder's splits among train/validation/test. (Under
  tfds.testing.mock_data a builder has no split metadata: all three.)"""
  known = set(builder.info.splits) or {'train', 'validation', 'test'}
  return [s for s in ('train', 'validation', 'test') if s in known]


def _load_translation(d, builder, bad, tokenizer_from='') -> Dataset:
  """Sentence pairs -> padded id arrays. Training pairs longer than
  data.max_len tokens (+ EOS) are dropped or truncated (data.overlong) and
  counted; evaluation splits keep every pair at its full length."""
  src, tgt = d['source_lang'], d['target_lang']
  text = {split: corpora.read_pairs(builder, split, src, tgt) for split in _splits(builder)}
  if 'validation' not in text or 'test' not in text:  # e.g. lm1b-like catalogs
    raise DataError(f'{builder.name} has splits {sorted(builder.info.splits)}; a translation '
                    f'task needs train, validation and test')
  tokenizer = _tokenizer(d, builder, lambda: text['train'][0] + text['train'][1],
                         tokenizer_from)
  splits, dropped, references = {}, {}, {}
  for split, (sources, targets) in text.items():
    train = split == 'train'
    examples, kept, long = [], [], 0
    for s, t in zip(sources, targets):
      (x, lx), (y, ly) = [_encode(tokenizer, v, d['max_len'] if train else None,
                                  d['overlong']) for v in (s, t)]
      long += lx or ly
      if not (train and (lx or ly) and d['overlong'] == 'drop'):
        examples.append({'inputs': x, 'targets': y})
        kept.append(t)
    width = max(max(len(e['inputs']), len(e['targets'])) for e in examples)
    splits[split], _ = pipeline.pad_examples(examples, {'inputs': width, 'targets': width})
    dropped[split] = long
    if long:
      log.warning('%s %s: %d pairs longer than data.max_len=%d tokens were %s',
                  builder.name, split, long, d['max_len'],
                  'dropped' if d['overlong'] == 'drop' else 'truncated')
    references[split] = kept
  return Dataset(tokenizer.vocab_size, splits, dropped, 'seq2seq', tokenizer, references, bad)


def _load_lm(d, builder, bad, tokenizer_from='') -> Dataset:
  """Texts -> one token stream per split (EOS between documents)."""
  text = {split: corpora.read_text(builder, split) for split in _splits(builder)}
  if 'validation' not in text and 'test' in text:  # lm1b: train and test only
    log.warning('%s has no validation split; evaluating on test', builder.name)
    text['validation'] = text.pop('test')
  if 'train' not in text or 'validation' not in text:
    raise DataError(f'{builder.name} has splits {sorted(builder.info.splits)}; language '
                    'modelling needs train and validation (or test)')
  # A char vocabulary covers every split (as nanoGPT's); subwords learn from train only.
  texts_fn = (lambda: [t for v in text.values() for t in v]) if d['tokenizer'] == 'char' \
      else (lambda: text['train'])
  tokenizer = _tokenizer(d, builder, texts_fn, tokenizer_from)
  splits = {}
  for split, texts in text.items():
    pieces = [tokenizer.encode(t) for t in texts]
    if len(pieces) > 1:
      end = tokenizers.end_id(tokenizer)
      pieces = [np.append(p, end) for p in pieces]
    splits[split] = np.concatenate(pieces).astype(np.int32)
  return Dataset(tokenizer.vocab_size, splits, {s: 0 for s in splits}, 'lm', tokenizer,
                 {}, bad, mask_id=getattr(tokenizer, 'mask_id', 0))

