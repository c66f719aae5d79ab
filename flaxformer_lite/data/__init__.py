"""Input data: TFDS builders, batching.

`load(config.data)` -> Dataset with padded arrays per split.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import tensorflow_datasets as tfds

from flaxformer_lite.data import pipeline, synthetic
from flaxformer_lite.data.pipeline import Batches, eval_batches

TASKS = tuple(synthetic.TASKS)


@dataclasses.dataclass
class Dataset:
  """vocab_size; splits: name -> {'inputs': [N, L], 'targets': [N, L]}."""
  vocab_size: int
  splits: dict
  dropped: dict


def default_data_dir() -> str:
  return os.environ.get('TFDS_DATA_DIR') or os.path.expanduser('~/tensorflow_datasets')


def load(data_config) -> Dataset:
  """Prepares (once) and reads the dataset named by config.data."""
  if data_config['task'] not in synthetic.TASKS:
    raise ValueError(f"data.task={data_config['task']!r}; valid: {', '.join(TASKS)}")
  builder = synthetic.builder(data_config, data_config['data_dir'] or default_data_dir())
  builder.download_and_prepare()
  max_len = data_config['max_len'] + 1  # + EOS
  splits, dropped = {}, {}
  for split, length in (('train', max_len), ('validation', max_len),
                        ('test', max_len), ('test_long', 2 * max_len)):
    source = builder.as_data_source(split=split)
    examples = source.__getitems__(list(range(len(source))))
    splits[split], dropped[split] = pipeline.pad_examples(
        examples, {'inputs': length, 'targets': length})
    if dropped[split]:
      logging.getLogger('flaxformer_lite').warning('%s: dropped %d over-long examples', split, dropped[split])
  return Dataset(synthetic.vocab_size(data_config), splits, dropped)


__all__ = ['Batches', 'Dataset', 'TASKS', 'eval_batches', 'load']
