"""Real text corpora as TFDS builders, written as array_record, read without TensorFlow.

- `multi30k`: Multi30k task 1 (WMT16 multimodal) English-German, raw cased
  untokenized text; features {'en', 'de'}; splits train / validation / test
  (= test_2016_flickr) of 29000 / 1014 / 1000 pairs.
- `tiny_shakespeare`: the char-rnn Tiny Shakespeare text; feature {'text'};
  one example per split: train = the first 90% of the characters,
  validation = the rest (nanoGPT's split).
- `catalog(name)`: any builder of the TFDS catalog ('wmt14_translate/de-en', 'lm1b').

Raw files come from `manual_dir` (each as `X.gz` or plain `X`), or are
downloaded when no manual_dir is given (loading.py first looks for the
shared corpora, shared.py). A download whose host cannot be reached fails
within seconds, naming the file, its URL and `data.manual_dir`, instead of
TFDS's retries with growing waits. Lines that are not valid UTF-8, empty
pairs and unpaired lines are skipped and counted in the dataset's metadata:
`bad_line_counts(builder)` -> {split: {'invalid_utf8': n, 'empty': n, 'unpaired': n}}.
"""
from __future__ import annotations

import contextlib
import gzip
import importlib
import io
import itertools
import logging
import os
import sys
import time
import urllib.error
import urllib.request
import zipfile

import numpy as np

from flaxformer_lite.data import shared

try:
  import tensorflow_datasets as tfds
except ImportError:  # the corpora then fail (require_tfds); the synthetic tasks still run
  tfds = None

log = logging.getLogger('flaxformer_lite')

MULTI30K_URL = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/'
SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/'
MULTI30K_SPLITS = {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}
# TFDS name -> {raw file name: the public URL it is downloaded from}.
RAW_FILES = {
    'multi30k': {f'{stem}.{lang}': f'{MULTI30K_URL}{stem}.{lang}.gz'
                 for stem in MULTI30K_SPLITS.values() for lang in ('en', 'de')},
    'tiny_shakespeare_char': {'input.txt': SHAKESPEARE_URL + 'input.txt'},
}
# Seconds to wait for a download's host before failing with the manual_dir hint.
REACH_TIMEOUT = 10
REASONS = ('invalid_utf8', 'empty', 'unpaired')
CATALOG_EXAMPLES = ('wmt14_translate/de-en', 'wmt17_translate/de-en', 'lm1b')
# What reading a corpus adds to the core requirements: pyproject.toml's lines
# (tests/test_ffl_python.py holds them equal).
TFDS_REQUIREMENTS = "'tensorflow-datasets>=4.9.8' importlib_resources 'array-record>=0.7'"


class DataError(ValueError):
  """Bad or missing data (the CLI exits with code 2)."""


def check_manual_dir(name: str, manual_dir: str) -> dict[str, str]:
  """Raw file name -> its path in manual_dir (`X.gz` or plain `X`); DataError if any is missing."""
  found = {}
  for raw in RAW_FILES[name]:
    for path in (os.path.join(manual_dir, raw + '.gz'), os.path.join(manual_dir, raw)):
      if os.path.isfile(path):
        found[raw] = path
        break
  missing = [f'{raw} (from {url})' for raw, url in RAW_FILES[name].items() if raw not in found]
  if missing:
    raise DataError(
        f'{name}: manual_dir={manual_dir!r} lacks {", ".join(missing)}. It must hold each of '
        f'{", ".join(RAW_FILES[name])}, gzipped (NAME.gz) or plain; or leave manual_dir '
        f'empty to download them.')
  return found


def check_reachable(name: str) -> None:
  """DataError unless every raw file of `name` answers a HEAD request within
  REACH_TIMEOUT seconds."""
  for raw, url in RAW_FILES[name].items():
    try:
      urllib.request.urlopen(urllib.request.Request(url, method='HEAD'),
                             timeout=REACH_TIMEOUT).close()
    except (OSError, urllib.error.URLError) as e:  # HTTPError, timeouts, no route
      looked_at = ' or '.join(shared.candidates())
      raise DataError(
          f'{name}: cannot download {raw} from {url} ({getattr(e, "reason", e)}), and the '
          f'shared corpora were not found in {looked_at}. Put the raw files in a folder and '
          f'pass --config.data.manual_dir=FOLDER, or set FFL_SHARED_DATA to the folder '
          f'holding multi30k/ and tiny_shakespeare/ (README, "Data").') from None


def _raw_paths(builder, dl_manager) -> dict[str, str]:
  """The raw files: from the download config's manual_dir, else downloaded.

  A manual_dir that is missing or empty counts as not given (that is how TFDS
  reports it); the factories below check a given one with check_manual_dir first.
  """
  try:
    manual_dir = dl_manager.manual_dir  # AssertionError: none given (or it is empty)
  except AssertionError:
    return {raw: os.fspath(path)
            for raw, path in dl_manager.download(RAW_FILES[builder.name]).items()}
  return check_manual_dir(builder.name, os.fspath(manual_dir))


def _open(path: str):
  """Binary file object, gunzipped if the file is gzip (by its magic bytes, not its name:
  TFDS renames downloads)."""
  with open(path, 'rb') as f:
    magic = f.read(2)
  return gzip.open(path, 'rb') if magic == b'\x1f\x8b' else open(path, 'rb')


def _decode(line: bytes) -> str | None:
  try:
    return line.decode('utf-8')
  except UnicodeDecodeError:
    return None


def _record(builder, split: str, counts: dict, files) -> None:
  """Keeps the skip counts in the dataset metadata (saved with the dataset) and warns."""
  builder.info.metadata[split] = counts
  if any(counts.values()):
    log.warning('%s %s: skipped lines in %s: %s', builder.name, split, ', '.join(files), counts)


def _info(builder, features, homepage: str, citation: str = '', supervised_keys=None):
  return tfds.core.DatasetInfo(
      builder=builder, description=builder.__doc__, homepage=homepage, citation=citation,
      features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in features}),
      supervised_keys=supervised_keys,
      disable_shuffling=True,  # rows in file order: row i of a split is line i of its files
      metadata=tfds.core.MetadataDict())


if tfds is not None:
  class Multi30k(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Multi30k task 1, English-German sentence pairs."""
    # The version names the skip rules and split files too: a change to either
    # must bump it, or a prepared data_dir silently keeps the old examples.
    VERSION = tfds.core.Version('1.0.0')
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f'Put {", ".join(RAW_FILES["multi30k"])} (each gzipped as NAME.gz or plain) in '
        f'manual_dir; they are at {MULTI30K_URL}NAME.gz')

    def _info(self):
      return _info(self, ('en', 'de'), 'https://github.com/multi30k/dataset',
                   'Elliott et al. 2016, Multi30K: Multilingual English-German Image '
                   'Descriptions, doi:10.18653/v1/W16-3210', supervised_keys=('en', 'de'))

    def _split_generators(self, dl_manager):
      paths = _raw_paths(self, dl_manager)
      return {split: self._generate_examples(split, paths[f'{stem}.en'], paths[f'{stem}.de'])
              for split, stem in MULTI30K_SPLITS.items()}

    def _generate_examples(self, split, en_path, de_path):
      """Line i of the .en file with line i of the .de file; bad pairs counted and skipped."""
      counts = dict.fromkeys(REASONS, 0)
      with _open(en_path) as en_file, _open(de_path) as de_file:
        for i, (en, de) in enumerate(itertools.zip_longest(en_file, de_file)):
          if en is None or de is None:
            counts['unpaired'] += 1
            continue
          en, de = _decode(en.rstrip(b'\r\n')), _decode(de.rstrip(b'\r\n'))
          if en is None or de is None:
            counts['invalid_utf8'] += 1
          elif not en.strip() or not de.strip():
            counts['empty'] += 1
          else:
            yield i, {'en': en, 'de': de}
      _record(self, split, counts, (en_path, de_path))


  class TinyShakespeare(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Tiny Shakespeare as two long texts (train: first 90% of characters, validation: last 10%)."""
    name = 'tiny_shakespeare_char'  # the TFDS catalog's 'tiny_shakespeare' has another split
    VERSION = tfds.core.Version('1.0.0')  # bump with any change to the split or skip rules
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f'Put input.txt (or input.txt.gz) in manual_dir; get it from {SHAKESPEARE_URL}input.txt')

    def _info(self):
      return _info(self, ('text',), 'https://github.com/karpathy/char-rnn')

    def _split_generators(self, dl_manager):
      path = _raw_paths(self, dl_manager)['input.txt']
      with _open(path) as f:
        lines = f.read().splitlines(keepends=True)
      kept, dropped_at = [], []  # dropped_at: character offsets in the kept text
      length = 0
      for line in lines:
        text = _decode(line)
        if text is None:
          dropped_at.append(length)
        else:
          kept.append(text)
          length += len(text)
      text = ''.join(kept)
      cut = int(len(text) * 0.9)
      for split, dropped in (('train', sum(at < cut for at in dropped_at)),
                             ('validation', sum(at >= cut for at in dropped_at))):
        _record(self, split, {'invalid_utf8': dropped, 'empty': 0, 'unpaired': 0}, (path,))
      return {'train': self._generate_examples(text[:cut]),
              'validation': self._generate_examples(text[cut:])}

    def _generate_examples(self, text):
      yield 0, {'text': text}


def is_prepared(builder) -> bool:
  """builder.is_prepared() without its warning about a version folder that
  TFDS itself has created but not yet filled."""
  return (builder.data_path / 'dataset_info.json').exists()


def prepare(builder, **kwargs):
  """builder.download_and_prepare(**kwargs), once, with TFDS's own output
  (progress bars, and banners such as "Downloading and preparing dataset
  Unknown size" for data generated here) replaced by one log line: the
  corpora here take seconds to prepare."""
  if is_prepared(builder):
    log.info('data: %s read from %s (prepared by an earlier run)', builder.name,
             builder.data_path)
    return builder
  start = time.monotonic()
  tfds.display_progress_bar(False)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      builder.download_and_prepare(**kwargs)
  finally:
    tfds.display_progress_bar(True)
  log.info('data: prepared %s under %s (%.1f s)', builder.name, builder.data_dir_root,
           time.monotonic() - start)
  return builder


def _prepare(builder, manual_dir: str):
  return prepare(builder, download_config=tfds.download.DownloadConfig(
      manual_dir=manual_dir or None))


def _check_source(builder, manual_dir: str) -> None:
  """Before anything is written to data_dir: the raw files are in manual_dir,
  or (none given) their host answers."""
  if is_prepared(builder):
    return
  if manual_dir:
    check_manual_dir(builder.name, manual_dir)
  else:
    check_reachable(builder.name)


def require_tfds(task: str) -> None:
  """DataError naming the pip line where tensorflow_datasets is not installed."""
  if tfds is None:
    raise DataError(f'data.task={task} reads its corpus through tensorflow_datasets, which this '
                    f'Python lacks; {sys.executable} -m pip install {TFDS_REQUIREMENTS} adds it '
                    f'(the synthetic tasks run without it)')


def multi30k(data_dir: str, manual_dir: str) -> Multi30k:
  """The prepared Multi30k builder; raw files from manual_dir, or downloaded if ''."""
  require_tfds('multi30k')
  builder = Multi30k(data_dir=data_dir, file_format='array_record')
  _check_source(builder, manual_dir)
  return _prepare(builder, manual_dir)


def tiny_shakespeare(data_dir: str, manual_dir: str) -> TinyShakespeare:
  """The prepared Tiny Shakespeare builder; input.txt from manual_dir, or downloaded if ''."""
  require_tfds('tiny_shakespeare')
  builder = TinyShakespeare(data_dir=data_dir, file_format='array_record')
  _check_source(builder, manual_dir)
  return _prepare(builder, manual_dir)


def catalog(tfds_name: str, data_dir: str, manual_dir: str = ''):
  """The prepared builder `tfds_name` ('wmt14_translate/de-en', 'lm1b', ...) of the TFDS catalog."""
  require_tfds(f'tfds (data.tfds_name={tfds_name})')
  # tfds 4.9.10 imports its older builder modules in one loop that stops at the
  # first ImportError (nearest_neighbors needs h5py), so translate/ (wmt*) may
  # never be registered; import the families we name here ourselves.
  for module in ('translate', 'text'):
    try:
      importlib.import_module(f'tensorflow_datasets.{module}')
    except ImportError:
      pass
  try:
    builder = tfds.builder(tfds_name, data_dir=data_dir, file_format='array_record')
  except ValueError as e:  # DatasetNotFoundError, unknown config, ...
    raise DataError(
        f'data.tfds_name={tfds_name!r} is not a TFDS catalog dataset ({str(e).splitlines()[0]}); '
        f'examples of valid names: {", ".join(CATALOG_EXAMPLES)}') from None
  try:
    return _prepare(builder, manual_dir)
  except ModuleNotFoundError as e:  # e.g. lm1b's generator globs files with TensorFlow
    raise DataError(
        f'preparing {tfds_name} needs the Python module {e.name!r}, which is not installed; '
        f'install it, or prepare the dataset once where it is and point data_dir there') from e


def _features(builder, *keys: str):
  available = list(builder.info.features.keys())
  for key in keys:
    if key not in available:
      raise DataError(
          f'{builder.name} has no feature {key!r}; its features are {", ".join(available)}')


def _str(value) -> str:
  """Real array_record sources return bytes; tfds.testing.mock_data returns str."""
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _examples(builder, split: str) -> list[dict]:
  source = builder.as_data_source(split)
  keys = list(range(len(source)))
  try:
    return source.__getitems__(keys)  # one batched read, not a read per item
  except TypeError:  # tfds.testing.mock_data's source: its __getitems__ is set without `self`
    return [source[i] for i in keys]


# Beside a prepared dataset's files: its numeric examples decoded, per split.
EXAMPLES_FILE = 'flaxformer_lite_examples.npz'


def read_examples(builder, splits) -> dict[str, list[dict]]:
  """split -> its examples, as the builder's data source gives them (dicts of
  numpy scalars and 1-D arrays). TFDS decodes records one at a time in
  Python, so the first read also writes them, column by column, to
  EXAMPLES_FILE in the builder's data_dir; later reads load that instead (the
  prepared files never change under a version's folder). An unreadable file is
  read past and rewritten; a read-only data_dir just keeps no copy."""
  path = os.path.join(builder.data_dir, EXAMPLES_FILE)
  try:
    with np.load(path) as columns:
      return {split: _from_columns(columns, split) for split in splits}
  except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
    pass
  examples = {split: _examples(builder, split) for split in splits}
  columns = {}
  for split, rows in examples.items():
    split_columns = _to_columns(split, rows)
    if split_columns is None:  # text, or arrays of more than one axis: no copy
      return examples
    columns.update(split_columns)
  partial = f'{path}.{os.getpid()}.tmp'
  try:
    with open(partial, 'wb') as f:
      np.savez(f, **columns)
    os.replace(partial, path)
  except OSError as e:
    log.info('data: no copy of the decoded examples in %s (%s)', builder.data_dir, e)
    with contextlib.suppress(OSError):
      os.remove(partial)
  return examples


def _to_columns(split: str, rows: list[dict]) -> dict | None:
  """{'SPLIT/#': [count], 'SPLIT/KEY': values, 'SPLIT/KEY/lengths': ...}: a
  scalar feature as one array, a 1-D one concatenated with each row's length;
  None for any other feature."""
  columns = {f'{split}/#': np.array([len(rows)])}
  for key in (rows[0] if rows else {}):
    values = [np.asarray(row[key]) for row in rows]
    if any(v.dtype.kind not in 'biuf' for v in values) or len({v.ndim for v in values}) > 1:
      return None
    if values[0].ndim == 0:
      columns[f'{split}/{key}'] = np.stack(values)
    elif values[0].ndim == 1:
      columns[f'{split}/{key}'] = np.concatenate(values)
      columns[f'{split}/{key}/lengths'] = np.array([v.size for v in values])
    else:
      return None
  return columns


def _from_columns(columns, split: str) -> list[dict]:
  """`_to_columns`' rows back: a list of {key: scalar or 1-D array}."""
  count = int(columns[f'{split}/#'][0])
  names = [n[len(split) + 1:] for n in columns.files
           if n.startswith(f'{split}/') and n.count('/') == 1 and not n.endswith('/#')]
  features = {}
  for key in names:
    values = columns[f'{split}/{key}']
    if f'{split}/{key}/lengths' in columns.files:
      ends = np.cumsum(columns[f'{split}/{key}/lengths'])
      values = np.split(values, ends[:-1]) if count else []
    if len(values) != count:
      raise ValueError(f'{EXAMPLES_FILE}: {split}/{key} has {len(values)} rows, not {count}')
    features[key] = values
  return [dict(zip(features, row)) for row in zip(*features.values())]


def read_pairs(builder, split: str, source: str, target: str) -> tuple[list[str], list[str]]:
  """All (source, target) texts of a split, as two lists of equal length."""
  _features(builder, source, target)
  sources, targets = [], []
  for example in _examples(builder, split):
    sources.append(_str(example[source]))
    targets.append(_str(example[target]))
  return sources, targets


def read_text(builder, split: str, key: str = 'text') -> list[str]:
  """The texts of a split (Tiny Shakespeare: one; lm1b: one per sentence)."""
  _features(builder, key)
  return [_str(example[key]) for example in _examples(builder, split)]


def bad_line_counts(builder) -> dict:
  """{split: {'invalid_utf8': n, 'empty': n, 'unpaired': n}} for our builders, {} for others."""
  metadata = builder.info.metadata
  if not metadata:
    return {}
  return {split: {reason: int(counts[reason]) for reason in REASONS}
          for split, counts in metadata.items()
          if isinstance(counts, dict) and set(counts) == set(REASONS)}
