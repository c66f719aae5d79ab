"""Generated sequence tasks: reverse, copy, sort, and the length-generalisation
tasks of data/algorithmic.py; a TFDS builder of them, or (no TFDS) the same
examples in memory.

reverse, copy, sort: sequences of symbols 3..3+num_symbols-1 (0 = PAD, 1 =
BOS, 2 = EOS). The algorithmic tasks (parity_check, ..., mqar, passkey,
flip_flop) draw inputs and targets from their own generators and alphabets.
Lengths (the task's length: algorithmic.py) are uniform in [min_len,
max_len] for train, validation and test; `test_long` holds lengths never
trained on: num_eval examples spread evenly over `test_lengths`, or (none
given) uniform in [max_len + 1, 2 * max_len]. Every input and target ends
with EOS, and every example records its length (`length`), by which
evaluation groups test_long. Generated from a seed: nothing is downloaded.
With tensorflow_datasets installed they are written once as array_record and
read through `tfds.data_source` (no TensorFlow); without it, `in_memory`
generates each split in the order the written files hold it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging

import numpy as np

from flaxformer_lite.data import algorithmic
from flaxformer_lite.tokens import EOS_ID

try:
  import tensorflow_datasets as tfds
except ImportError:  # a machine without TFDS (loading.py then calls in_memory)
  tfds = None

# tfds warns 'Using custom data configuration' for any builder config its
# class does not list, which ours never do (`builder` makes one from config
# values): a warning on every run and plot with nothing to do.
logging.getLogger('absl').addFilter(
    lambda record: not str(record.msg).startswith('Using custom data configuration'))

FIRST_SYMBOL = algorithmic.FIRST_SYMBOL
TASKS = {
    'reverse': lambda x: x[::-1],
    'copy': lambda x: x,
    'sort': np.sort,
}
TASK_NAMES = (*TASKS, *algorithmic.TASKS)


@dataclasses.dataclass(kw_only=True)
class Spec:
  """What the examples are drawn from (config.data's values)."""
  task: str = 'reverse'
  num_symbols: int = 16
  min_len: int = 1
  max_len: int = 16
  num_train: int = 50_000
  num_eval: int = 1_000
  seed: int = 0
  test_lengths: tuple = ()


def spec(data_config) -> Spec:
  """config.data's (or a dict's) values that the examples are drawn from."""
  d = data_config
  return Spec(task=d['task'], num_symbols=d['num_symbols'], min_len=d['min_len'],
              max_len=d['max_len'], num_train=d['num_train'], num_eval=d['num_eval'],
              seed=d['seed'], test_lengths=tuple(int(n) for n in d.get('test_lengths', ())))


def split_plans(c: Spec) -> dict[str, tuple]:
  """split -> the arguments of `generate` that draw it."""
  trained = (c.min_len, c.max_len)
  return {
      'train': (c.num_train, trained, 0),
      'validation': (c.num_eval, trained, 1),
      'test': (c.num_eval, trained, 2),
      'test_long': (c.num_eval, tuple(c.test_lengths) or (c.max_len + 1, 2 * c.max_len), 3,
                    bool(c.test_lengths)),
  }


def generate(c: Spec, num, lengths, split_seed, spread=False):
  """(key, example) for num examples; lengths uniform in the range (lo, hi),
  or with spread the lengths listed, in turn."""
  rng = np.random.default_rng([c.seed, split_seed])
  eos = np.array([EOS_ID], np.int32)
  for i in range(num):
    length = lengths[i % len(lengths)] if spread else rng.integers(lengths[0], lengths[1] + 1)
    x, y = _example(c, rng, int(length))
    yield i, {'inputs': np.concatenate([x, eos]), 'targets': np.concatenate([y, eos]),
              'length': np.int32(length)}


def _example(c: Spec, rng, length: int):
  """(inputs, targets) int32 symbols of one example of c.task, no EOS."""
  if c.task in algorithmic.TASKS:
    return algorithmic.TASKS[c.task].generate(rng, length)
  x = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + c.num_symbols, size=length).astype(np.int32)
  return x, TASKS[c.task](x).astype(np.int32)


def in_memory(data_config) -> dict[str, list[dict]]:
  """split -> its examples in the order the builder's files hold them: TFDS
  writes a split sorted by the md5 of split name + key (tfds.core.hashing)."""
  c = spec(data_config)
  splits = {}
  for split, plan in split_plans(c).items():
    keyed = sorted(generate(c, *plan),
                   key=lambda item: hashlib.md5(f'{split}{item[0]}'.encode()).hexdigest())
    splits[split] = [example for _, example in keyed]
  return splits


if tfds is not None:
  @dataclasses.dataclass
  class SyntheticConfig(tfds.core.BuilderConfig, Spec):
    """A Spec with the builder config's name (builder() makes it from the values)."""

  class SyntheticTasks(tfds.core.GeneratorBasedBuilder):
    """Reverse / copy / sort of random symbol sequences, and the algorithmic tasks."""
    VERSION = tfds.core.Version('1.1.0')
    RELEASE_NOTES = {'1.1.0': 'the algorithmic tasks; each example records its length'}
    BUILDER_CONFIGS = []

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self,
          description=__doc__,
          features=tfds.features.FeaturesDict({
              'inputs': tfds.features.Tensor(shape=(None,), dtype=np.int32),
              'targets': tfds.features.Tensor(shape=(None,), dtype=np.int32),
              'length': tfds.features.Tensor(shape=(), dtype=np.int32),
          }),
          supervised_keys=('inputs', 'targets'))

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(*plan)
              for split, plan in split_plans(self.builder_config).items()}

    def _generate_examples(self, num, lengths, split_seed, spread=False):
      return generate(self.builder_config, num, lengths, split_seed, spread)


def builder(data_config, data_dir: str | None) -> SyntheticTasks:
  """The builder for config.data (task, num_symbols, min_len, max_len,
  test_lengths, ...)."""
  c = spec(data_config)
  tested = f"_test{'-'.join(map(str, c.test_lengths))}" if c.test_lengths else ''
  name = (f"{c.task}_s{vocab_size(data_config) - FIRST_SYMBOL}_len{c.min_len}-{c.max_len}"
          f"{tested}_n{c.num_train}-{c.num_eval}_seed{c.seed}")
  return SyntheticTasks(config=SyntheticConfig(name=name, **dataclasses.asdict(c)),
                        data_dir=data_dir, file_format='array_record')


def vocab_size(data_config) -> int:
  task = data_config['task']
  if task in algorithmic.TASKS:
    return FIRST_SYMBOL + algorithmic.TASKS[task].vocab
  return FIRST_SYMBOL + data_config['num_symbols']


def longest(data_config) -> int:
  """The longest input or target of any split, EOS included (a bound)."""
  d = data_config
  test_lengths = tuple(d.get('test_lengths', ()))
  length = max(d['max_len'], *test_lengths) if test_lengths else 2 * d['max_len']
  if d['task'] in algorithmic.TASKS:
    return algorithmic.TASKS[d['task']].longest(length) + 1
  return length + 1
