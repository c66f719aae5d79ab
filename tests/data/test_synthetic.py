"""The synthetic TFDS builder: tasks, lengths, EOS, determinism, no TensorFlow."""
import logging
import sys

import numpy as np
import pytest

from flaxformer_lite import data
from flaxformer_lite.data import corpora, synthetic

SPEC = dict(num_symbols=5, min_len=2, max_len=7, num_train=300, num_eval=50, seed=3)


def _load(tfds_dir, task):
  return data.load(dict(task=task, data_dir=tfds_dir, **SPEC))


def _unpad(row):
  return [int(t) for t in row if t != 0]


@pytest.mark.parametrize('task,fn', [('reverse', lambda s: s[::-1]),
                                     ('copy', lambda s: s),
                                     ('sort', sorted)])
def test_targets_follow_the_task(tfds_dir, task, fn):
  ds = _load(tfds_dir, task)
  for split in ('train', 'validation', 'test', 'test_long'):
    arrays = ds.splits[split]
    for inputs, targets in zip(arrays['inputs'], arrays['targets']):
      x, y = _unpad(inputs), _unpad(targets)
      assert x[-1] == 2 and y[-1] == 2  # EOS ends both
      assert y[:-1] == list(fn(x[:-1]))
      assert all(3 <= t < 3 + SPEC['num_symbols'] for t in x[:-1])


def test_lengths_and_sizes(tfds_dir):
  ds = _load(tfds_dir, 'reverse')
  assert ds.vocab_size == 3 + SPEC['num_symbols']
  assert len(ds.splits['train']['inputs']) == SPEC['num_train']
  lengths = {s: {len(_unpad(r)) - 1 for r in ds.splits[s]['inputs']} for s in ds.splits}
  assert lengths['train'] <= set(range(2, 8)) and len(lengths['train']) > 3
  # the long split holds only lengths never seen in training
  assert lengths['test_long'] <= set(range(8, 15)) and max(lengths['test_long']) > 10
  assert ds.splits['test_long']['inputs'].shape[1] == 2 * (SPEC['max_len'] + 1)


def test_same_seed_same_data_other_seed_other_data(tfds_dir, tmp_path):
  a = _load(tfds_dir, 'reverse').splits['train']['inputs']
  b = data.load(dict(task='reverse', data_dir=str(tmp_path), **SPEC)).splits['train']['inputs']
  np.testing.assert_array_equal(a, b)
  c = data.load(dict(task='reverse', data_dir=tfds_dir, **{**SPEC, 'seed': 4}))
  assert not np.array_equal(a, c.splits['train']['inputs'])


def test_splits_do_not_share_sequences_generator(tfds_dir):
  ds = _load(tfds_dir, 'copy')
  train = {tuple(r) for r in ds.splits['train']['inputs']}
  val = [tuple(r) for r in ds.splits['validation']['inputs']]
  # splits come from different generator streams: most validation rows are new
  assert sum(r not in train for r in val) > len(val) // 2


def test_prepared_as_array_record_without_tensorflow(tfds_dir):
  builder = synthetic.builder(dict(task='reverse', **SPEC), tfds_dir)
  builder.download_and_prepare()
  files = [p.name for p in builder.data_path.iterdir()]
  assert any('array_record' in f for f in files)
  assert 'tensorflow' not in sys.modules


def test_prepare_prints_nothing_of_tfds_and_logs_one_line(tmp_path, capfd, caplog):
  """TFDS's progress bars (stderr) and banners (stdout) take the place of a
  run's own lines for data that takes a second to generate."""
  builder = synthetic.builder(dict(task='reverse', **SPEC), str(tmp_path))
  with caplog.at_level(logging.INFO, logger='flaxformer_lite'):
    corpora.prepare(builder)
    corpora.prepare(builder)  # prepared: nothing to do, nothing said
  out, err = capfd.readouterr()
  assert (out, err) == ('', '')
  assert [r.getMessage().split(' (')[0] for r in caplog.records
          if r.name == 'flaxformer_lite'] == [
      f'data: prepared synthetic_tasks under {tmp_path}']
  assert builder.is_prepared()
