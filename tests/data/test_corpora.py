"""Real corpora builders: row counts and texts equal the raw files, bad lines counted, catalog.
The builders are TFDS's: without it these tests skip (the `tfds` fixture; CI fails them)."""
import gzip
import logging
import pathlib
import time

import pytest

from flaxformer_lite.data import corpora, shared

MULTI30K = {'train': ('train', 29000), 'validation': ('val', 1014),
            'test': ('test_2016_flickr', 1000)}


@pytest.fixture(scope='module')
def data_dir(tfds_dir):
  return tfds_dir  # the session's: tests/test_real_data.py reuses what is prepared here


def _lines(path):
  """Reference reader, independent of the builder: the lines of a gzipped UTF-8 file."""
  with gzip.open(path, 'rb') as f:
    text = f.read().decode('utf-8')
  assert text.endswith('\n')
  return text[:-1].split('\n')


def _write(path, lines, gz):
  data = b''.join(line + b'\n' for line in lines)
  if gz:
    with gzip.open(str(path) + '.gz', 'wb') as f:
      f.write(data)
  else:
    path.write_bytes(data)


def test_multi30k_equals_raw_files(data_dir, shared_data):
  shared = pathlib.Path(shared_data)
  builder = corpora.multi30k(data_dir, str(shared / 'multi30k'))
  for split, (stem, rows) in MULTI30K.items():
    en, de = corpora.read_pairs(builder, split, 'en', 'de')
    raw_en = _lines(shared / 'multi30k' / f'{stem}.en.gz')
    raw_de = _lines(shared / 'multi30k' / f'{stem}.de.gz')
    assert len(en) == len(de) == len(raw_en) == len(raw_de) == rows
    assert en[0] == raw_en[0] and de[0] == raw_de[0]
    assert en[-1] == raw_en[-1] and de[-1] == raw_de[-1]
    assert en == raw_en and de == raw_de  # every line, so every pair, in file order
  assert builder.info.splits['train'].num_examples == 29000
  assert corpora.bad_line_counts(builder)['train'] == {'invalid_utf8': 0, 'empty': 0, 'unpaired': 0}
  de, en = corpora.read_pairs(builder, 'validation', 'de', 'en')  # either direction
  assert en[5] == _lines(shared / 'multi30k' / 'val.en.gz')[5]
  with pytest.raises(corpora.DataError, match="no feature 'fr'.*en, de"):
    corpora.read_pairs(builder, 'train', 'fr', 'de')


def test_tiny_shakespeare_equals_raw_file(data_dir, shared_data):
  shared = pathlib.Path(shared_data)
  builder = corpora.tiny_shakespeare(data_dir, str(shared / 'tiny_shakespeare'))
  (train,) = corpora.read_text(builder, 'train')
  (validation,) = corpora.read_text(builder, 'validation')
  raw = (shared / 'tiny_shakespeare' / 'input.txt').read_bytes().decode('ascii')
  assert (len(train), len(validation)) == (1003854, 111540)
  assert train + validation == raw
  assert train == raw[:int(len(raw) * 0.9)]
  with pytest.raises(corpora.DataError, match="no feature 'en'.*text"):
    corpora.read_pairs(builder, 'train', 'en', 'text')


@pytest.mark.usefixtures('tfds')
def test_multi30k_bad_lines_are_counted_and_skipped(tmp_path, caplog):
  raw = tmp_path / 'raw'
  raw.mkdir()
  en = [b'Good one', b'', 'Good three \u00fc'.encode(), b' \t ', b'Bad \xff utf8', b'Six',
        b'Seven', b'Good eight', b'extra 1', b'extra 2']
  de = [b'Gut eins', b'Zwei', 'Gut drei \u00df'.encode(), b'Vier', 'F\u00fcnf'.encode(),
        b'bad \xc3\x28', b'  ', b'Gut acht']
  _write(raw / 'train.en', en, gz=False)
  _write(raw / 'train.de', de, gz=True)
  _write(raw / 'val.en', [b'v one'], gz=True)
  _write(raw / 'val.de', [b'w one', b'w two'], gz=False)
  (raw / 'test_2016_flickr.en').write_bytes(b't one\nt two')  # no final newline
  _write(raw / 'test_2016_flickr.de', [b'u one', b'u two'], gz=True)
  tfds_dir = str(tmp_path / 'tfds')

  with caplog.at_level(logging.WARNING, logger='flaxformer_lite'):
    builder = corpora.multi30k(tfds_dir, str(raw))
  expected = {'train': {'invalid_utf8': 2, 'empty': 3, 'unpaired': 2},
              'validation': {'invalid_utf8': 0, 'empty': 0, 'unpaired': 1},
              'test': {'invalid_utf8': 0, 'empty': 0, 'unpaired': 0}}
  assert corpora.bad_line_counts(builder) == expected
  assert corpora.read_pairs(builder, 'train', 'en', 'de') == (
      ['Good one', 'Good three \u00fc', 'Good eight'], ['Gut eins', 'Gut drei \u00df', 'Gut acht'])
  assert corpora.read_pairs(builder, 'validation', 'en', 'de') == (['v one'], ['w one'])
  assert corpora.read_pairs(builder, 'test', 'en', 'de') == (['t one', 't two'], ['u one', 'u two'])
  warnings = [r.getMessage() for r in caplog.records]
  assert any('train.en' in w and 'train.de.gz' in w and "'empty': 3" in w for w in warnings)

  # A second load reads the prepared dataset (no raw files needed) and still reports the counts.
  again = corpora.multi30k(tfds_dir, '')
  assert corpora.bad_line_counts(again) == expected
  assert corpora.bad_line_counts(corpora.Multi30k(data_dir=tfds_dir)) == expected


@pytest.mark.usefixtures('tfds')
def test_tiny_shakespeare_drops_invalid_utf8_keeps_empty_lines(tmp_path):
  raw = tmp_path / 'raw'
  raw.mkdir()
  _write(raw / 'input.txt', [b'First', b'', b'Second \xff bad', b'Third'], gz=True)
  builder = corpora.tiny_shakespeare(str(tmp_path / 'tfds'), str(raw))
  text = 'First\n\nThird\n'
  (train,) = corpora.read_text(builder, 'train')
  (validation,) = corpora.read_text(builder, 'validation')
  assert (train, validation) == (text[:11], text[11:])  # int(13 * 0.9) = 11
  assert corpora.bad_line_counts(builder) == {
      'train': {'invalid_utf8': 1, 'empty': 0, 'unpaired': 0},
      'validation': {'invalid_utf8': 0, 'empty': 0, 'unpaired': 0}}


def test_without_manual_dir_the_public_urls_are_downloaded(tmp_path, monkeypatch, tfds):
  """Offline stand-in for the download: TFDS's DownloadManager.download serves local files
  under renamed (suffix-less) names, as real downloads are."""
  requested = []

  def download(self, urls):
    requested.extend(urls.values())
    paths = {}
    for i, (raw, url) in enumerate(urls.items()):
      paths[raw] = tmp_path / f'download_{i}'
      data = f'{raw} line\n'.encode()
      paths[raw].write_bytes(gzip.compress(data) if url.endswith('.gz') else data)
    return paths

  monkeypatch.setattr(tfds.download.DownloadManager, 'download', download)
  monkeypatch.setattr(corpora, 'check_reachable', lambda name: None)  # offline
  builder = corpora.multi30k(str(tmp_path / 'tfds'), '')
  assert corpora.read_pairs(builder, 'test', 'en', 'de') == (
      ['test_2016_flickr.en line'], ['test_2016_flickr.de line'])
  shakespeare = corpora.tiny_shakespeare(str(tmp_path / 'tfds'), '')
  texts = corpora.read_text(shakespeare, 'train') + corpora.read_text(shakespeare, 'validation')
  assert ''.join(texts) == 'input.txt line\n'
  multi30k_urls = [corpora.MULTI30K_URL + f'{stem}.{lang}.gz'
                   for stem in ('train', 'val', 'test_2016_flickr') for lang in ('en', 'de')]
  shakespeare_url = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
  assert sorted(requested) == sorted(multi30k_urls + [shakespeare_url])


@pytest.mark.usefixtures('tfds')
def test_an_unreachable_download_fails_in_seconds_naming_file_url_and_manual_dir(
    tmp_path, monkeypatch):
  """Port 9 of this host refuses the connection: no retries, nothing written."""
  url = 'http://127.0.0.1:9/input.txt'
  monkeypatch.setitem(corpora.RAW_FILES, 'tiny_shakespeare_char', {'input.txt': url})
  monkeypatch.setenv('FFL_SHARED_DATA', str(tmp_path / 'nowhere'))
  tfds_dir = tmp_path / 'tfds'
  start = time.monotonic()
  with pytest.raises(corpora.DataError) as e:
    corpora.tiny_shakespeare(str(tfds_dir), '')
  assert time.monotonic() - start < corpora.REACH_TIMEOUT
  message = str(e.value)
  for part in ('input.txt', url, '--config.data.manual_dir=', str(tmp_path / 'nowhere')):
    assert part in message
  assert not tfds_dir.exists()


def test_shared_corpora_are_found_where_ffl_shared_data_points(tmp_path, monkeypatch):
  for folder in ('multi30k', 'tiny_shakespeare'):
    (tmp_path / folder).mkdir()
  monkeypatch.setenv('FFL_SHARED_DATA', str(tmp_path))
  assert shared.find() == (str(tmp_path), [str(tmp_path)])
  assert shared.manual_dir('tiny_shakespeare') == str(tmp_path / 'tiny_shakespeare')
  assert shared.manual_dir('tfds') == ''
  (tmp_path / 'multi30k').rmdir()  # a folder with one corpus only is not the shared data
  assert shared.find() == (None, [str(tmp_path)])
  assert shared.manual_dir('tiny_shakespeare') == ''


@pytest.mark.usefixtures('tfds')
def test_missing_raw_file_raises_before_writing(tmp_path):
  raw = tmp_path / 'raw'
  raw.mkdir()
  for name in corpora.RAW_FILES['multi30k']:
    if name != 'train.de':
      _write(raw / name, [b'x'], gz=name.endswith('.en'))
  tfds_dir = tmp_path / 'tfds'
  with pytest.raises(corpora.DataError) as e:
    corpora.multi30k(str(tfds_dir), str(raw))
  message = str(e.value)
  assert str(raw) in message
  lacking = message.split(' lacks ')[1].split('. It must')[0]
  assert lacking == f'train.de (from {corpora.MULTI30K_URL}train.de.gz)'
  with pytest.raises(corpora.DataError, match=r'input\.txt .from https://raw\S*/karpathy/'):
    corpora.tiny_shakespeare(str(tfds_dir), str(tmp_path / 'nowhere'))
  assert not tfds_dir.exists()


def test_catalog_under_mock_data(tmp_path, tfds):
  with tfds.testing.mock_data(num_examples=7):
    wmt = corpora.catalog('wmt14_translate/de-en', str(tmp_path))
    de, en = corpora.read_pairs(wmt, 'train', 'de', 'en')
    assert len(de) == len(en) == 7
    assert all(isinstance(s, str) for s in de + en)
    lm1b = corpora.catalog('lm1b', str(tmp_path))
    texts = corpora.read_text(lm1b, 'test')
    assert len(texts) == 7 and all(isinstance(t, str) for t in texts)
    assert corpora.bad_line_counts(lm1b) == {}
    with pytest.raises(corpora.DataError, match="no feature 'fr'.*de, en"):
      corpora.read_pairs(wmt, 'train', 'fr', 'en')
  with pytest.raises(corpora.DataError, match="'no_such_corpus'.*lm1b"):
    corpora.catalog('no_such_corpus', str(tmp_path))
