"""algorithmic.py: each task's labels against a plain-Python reference written
apart from the generator, token ranges, lengths, seeding, hand examples."""
import numpy as np
import pytest

from flaxformer_lite.data import algorithmic
from flaxformer_lite.data.algorithmic import FIRST_SYMBOL, GROUPS, TASKS, examples

LENGTHS = (1, 2, 3, 4, 5, 8, 13)  # 8 examples each: 56 per task


def _decode(tokens):
  return [int(t) - FIRST_SYMBOL for t in tokens]


# References: decoded inputs (symbols from 0) -> the targets the task's
# definition gives, by a route of their own; they also check the input format.

def _parity(x):
  ones = 0
  for s in x:
    assert s in (0, 1)
    if s == 1:
      ones += 1
  return [1 if ones % 2 else 0]


def _even_pairs(x):
  text = ''.join('ab'[s] for s in x)
  count = sum(text[i:i + 2] in ('ab', 'ba') for i in range(len(text) - 1))
  return [0 if count % 2 == 0 else 1]


def _cycle(x):
  position = 0
  for s in x:
    position = (position + {0: -1, 1: 0, 2: 1}[s]) % 5
  return [position]


def _modular(x):
  assert len(x) % 2 == 1
  assert all(s < 5 for s in x[0::2]) and all(5 <= s < 8 for s in x[1::2])
  return [eval(''.join('01234+-*'[s] for s in x)) % 5]  # Python's precedence


def _brackets(x):
  return [eval(''.join('01234+-*()'[s] for s in x)) % 5]


def _reverse(x):
  out = []
  for s in x:
    out.insert(0, s)
  return out


def _stack(x):
  stack, acting = [], False
  for s in x:
    if s in (0, 1):
      assert not acting, 'stack bits after the first action'
      stack.append(s)
      continue
    acting = True
    if s == 2:
      if stack:
        stack.pop()
    else:
      stack.append({3: 0, 4: 1}[s])
  assert stack or acting
  return list(reversed(stack))


def _duplicate(x):
  return list(x) + list(x)


def _missing(x):
  if x == [1]:  # length 1: the paper's placeholder example
    return [1]
  if len(x) % 2:
    assert x[-1] == 3
    x = x[:-1]
  assert x.count(2) == 1 and 3 not in x
  half, i = len(x) // 2, x.index(2)
  twin = i - half if i >= half else i + half
  assert [s for j, s in enumerate(x[:half]) if j % half != i % half] == \
      [s for j, s in enumerate(x[half:]) if j % half != i % half]
  return [x[twin]]


def _lsb_first_int(bits):
  assert bits and all(b in (0, 1) for b in bits)
  return int(''.join(str(b) for b in reversed(bits)), 2)


def _binary_addition(x):
  if len(x) < 3:
    total = _lsb_first_int(x)
  else:
    assert x.count(2) == 1
    a, b = x[:x.index(2)], x[x.index(2) + 1:]
    assert _lsb_first_int(a) > 0 and _lsb_first_int(b) > 0
    total = _lsb_first_int(a) + _lsb_first_int(b)
  return [int(c) for c in reversed(format(total, 'b'))]


def _bucket_sort(x):
  counts = [0] * 5
  for s in x:
    counts[s] += 1
  return [s for s in range(5) for _ in range(counts[s])]


def _odds_first(x):
  odd = [s for position, s in enumerate(x, start=1) if position % 2 == 1]
  even = [s for position, s in enumerate(x, start=1) if position % 2 == 0]
  return odd + even


def _mqar(x):
  keys = algorithmic.MQAR_KEYS
  n = len(x) // 3
  table = {}
  for k, v in zip(x[0:2 * n:2], x[1:2 * n:2]):
    assert k < keys <= v and k not in table
    table[k] = v
  assert len(set(table.values())) == n
  queries = x[2 * n:]
  assert sorted(queries) == sorted(table)
  return [table[q] for q in queries]


def _passkey(x):
  assert x[-1] == 14 and x.count(13) == 1
  at = x.index(13)
  digits = x[at + 1:at + 6]
  assert all(d < 10 for d in digits)
  filler = x[:at] + x[at + 6:-1]
  assert filler == [10 + j % 3 for j in range(len(filler))]
  return digits


def _flip_flop(x):
  ops, bits = x[0::2], x[1::2]
  assert ops[0] == 2 and (len(ops) == 1 or ops[-1] == 3)
  memory, out = None, []
  for op, bit in zip(ops, bits):
    if op == 2:  # write
      assert bit in (0, 1)
      memory = bit
    elif op == 3:  # read: its bit is hidden
      assert bit == 5
      out.append(memory)
    else:
      assert op == 4 and bit in (0, 1)
  return out


# task -> (reference, input length of `length`, target length or None)
SPECS = {
    'parity_check': (_parity, lambda n: n, lambda n: 1),
    'even_pairs': (_even_pairs, lambda n: n, lambda n: 1),
    'cycle_navigation': (_cycle, lambda n: n, lambda n: 1),
    'modular_arithmetic': (_modular, lambda n: n if n % 2 else n - 1, lambda n: 1),
    'modular_arithmetic_brackets': (_brackets, lambda n: n, lambda n: 1),
    'reverse_string': (_reverse, lambda n: n, lambda n: n),
    'stack_manipulation': (_stack, lambda n: n, None),
    'duplicate_string': (_duplicate, lambda n: n, lambda n: 2 * n),
    'missing_duplicate': (_missing, lambda n: n, lambda n: 1),
    'binary_addition': (_binary_addition, lambda n: n, None),
    'bucket_sort': (_bucket_sort, lambda n: n, lambda n: n),
    'odds_first': (_odds_first, lambda n: n, lambda n: n),
    'mqar': (_mqar, lambda n: 3 * n, lambda n: n),
    'passkey': (_passkey, lambda n: n + 7, lambda n: 5),
    'flip_flop': (_flip_flop, lambda n: 2 * n, None),
}


def _spec(task):
  assert task in SPECS, f'{task}: add its reference and lengths to SPECS'
  return SPECS[task]


@pytest.mark.parametrize('task', sorted(TASKS))
def test_targets_match_the_reference_and_lengths(task):
  reference, input_length, target_length = _spec(task)
  for length in LENGTHS:
    for inputs, targets in examples(task, length, 8, seed=length):
      assert inputs.dtype == targets.dtype == np.int32
      assert inputs.ndim == targets.ndim == 1
      assert len(inputs) == input_length(length)
      if target_length is not None:
        assert len(targets) == target_length(length)
      x = _decode(inputs)
      assert _decode(targets) == reference(x), (task, x)
      assert max(len(inputs), len(targets)) <= TASKS[task].longest(length)


@pytest.mark.parametrize('task', sorted(TASKS))
def test_tokens_in_the_task_range_and_every_symbol_used(task):
  vocab = TASKS[task].vocab
  used = set()
  for inputs, targets in examples(task, (1, 40), 200, seed=0):
    used.update(inputs.tolist(), targets.tolist())
  assert min(used) >= FIRST_SYMBOL  # no PAD, BOS or EOS
  assert used == set(range(FIRST_SYMBOL, FIRST_SYMBOL + vocab))  # vocab is tight


@pytest.mark.parametrize('task', sorted(TASKS))
def test_seeded(task):
  def same(a, b):
    return all(np.array_equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))
  first = examples(task, (1, 12), 20, seed=0)
  assert same(first, examples(task, (1, 12), 20, seed=0))
  assert not same(first, examples(task, (1, 12), 20, seed=1))


@pytest.mark.parametrize('task', sorted(TASKS))
def test_covers_the_length_range(task):
  _, input_length, _ = _spec(task)
  seen = {len(inputs) for inputs, _ in examples(task, (2, 9), 200, seed=0)}
  assert seen == {input_length(n) for n in range(2, 10)}
  assert {len(inputs) for inputs, _ in examples(task, 6, 10, seed=0)} == {input_length(6)}


def test_max_length_is_enforced():
  for name, task in TASKS.items():
    if task.max_length is not None:
      examples(name, task.max_length, 1, seed=0)
      with pytest.raises(ValueError, match=str(task.max_length)):
        examples(name, task.max_length + 1, 1, seed=0)


def test_registry():
  for name, task in TASKS.items():
    assert task.name == name and task.group in GROUPS
    assert task.doc and '\n' not in task.doc and '20' in task.doc  # cites a year
  assert {t.group for t in TASKS.values()} == set(GROUPS)


def test_flip_flop_instruction_frequencies():
  ops = [s for inputs, _ in examples('flip_flop', 500, 20, seed=0)
         for s in _decode(inputs)[2:-2:2]]  # the random ones
  n = len(ops)
  for op, p in ((2, 0.1), (3, 0.1), (4, 0.8)):
    assert abs(ops.count(op) / n - p) < 5 * (p * (1 - p) / n) ** 0.5


def test_bad_arguments():
  with pytest.raises(ValueError, match='unknown task'):
    examples('parity', 3, 1, seed=0)
  with pytest.raises(ValueError, match='lo <= hi'):
    examples('parity_check', (5, 4), 1, seed=0)
  with pytest.raises(ValueError, match='at most 256'):
    examples('mqar', 257, 1, seed=0)


# Hand-computed (symbols from 0): drawn until generated, so they check the
# generators themselves. Most are the papers' own examples.
P, M, T = 5, 6, 7  # + - * in modular_arithmetic
HAND = [
    ('parity_check', [1, 1, 0, 1], [1]),
    ('parity_check', [0, 1, 1, 1, 1], [0]),
    ('even_pairs', [0, 0, 1, 1, 1, 0], [0]),  # 001110: one 01, one 10
    ('even_pairs', [0, 1, 0, 1, 0, 0, 1], [1]),  # 0101001: 2 + 3 pairs
    ('cycle_navigation', [2, 0, 1, 0, 0], [3]),  # +1 -1 0 -1 -1 -> -2 = 3
    ('modular_arithmetic', [1, P, 2, T, 3], [2]),  # 1 + 2 * 3 = 7 (not 9)
    ('modular_arithmetic', [1, M, 1, M, 1], [4]),  # 1 - 1 - 1 = -1
    ('stack_manipulation', [0, 1, 4], [1, 1, 0]),  # 0 1, PUSH 1: top first
    ('stack_manipulation', [1, 2, 2], []),  # POP on an empty stack is a no-op
    ('missing_duplicate', [1, 0, 1, 1, 2, 1, 3], [0]),  # 101 1?1 EMPTY
    ('binary_addition', [1, 1, 2, 1], [0, 0, 1]),  # 3 + 1 = 4, LSB first
    ('binary_addition', [0, 1, 2, 1, 1], [1, 0, 1]),  # 2 + 3 = 5
    ('odds_first', [1, 1, 0], [1, 0, 1]),  # the paper's 110 -> 10 1
    ('bucket_sort', [4, 0, 2, 0], [0, 0, 2, 4]),
]


@pytest.mark.parametrize('task,inputs,targets', HAND)
def test_hand_computed(task, inputs, targets):
  rng = np.random.default_rng(0)
  for _ in range(20_000):  # the rarest, 1 + 2 * 3, comes once in 1125
    x, y = TASKS[task].generate(rng, len(inputs))
    if _decode(x) == inputs:
      assert _decode(y) == targets
      return
  pytest.fail(f'{task} {inputs} was not generated')


def test_bad_lengths_are_config_errors_naming_the_value(tiny_config):
  from flaxformer_lite import config as config_lib, main
  c = tiny_config
  c.data.task = 'mqar'
  c.data.test_lengths = (100, 300)
  with pytest.raises(config_lib.ConfigError, match=r"'mqar' has lengths up to 256.*300"):
    main.validate(c)
  c.data.task, c.data.test_lengths = 'duplicate_string', (0,)
  with pytest.raises(config_lib.ConfigError, match=r'test_lengths=\(0,\) must be lengths >= 1'):
    main.validate(c)
  c.data.test_lengths, c.model.positions, c.model.max_len = (40,), 'learned', 64
  with pytest.raises(config_lib.ConfigError, match=r'model.max_len=64 .* \(81 tokens.*>= 81'):
    main.validate(c)
  c.model.max_len = 81
  main.validate(c)
