"""Batching: padded numpy batches, deterministic and resumable, per-host.

A split is held as padded arrays {feature: [N, L]}; batches are drawn by a
seeded permutation per epoch. The iterator's position ({'epoch', 'index'})
is saved in checkpoints so a resumed run sees the same batches.
"""
from __future__ import annotations

import numpy as np

from flaxformer_lite.models import PAD_ID


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


class Batches:
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
    self.per_process = batch_size // process_count
    self.offset = process_index * self.per_process
    self.epoch, self.index = 0, 0
    self._perm = self._permutation(0)

  def _permutation(self, epoch):
    return np.random.default_rng([self.seed, epoch]).permutation(self.num)

  def get_state(self) -> dict:
    return {'epoch': int(self.epoch), 'index': int(self.index)}

  def set_state(self, state: dict):
    self.epoch, self.index = int(state['epoch']), int(state['index'])
    self._perm = self._permutation(self.epoch)

  def __iter__(self):
    return self

  def __next__(self):
    if self.index + self.batch_size > self.num:  # drop the ragged tail
      self.epoch, self.index = self.epoch + 1, 0
      self._perm = self._permutation(self.epoch)
    start = self.index + self.offset
    rows = self._perm[start:start + self.per_process]
    self.index += self.batch_size
    return {k: v[rows] for k, v in self.arrays.items()}


def eval_batches(arrays, batch_size: int):
  """Every example once, in order; the last batch is padded with PAD rows.

  Yields {feature: [batch_size, L]}; PAD rows have zero weight everywhere.
  """
  num = len(next(iter(arrays.values())))
  for start in range(0, num, batch_size):
    batch = {}
    for k, v in arrays.items():
      chunk = v[start:start + batch_size]
      if len(chunk) < batch_size:
        chunk = np.concatenate(
            [chunk, np.full((batch_size - len(chunk), v.shape[1]), PAD_ID, v.dtype)])
      batch[k] = chunk
    yield batch
