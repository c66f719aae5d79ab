"""The synthetic tasks: tasks, lengths, EOS, determinism; the TFDS builder (no
TensorFlow). Without TFDS they are generated in memory: tests/test_ffl_python.py."""
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


@pytest.mark.usefixtures('tfds')
def test_prepared_as_array_record_without_tensorflow(tfds_dir):
  builder = synthetic.builder(dict(task='reverse', **SPEC), tfds_dir)
  builder.download_and_prepare()
  files = [p.name for p in builder.data_path.iterdir()]
  assert any('array_record' in f for f in files)
  assert 'tensorflow' not in sys.modules


@pytest.mark.usefixtures('tfds')
def test_prepare_prints_nothing_of_tfds_and_logs_one_line(tmp_path, capfd, caplog):
  """TFDS's progress bars (stderr) and banners (stdout) take the place of a
  run's own lines for data that takes a second to generate."""
  builder = synthetic.builder(dict(task='reverse', **SPEC), str(tmp_path))
  with caplog.at_level(logging.INFO, logger='flaxformer_lite'):
    corpora.prepare(builder)
    corpora.prepare(builder)  # prepared: nothing to do but say where it reads
  out, err = capfd.readouterr()
  assert (out, err) == ('', '')
  assert [r.getMessage().split(' (')[0] for r in caplog.records
          if r.name == 'flaxformer_lite'] == [
      f'data: prepared synthetic_tasks under {tmp_path}',
      f'data: synthetic_tasks read from {builder.data_path}']
  assert builder.is_prepared()


@pytest.mark.usefixtures('tfds')
def test_decoded_examples_are_kept_beside_the_files_and_read_back_unchanged(tmp_path):
  """The first load writes the decoded examples next to the prepared files;
  the next reads them from there, equal to TFDS's own records and to the
  generator's examples in the files' order; a damaged copy is read past
  and rewritten."""
  config = dict(task='reverse_string', data_dir=str(tmp_path), **SPEC, test_lengths=(9, 12))
  first = data.load(config)
  builder = synthetic.builder(config, str(tmp_path))
  copy = builder.data_path / corpora.EXAMPLES_FILE
  assert copy.exists()
  splits = ('train', 'validation', 'test', 'test_long')
  cached = corpora.read_examples(builder, splits)
  generated = synthetic.in_memory(config)
  for split in splits:
    records = builder.as_data_source(split=split)
    assert len(cached[split]) == len(records) == len(generated[split])
    for i, example in enumerate(cached[split]):
      for source in (records[i], generated[split][i]):
        assert example.keys() == source.keys()
        for key in example:
          np.testing.assert_array_equal(example[key], source[key])
          assert np.asarray(example[key]).dtype == np.asarray(records[i][key]).dtype
  copy.write_bytes(b'not a zip file')
  again = data.load(config)
  assert np.load(copy)['train/#'][0] == SPEC['num_train']
  for split in splits:
    for key in ('inputs', 'targets'):
      np.testing.assert_array_equal(again.splits[split][key], first.splits[split][key])
  np.testing.assert_array_equal(again.length_groups['test_long'], first.length_groups['test_long'])


def test_an_algorithmic_task_loads_with_its_test_lengths_spread_evenly(tfds_dir):
  """reverse_string through data.load: the answer is the input reversed (the
  task's definition), EOS ends both, test_long holds num_eval examples at
  data.test_lengths in turn, each row's recorded length is its own, and the
  in-distribution splits share one width."""
  ds = data.load(dict(task='reverse_string', data_dir=tfds_dir,
                      **{**SPEC, 'num_eval': 9}, test_lengths=(9, 12, 20)))
  assert ds.vocab_size == 3 + 2
  assert set(ds.length_groups) == {'test_long'}
  assert sorted(ds.length_groups['test_long'].tolist()) == [9] * 3 + [12] * 3 + [20] * 3
  for split, arrays in ds.splits.items():
    for i, (inputs, targets) in enumerate(zip(arrays['inputs'], arrays['targets'])):
      x, y = _unpad(inputs), _unpad(targets)
      assert x[-1] == 2 and y[-1] == 2 and y[:-1] == x[-2::-1]
      assert set(x[:-1]) <= {3, 4}
      if split == 'test_long':
        assert len(x) - 1 == ds.length_groups['test_long'][i]
      else:
        assert 2 <= len(x) - 1 <= 7
  assert ds.splits['test_long']['inputs'].shape[1] == 21
  widths = {ds.splits[s][k].shape[1] for s in ('train', 'validation', 'test')
            for k in ('inputs', 'targets')}
  assert widths == {8}
