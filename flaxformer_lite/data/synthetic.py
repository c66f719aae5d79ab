"""Synthetic sequence tasks as a TFDS builder: reverse, copy, sort.

Sequences of symbols 3..3+num_symbols-1 (0 = PAD, 1 = BOS, 2 = EOS), lengths
uniform in [min_len, max_len]; `test_long` has lengths in
[max_len + 1, 2 * max_len] to measure length generalisation. Every input
and target ends with EOS. Generated from a seed: nothing is downloaded.
Written as array_record and read through `tfds.data_source` (no TensorFlow).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from flaxformer_lite.tokens import EOS_ID

TASKS = {
    'reverse': lambda x: x[::-1],
    'copy': lambda x: x,
    'sort': np.sort,
}
FIRST_SYMBOL = 3


@dataclasses.dataclass
class SyntheticConfig(tfds.core.BuilderConfig):
  task: str = 'reverse'
  num_symbols: int = 16
  min_len: int = 1
  max_len: int = 16
  num_train: int = 50_000
  num_eval: int = 1_000
  seed: int = 0


class SyntheticTasks(tfds.core.GeneratorBasedBuilder):
  """Reverse / copy / sort of random symbol sequences."""
  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIGS = []

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'inputs': tfds.features.Tensor(shape=(None,), dtype=np.int32),
            'targets': tfds.features.Tensor(shape=(None,), dtype=np.int32),
        }),
        supervised_keys=('inputs', 'targets'))

  def _split_generators(self, dl_manager):
    c = self.builder_config
    return {
        'train': self._generate_examples(c.num_train, c.min_len, c.max_len, 0),
        'validation': self._generate_examples(c.num_eval, c.min_len, c.max_len, 1),
        'test': self._generate_examples(c.num_eval, c.min_len, c.max_len, 2),
        'test_long': self._generate_examples(c.num_eval, c.max_len + 1, 2 * c.max_len, 3),
    }

  def _generate_examples(self, num, min_len, max_len, split_seed):
    c = self.builder_config
    rng = np.random.default_rng([c.seed, split_seed])
    fn = TASKS[c.task]
    eos = np.array([EOS_ID], np.int32)
    for i in range(num):
      length = rng.integers(min_len, max_len + 1)
      x = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + c.num_symbols, size=length).astype(np.int32)
      yield i, {'inputs': np.concatenate([x, eos]),
                'targets': np.concatenate([fn(x).astype(np.int32), eos])}


def builder(data_config, data_dir: str | None) -> SyntheticTasks:
  """The builder for config.data (task, num_symbols, min_len, max_len, ...)."""
  d = data_config
  name = (f"{d['task']}_s{d['num_symbols']}_len{d['min_len']}-{d['max_len']}"
          f"_n{d['num_train']}-{d['num_eval']}_seed{d['seed']}")
  config = SyntheticConfig(
      name=name, task=d['task'], num_symbols=d['num_symbols'], min_len=d['min_len'],
      max_len=d['max_len'], num_train=d['num_train'], num_eval=d['num_eval'],
      seed=d['seed'])
  return SyntheticTasks(config=config, data_dir=data_dir, file_format='array_record')


def vocab_size(data_config) -> int:
  return FIRST_SYMBOL + data_config['num_symbols']
