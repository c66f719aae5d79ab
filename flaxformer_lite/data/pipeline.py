"""Batching: padded numpy batches, deterministic and resumable, per-host.

A sequence split is held as padded arrays {feature: [N, L]}; a language-model
split as one token stream [T]. Four iterators draw from them:
  Batches          fixed rows per batch, a seeded permutation per epoch;
  BucketedBatches  rows of similar length, about a token budget per batch;
  PackedBatches    several examples per row, with segment ids and positions;
  LMWindows        random windows of a token stream (nanoGPT's get_batch).
Each one's position (get_state/set_state, a small dict of ints) is saved in
checkpoints, so a resumed run sees the same batches. With process_count > 1
every process draws the same global batch and keeps its own rows.
"""
from __future__ import annotations

import numpy as np

from flaxformer_lite.tokens import PAD_ID


def pad_examples(examples, lengths: dict[str, int]):
  """List of {feature: 1-D int array} -> ({feature: [N, L]}, dropped count).

  Examples longer than `lengths[feature]` are dropped and counted.
  """
  keep = [ex for ex in examples
          if all(len(ex[k]) <= length for k, length in lengths.items())]
  arrays = {}
  for k, length in lengths.items():
    out = np.full((len(keep), length), PAD_ID, np.int32)
    for i, ex in enumerate(keep):
      out[i, :len(ex[k])] = ex[k]
    arrays[k] = out
  return arrays, len(examples) - len(keep)


def process_share(rows, process_index: int, process_count: int):
  """This process's part of a global batch: rows [N, ...] -> the
  process_index-th of process_count equal slices (N // process_count rows)."""
  share = len(rows) // process_count
  return rows[process_index * share:(process_index + 1) * share]


class _Epochs:
  """The walk shared by Batches, BucketedBatches and PackedBatches: each epoch
  has a plan rebuilt from (seed, epoch) by the subclass's `_new_epoch`, and
  `index` is the position in it, so (epoch, index) is the whole state."""

  def _begin(self, epoch: int, index: int = 0):
    self.epoch, self.index = epoch, index
    self._new_epoch(epoch)

  def _new_epoch(self, epoch: int):
    raise NotImplementedError

  def _take(self, step: int, size: int) -> int:
    """The index of the next `step` items of an epoch of `size`. With fewer
    than `step` left, the next epoch starts: the ragged tail is dropped."""
    if self.index + step > size:
      self._begin(self.epoch + 1)
    index = self.index
    self.index += step
    return index

  def get_state(self) -> dict:
    return {'epoch': int(self.epoch), 'index': int(self.index)}

  def set_state(self, state: dict):
    self._begin(int(state['epoch']), int(state['index']))

  def __iter__(self):
    return self


class Batches(_Epochs):
  """Endless shuffled batches of `batch_size` rows from padded arrays.

  batch_size is global; with process_count > 1 each process gets its own
  batch_size / process_count rows of every global batch.
  """

  def __init__(self, arrays, batch_size: int, *, seed: int,
               process_index: int = 0, process_count: int = 1):
    self.arrays = arrays
    self.num = len(next(iter(arrays.values())))
    if self.num < batch_size:
      raise ValueError(f'a split of {self.num} examples cannot fill batch_size={batch_size}')
    self.batch_size, self.seed = batch_size, seed
    self.process_index, self.process_count = process_index, process_count
    self._begin(0)

  def _new_epoch(self, epoch):
    self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num)

  def __next__(self):
    start = self._take(self.batch_size, self.num)
    rows = process_share(self._perm[start:start + self.batch_size], self.process_index,
                         self.process_count)
    return {k: v[rows] for k, v in self.arrays.items()}


def bucket_boundaries(max_len: int, step: int = 8) -> list[int]:
  """Padded lengths for buckets: multiples of `step` up to max_len (included)."""
  return sorted({*range(step, max_len, step), max_len})


class BucketedBatches(_Epochs):
  """Endless batches of rows of similar length, ~`batch_tokens` tokens each.

  An example goes to the smallest boundary >= its longest feature (count of
  non-PAD tokens). Each epoch, seeded by (seed, epoch): the examples are
  shuffled, grouped by bucket, cut into batches of
  rows = batch_tokens // boundary (a multiple of `row_multiple`; each
  bucket's ragged tail waits for a later epoch), and the batches shuffled.
  A batch is {feature: [rows, boundary]} (the process's share of the rows).
  Few distinct shapes, so few compilations; little padding.
  """

  def __init__(self, arrays, batch_tokens: int, *, seed: int, boundaries=None,
               row_multiple: int = 1, process_index: int = 0, process_count: int = 1):
    self.arrays, self.seed = arrays, seed
    width = next(iter(arrays.values())).shape[1]
    self.boundaries = np.asarray(boundaries or bucket_boundaries(width))
    lengths = np.max([np.sum(v != PAD_ID, axis=1) for v in arrays.values()], axis=0)
    self.bucket = np.searchsorted(self.boundaries, lengths)  # index of the boundary
    if self.bucket.max(initial=0) >= len(self.boundaries):
      raise ValueError(f'examples of length {lengths.max()} exceed the largest bucket '
                       f'{self.boundaries[-1]}')
    multiple = row_multiple * process_count
    self.rows = [max(multiple, batch_tokens // int(b) // multiple * multiple)
                 for b in self.boundaries]
    self.process_index, self.process_count = process_index, process_count
    self._begin(0)

  def _new_epoch(self, epoch):
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(len(self.bucket))
    order = order[np.argsort(self.bucket[order], kind='stable')]
    batches = []
    for b, rows in enumerate(self.rows):
      members = order[self.bucket[order] == b]
      batches += [members[i:i + rows] for i in range(0, len(members) - rows + 1, rows)]
    if not batches:
      raise ValueError(f'no bucket holds a full batch ({self.rows} rows per bucket '
                       f'boundary {list(self.boundaries)}); lower the token budget')
    self._batches = [batches[i] for i in rng.permutation(len(batches))]

  def __next__(self):
    index = self._take(1, len(self._batches))
    rows = process_share(self._batches[index], self.process_index, self.process_count)
    width = int(self.boundaries[self.bucket[rows[0]]])
    return {k: v[rows, :width] for k, v in self.arrays.items()}


PACKED_FEATURES = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
                   'inputs_positions', 'targets_positions')


# Rows still open to the first fit. Each example scans at most this many, and
# a row older than the last OPEN_ROWS opened is closed, so packing stays
# O(examples * OPEN_ROWS) and an example lands near its place in the order.
OPEN_ROWS = 64


def pack_examples(arrays, order, length: int, open_rows: int = OPEN_ROWS) -> dict:
  """Examples (rows of padded {'inputs', 'targets'} [N, L]), in `order`,
  packed into rows of `length` tokens by first fit: each example goes into
  the earliest of the last `open_rows` rows where both its inputs and its
  targets still fit, else it opens a new row. A seeded order gives a seeded
  packing; within a row the examples keep their order.

  Returns {feature: int32 [R, length]} for PACKED_FEATURES: the tokens;
  segmentation 1, 2, ... for the row's examples, 0 for padding; positions
  0.. within each example (0 at padding). As the Flax WMT example's
  pack_dataset (which fills one row at a time), with first fit over several
  rows: closing a row when one side is full leaves the other side's tail
  empty.
  """
  sides = ('inputs', 'targets')
  lengths = np.stack([np.sum(arrays[k] != PAD_ID, axis=1) for k in sides], axis=1)
  order = np.asarray(order)
  used = np.zeros((len(order), 2), np.int64)  # tokens per row and side
  rows = []  # per row: list of example indices
  for i in order:
    lo = max(0, len(rows) - open_rows)
    fits = np.all(used[lo:len(rows)] + lengths[i] <= length, axis=1)
    r = lo + int(np.argmax(fits)) if fits.any() else len(rows)
    if r == len(rows):
      rows.append([])
    rows[r].append(i)
    used[r] += lengths[i]
  out = {k: np.zeros((len(rows), length), np.int32) for k in PACKED_FEATURES}
  for r, members in enumerate(rows):
    for s, k in enumerate(sides):
      start = 0
      for segment, i in enumerate(members, 1):
        n = lengths[i, s]
        out[k][r, start:start + n] = arrays[k][i, :n]
        out[f'{k}_segmentation'][r, start:start + n] = segment
        out[f'{k}_positions'][r, start:start + n] = np.arange(n)
        start += n
  return out


class PackedBatches(_Epochs):
  """Endless batches of packed rows (pack_examples) of `length` tokens.

  Each epoch, seeded by (seed, epoch): the examples are shuffled, packed in
  that order, and cut into batches of `rows` consecutive packed rows (the
  ragged tail is dropped). rows = batch_size, or with batch_tokens > 0
  batch_tokens // length (a multiple of `row_multiple`). Every example is in
  exactly one row of an epoch. A batch is {PACKED_FEATURES: [rows, length]}
  (the process's share of the rows).
  """

  def __init__(self, arrays, *, length: int, seed: int, batch_size: int = 0,
               batch_tokens: int = 0, row_multiple: int = 1, process_index: int = 0,
               process_count: int = 1):
    self.arrays, self.length, self.seed = arrays, length, seed
    self.num = len(arrays['inputs'])
    multiple = row_multiple * process_count
    self.rows = max(multiple, batch_tokens // length // multiple * multiple) if batch_tokens \
        else batch_size
    self.process_index, self.process_count = process_index, process_count
    self._begin(0)

  def _new_epoch(self, epoch):
    order = np.random.default_rng([self.seed, epoch]).permutation(self.num)
    packed = pack_examples(self.arrays, order, self.length)
    if len(packed['inputs']) < self.rows:
      raise ValueError(f'{self.num} examples pack into {len(packed["inputs"])} rows of '
                       f'{self.length} tokens, fewer than a batch of {self.rows} rows')
    self._packed = packed

  def __next__(self):
    start = self._take(self.rows, len(self._packed['inputs']))
    return {k: process_share(v[start:start + self.rows], self.process_index,
                             self.process_count)
            for k, v in self._packed.items()}


class LMWindows:
  """Endless batches of random windows of a token stream [T].

  Batch i draws `batch_size` start offsets uniformly from
  [0, T - context - 1] with a generator seeded by (seed, i):
  {'inputs': stream[o:o + context], 'targets': stream[o + 1:o + context + 1]},
  each [rows, context]. The state is just i.
  """

  def __init__(self, stream, context: int, batch_size: int, *, seed: int,
               process_index: int = 0, process_count: int = 1):
    if len(stream) < context + 2:
      raise ValueError(f'a stream of {len(stream)} tokens is shorter than context '
                       f'{context} + 2')
    self.stream, self.context, self.batch_size, self.seed = stream, context, batch_size, seed
    self.process_index, self.process_count = process_index, process_count
    self.index = 0
    self._window = np.arange(context)

  def get_state(self) -> dict:
    return {'epoch': 0, 'index': int(self.index)}

  def set_state(self, state: dict):
    self.index = int(state['index'])

  def __iter__(self):
    return self

  def __next__(self):
    rng = np.random.default_rng([self.seed, self.index])
    starts = rng.integers(0, len(self.stream) - self.context, size=self.batch_size)
    starts = process_share(starts, self.process_index, self.process_count)
    self.index += 1
    rows = starts[:, None] + self._window
    return {'inputs': self.stream[rows], 'targets': self.stream[rows + 1]}


def lm_eval_arrays(stream, context: int) -> dict:
  """A stream [T] as its non-overlapping windows: {'inputs', 'targets'} [N, context]
  with targets the next tokens; the last window is PAD-filled where the
  stream ends (its PAD targets weigh nothing), so every token but the first
  is predicted exactly once."""
  n = -(-(len(stream) - 1) // context)
  inputs = np.full(n * context, PAD_ID, np.int32)
  targets = np.full(n * context, PAD_ID, np.int32)
  inputs[:len(stream) - 1] = stream[:-1]
  targets[:len(stream) - 1] = stream[1:]
  return {'inputs': inputs.reshape(n, context), 'targets': targets.reshape(n, context)}


def pad_rows(batch: dict, rows: int) -> dict:
  """{feature: [r, ...]} -> {feature: [rows, ...]}, rows r.. filled with PAD.

  An all-PAD row has no target tokens, so it weighs nothing in the loss, the
  metrics or the gradient: padding a batch to a multiple of the device count
  leaves its update exactly the one of the unpadded batch.
  """
  out = {}
  for k, v in batch.items():
    if len(v) > rows:
      raise ValueError(f'pad_rows: a batch of {len(v)} rows does not fit in {rows}')
    # called on every train batch: no copy when it already splits
    out[k] = v if len(v) == rows else np.concatenate(
        [v, np.full((rows - len(v),) + v.shape[1:], PAD_ID, v.dtype)])
  return out


def eval_batches(arrays, batch_size: int, *, rows: int | None = None):
  """Every example once, in order, `batch_size` examples per batch (the last
  holds the rest), each batch padded with PAD rows to `rows` (default
  batch_size; a multiple of the device count to split over devices).

  Yields {feature: [rows, L]}; PAD rows have zero weight everywhere, so the
  metrics do not depend on `rows`.
  """
  rows = rows or batch_size
  num = len(next(iter(arrays.values())))
  for start in range(0, num, batch_size):
    yield pad_rows({k: v[start:start + batch_size] for k, v in arrays.items()}, rows)
