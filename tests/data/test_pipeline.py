"""Padding, shuffled resumable batches, per-process shards, eval batches."""
import numpy as np

from flaxformer_lite.data import pipeline


def _arrays(n=10, length=3):
  x = np.arange(1, n + 1, dtype=np.int32)[:, None] * np.ones((1, length), np.int32)
  return {'inputs': x, 'targets': x + 100}


def test_pad_examples_pads_and_counts_dropped():
  examples = [{'inputs': np.array([5, 2]), 'targets': np.array([7, 8, 2])},
              {'inputs': np.array([5, 6, 7, 2]), 'targets': np.array([2])}]
  arrays, dropped = pipeline.pad_examples(examples, {'inputs': 3, 'targets': 3})
  assert dropped == 1
  np.testing.assert_array_equal(arrays['inputs'], [[5, 2, 0]])
  np.testing.assert_array_equal(arrays['targets'], [[7, 8, 2]])


def test_each_epoch_is_a_permutation_and_rows_stay_aligned():
  batches = pipeline.Batches(_arrays(12), 4, seed=0)
  seen = []
  for _ in range(3):
    b = next(batches)
    np.testing.assert_array_equal(b['targets'], b['inputs'] + 100)
    seen.extend(b['inputs'][:, 0])
  assert sorted(seen) == list(range(1, 13))
  nxt = next(batches)['inputs'][:, 0]  # epoch 2: a different order
  assert batches.get_state() == {'epoch': 1, 'index': 4}
  assert len(set(nxt)) == 4


def test_set_state_resumes_the_same_stream():
  a = pipeline.Batches(_arrays(10), 3, seed=7)
  for _ in range(4):
    next(a)
  state = a.get_state()
  expected = [next(a)['inputs'] for _ in range(5)]
  b = pipeline.Batches(_arrays(10), 3, seed=7)
  b.set_state(state)
  for e in expected:
    np.testing.assert_array_equal(next(b)['inputs'], e)


def test_processes_split_each_global_batch():
  whole = pipeline.Batches(_arrays(16), 8, seed=1)
  parts = [pipeline.Batches(_arrays(16), 8, seed=1, process_index=i, process_count=2)
           for i in range(2)]
  for _ in range(3):
    g = next(whole)['inputs']
    np.testing.assert_array_equal(np.concatenate([next(p)['inputs'] for p in parts]), g)


def test_eval_batches_cover_every_example_once_and_pad():
  arrays = _arrays(7)
  batches = list(pipeline.eval_batches(arrays, 3))
  assert len(batches) == 3
  rows = np.concatenate([b['inputs'] for b in batches])
  np.testing.assert_array_equal(rows[:7], arrays['inputs'])
  assert (rows[7:] == 0).all()
