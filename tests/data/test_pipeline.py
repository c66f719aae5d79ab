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


def _ragged(n=200, width=40, seed=0):
  """n examples, lengths 1..width-1 (inputs) and 1..width-1 (targets), PAD after."""
  rng = np.random.default_rng(seed)
  arrays = {'inputs': np.zeros((n, width), np.int32), 'targets': np.zeros((n, width), np.int32)}
  for i in range(n):
    for k in arrays:
      arrays[k][i, :rng.integers(1, width)] = i + 3  # the row's id, to track it
  return arrays


def _length(row):
  return int(np.sum(row != 0))


def test_bucketed_batches_group_similar_lengths_within_the_budget():
  arrays = _ragged()
  it = pipeline.BucketedBatches(arrays, 96, seed=0, boundaries=[8, 16, 24, 32, 40])
  seen = []
  for _ in range(len(it._batches)):  # one epoch
    b = next(it)
    rows, width = b['inputs'].shape
    assert width in (8, 16, 24, 32, 40) and rows * width <= 96 and rows == 96 // width
    longest = [max(_length(x), _length(y)) for x, y in zip(b['inputs'], b['targets'])]
    assert max(longest) <= width and min(longest) > width - 8  # the bucket below is full
    # rows stay aligned: inputs and targets carry the same example id
    np.testing.assert_array_equal(b['inputs'][:, 0], b['targets'][:, 0])
    seen += list(b['inputs'][:, 0])
  assert len(seen) == len(set(seen))  # no example twice in an epoch
  # only each bucket's ragged tail (< rows of that bucket) waits for a later epoch
  assert len(arrays['inputs']) - len(seen) < sum(96 // w for w in (8, 16, 24, 32, 40))
  assert it.get_state() == {'epoch': 0, 'index': len(it._batches)}


def test_bucketed_batches_resume_and_shard_over_processes():
  arrays = _ragged()
  a = pipeline.BucketedBatches(arrays, 128, seed=3, row_multiple=2)
  for _ in range(30):  # across an epoch boundary
    next(a)
  state = a.get_state()
  expected = [next(a)['inputs'] for _ in range(20)]
  b = pipeline.BucketedBatches(arrays, 128, seed=3, row_multiple=2)
  b.set_state(state)
  for e in expected:
    np.testing.assert_array_equal(next(b)['inputs'], e)
  parts = [pipeline.BucketedBatches(arrays, 128, seed=3, row_multiple=2, process_index=i,
                                    process_count=2) for i in range(2)]
  whole = pipeline.BucketedBatches(arrays, 128, seed=3, row_multiple=4)
  for _ in range(10):
    g = next(whole)['inputs']
    assert len(g) % 4 == 0
    np.testing.assert_array_equal(np.concatenate([next(p)['inputs'] for p in parts]), g)


def test_lm_windows_are_next_token_pairs_from_the_stream_and_resume():
  stream = np.arange(3, 503, dtype=np.int32)  # token = position + 3
  it = pipeline.LMWindows(stream, 16, 8, seed=0)
  starts = []
  for _ in range(200):
    b = next(it)
    assert b['inputs'].shape == b['targets'].shape == (8, 16)
    np.testing.assert_array_equal(np.diff(b['inputs'], axis=1), 1)  # contiguous windows
    np.testing.assert_array_equal(b['targets'], b['inputs'] + 1)  # the next tokens
    starts += list(b['inputs'][:, 0] - 3)
  # inside the stream (the last target is its last token), and spread over it
  assert min(starts) >= 0 and max(starts) <= len(stream) - 16 - 1
  assert min(starts) < 20 and max(starts) > len(stream) - 40
  state = it.get_state()
  expected = next(it)['inputs']
  again = pipeline.LMWindows(stream, 16, 8, seed=0)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)['inputs'], expected)
  halves = [next(pipeline.LMWindows(stream, 16, 8, seed=5, process_index=i, process_count=2))
            for i in range(2)]
  whole = next(pipeline.LMWindows(stream, 16, 8, seed=5))
  np.testing.assert_array_equal(np.concatenate([h['inputs'] for h in halves]), whole['inputs'])


def test_lm_eval_arrays_predict_every_token_but_the_first_once():
  stream = np.arange(3, 3 + 50, dtype=np.int32)
  arrays = pipeline.lm_eval_arrays(stream, 8)
  assert arrays['inputs'].shape == (7, 8)  # ceil(49 / 8)
  inputs, targets = arrays['inputs'].ravel(), arrays['targets'].ravel()
  np.testing.assert_array_equal(inputs[inputs != 0], stream[:-1])
  np.testing.assert_array_equal(targets[targets != 0], stream[1:])
  np.testing.assert_array_equal(inputs != 0, targets != 0)
