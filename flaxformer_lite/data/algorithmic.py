"""Seeded numpy generators of the standard length-generalisation tasks.

Deletang et al. 2023, "Neural Networks and the Chomsky Hierarchy" (appendix;
Ruoss et al. 2023, "Randomized Positional Encodings", use the same tasks),
grouped as there: regular, context_free, context_sensitive; plus retrieval
tasks (MQAR, passkey, flip-flop). `length` is the paper's task length: the
length of the task string (the input), except where a task's line says
otherwise (mqar: key-value pairs; flip_flop: instructions; passkey: filler).

Tokens: 0 = PAD, 1 = BOS, 2 = EOS (data/synthetic.py). Each task has its own
small alphabet of `vocab` symbols, symbol s -> token FIRST_SYMBOL + s; inputs
and targets share it (a bit is the same token in both), so the vocabulary
size is FIRST_SYMBOL + vocab. Binary digits 0/1 are symbols 0/1; operators,
separators and markers follow the task's digits. No EOS is appended: the
caller does. A class label (parity, final position, ...) is a one-symbol
target.

Every generator is `generate(rng, length) -> (inputs, targets)`, 1-D int32
token arrays of one example, drawn from a `np.random.Generator`;
`examples(task, lengths, num, seed)` draws many, reproducibly.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import numpy as np

FIRST_SYMBOL = 3  # ids 0, 1, 2 are PAD, BOS, EOS (tokens.py)
GROUPS = ('regular', 'context_free', 'context_sensitive', 'retrieval')
MODULUS = 5            # modular arithmetic, cycle length (the paper's 5)
BUCKET_SYMBOLS = 5     # bucket_sort's alphabet (the paper's 5)
MQAR_KEYS = 256        # mqar's key alphabet: at most this many pairs
MQAR_VALUES = 256      # mqar's value alphabet, after the keys
PASSKEY_DIGITS = 5
FLIP_FLOP_P = (0.1, 0.1, 0.8)  # p(w), p(r), p(i): FFL(0.8)


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: `generate(rng, length)` -> (inputs [n] int32, targets [m] int32)
  tokens in [FIRST_SYMBOL, FIRST_SYMBOL + vocab); `doc` one line, citing;
  `longest(length)` bounds max(n, m); `max_length` the longest valid length
  (None: any)."""
  name: str
  group: str
  vocab: int
  generate: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]
  doc: str
  longest: Callable[[int], int] = lambda length: length
  max_length: int | None = None


def _bits(rng, n):
  return rng.integers(0, 2, size=n)


# --- regular -----------------------------------------------------------------

def parity_check(rng, length):
  """bits [length] -> [1]: 0 if the number of ones is even, else 1."""
  x = _bits(rng, length)
  return x, [x.sum() % 2]


def even_pairs(rng, length):
  """{a=0, b=1} [length] -> [1]: 0 if the count of 'ab' plus 'ba' is even,
  1 if odd (the paper's classes)."""
  x = _bits(rng, length)
  return x, [np.count_nonzero(x[1:] != x[:-1]) % 2]


def cycle_navigation(rng, length):
  """moves [length], symbols 0 = -1, 1 = stay, 2 = +1 -> [1]: the final
  position 0..4 on a cycle of 5, starting at 0."""
  moves = rng.integers(0, 3, size=length)
  return moves, [(moves - 1).sum() % MODULUS]


def _evaluate(numbers, ops):
  """numbers [k+1] and ops [k] (0 '+', 1 '-', 2 '*') -> value mod 5, with '*'
  before '+' and '-'; '-' negates the term it starts."""
  total, term = 0, int(numbers[0])
  for op, n in zip(ops, numbers[1:]):
    if op == 2:
      term *= int(n)
    else:
      total += term
      term = int(n) if op == 0 else -int(n)
  return (total + term) % MODULUS


def modular_arithmetic(rng, length):
  """digits 0..4 alternating with ops (5 '+', 6 '-', 7 '*'), [length] if odd
  else [length - 1] (the paper drops one) -> [1]: the value mod 5 under the
  usual precedence, e.g. 1+2*3 -> 2, 1-1-1 -> 4."""
  n = length if length % 2 else length - 1
  numbers = rng.integers(0, MODULUS, size=n // 2 + 1)
  ops = rng.integers(0, 3, size=n // 2)
  x = np.empty(n, np.int64)
  x[0::2], x[1::2] = numbers, MODULUS + ops
  return x, [_evaluate(numbers, ops)]


# --- context-free --------------------------------------------------------------

_PLUS, _MINUS, _TIMES, _OPEN, _CLOSE = 5, 6, 7, 8, 9  # after the digits 0..4


def _bracket_expression(rng, length):
  """The paper's recursive grammar -> (symbols [length], value mod 5)."""
  if length <= 4:
    d = int(rng.integers(0, MODULUS))
    return {1: ([d], d), 2: ([_MINUS, d], -d % MODULUS),
            3: ([_OPEN, d, _CLOSE], d),
            4: ([_OPEN, _MINUS, d, _CLOSE], -d % MODULUS)}[length]
  left_length = int(rng.integers(1, length - 3))
  left, a = _bracket_expression(rng, left_length)
  right, b = _bracket_expression(rng, length - left_length - 3)
  op = int(rng.integers(0, 3))
  value = (a + b, a - b, a * b)[op] % MODULUS
  return [_OPEN] + left + [_PLUS + op] + right + [_CLOSE], value


def modular_arithmetic_brackets(rng, length):
  """expression [length] over digits 0..4, 5 '+', 6 '-', 7 '*', 8 '(', 9 ')'
  -> [1]: its value mod 5. Lengths 1-4 are d, -d, (d), (-d); longer ones
  (L op R) with len(L) uniform in [1, length - 4]."""
  x, value = _bracket_expression(rng, length)
  return x, [value]


def reverse_string(rng, length):
  """bits [length] -> the same bits reversed [length]."""
  x = _bits(rng, length)
  return x, x[::-1]


def stack_manipulation(rng, length):
  """[length] = a stack of bits, bottom to top ([k], k uniform in
  [1, length - 1]), then length - k actions 2 POP, 3 PUSH 0, 4 PUSH 1 ->
  the final stack top first [0..length] (POP on an empty stack does nothing;
  the target may be empty). Length 1: one bit, no actions."""
  if length == 1:
    x = _bits(rng, 1)
    return x, x
  k = int(rng.integers(1, length))
  stack, actions = _bits(rng, k), rng.integers(2, 5, size=length - k)
  cells, top = np.zeros(length, np.int64), k
  cells[:k] = stack
  for action in actions:
    if action == 2:
      top = max(top - 1, 0)
    else:
      cells[top] = action - 3
      top += 1
  return np.concatenate([stack, actions]), cells[:top][::-1]


# --- context-sensitive -----------------------------------------------------------

def duplicate_string(rng, length):
  """bits w [length] -> ww [2 * length]."""
  x = _bits(rng, length)
  return x, np.concatenate([x, x])


def missing_duplicate(rng, length):
  """ww (w bits [length // 2]) with one position replaced by 2 MASK, then
  3 EMPTY if length is odd, [length] -> [1]: the masked bit. Length 1 is
  input [1], target [1], as in the paper's code."""
  if length == 1:
    return [1], [1]
  x = np.tile(_bits(rng, length // 2), 2)
  i = rng.integers(0, len(x))
  target = [x[i]]
  x[i] = 2
  return np.concatenate([x, [3] * (length % 2)]), target


def _nonzero_bits(rng, n):
  while True:
    x = _bits(rng, n)
    if x.any():
      return x


def binary_addition(rng, length):
  """a 2 '+' b [length], a and b least significant bit first, [n] and
  [length - 1 - n] with n uniform in [1, length - 2], each uniform in
  [1, 2^len - 1] (high zeros kept) -> a + b [<= length], least significant
  bit first, no high zeros. Lengths 1, 2: one number, no '+', -> itself."""
  if length < 3:
    x = _bits(rng, length)
    return x, np.trim_zeros(x, 'b') if x.any() else [0]
  n = int(rng.integers(1, length - 1))
  a, b = _nonzero_bits(rng, n), _nonzero_bits(rng, length - 1 - n)
  total, carry = [], 0
  for i in range(max(len(a), len(b))):
    s = carry + (a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
    total.append(s % 2)
    carry = s // 2
  total = np.trim_zeros(np.array(total + [carry]), 'b')
  return np.concatenate([a, [2], b]), total


def bucket_sort(rng, length):
  """symbols 0..4 [length] -> the same sorted ascending [length]."""
  x = rng.integers(0, BUCKET_SYMBOLS, size=length)
  return x, np.sort(x)


def odds_first(rng, length):
  """bits s1..sn [length] -> s1 s3 s5 ... s2 s4 ... [length] (1-based odd
  positions first, as the paper's text and examples: 110 -> 10 1)."""
  x = _bits(rng, length)
  return x, np.concatenate([x[0::2], x[1::2]])


# --- retrieval -------------------------------------------------------------------

def mqar(rng, length):
  """k1 v1 ... kn vn (n = length <= 256 pairs; keys distinct, symbols 0..255;
  values distinct, 256..511) then the n keys in a random order [3n] -> their
  values in that order [n]."""
  if length > MQAR_KEYS:
    raise ValueError(f'mqar: at most {MQAR_KEYS} key-value pairs, got {length}')
  keys = rng.choice(MQAR_KEYS, size=length, replace=False)
  values = MQAR_KEYS + rng.choice(MQAR_VALUES, size=length, replace=False)
  order = rng.permutation(length)
  pairs = np.stack([keys, values], axis=1).reshape(-1)
  return np.concatenate([pairs, keys[order]]), values[order]


_FILLER, _KEY_MARKER, _QUERY = 10, 13, 14  # after the digits 0..9


def passkey(rng, length):
  """filler [length] (the pattern 10 11 12 10 11 12 ...) with 13 MARKER and
  5 digits 0..9 inserted at a uniform gap, then 14 QUERY [length + 7] ->
  the 5 digits [5]."""
  filler = _FILLER + np.arange(length) % 3
  key = rng.integers(0, 10, size=PASSKEY_DIGITS)
  at = rng.integers(0, length + 1)
  return np.concatenate([filler[:at], [_KEY_MARKER], key, filler[at:], [_QUERY]]), key


_WRITE, _READ, _HIDDEN = 2, 3, 5  # 4 is ignore


def flip_flop(rng, length):
  """length instructions, each an instruction (2 w, 3 r, 4 i; p = 0.1, 0.1,
  0.8) then a bit [2 * length]; the first is w and the last r (length > 1);
  a read's bit is hidden as 5 '?' -> the bits of the last write before each
  read, in order [number of reads]."""
  ops = _WRITE + rng.choice(3, size=length, p=FLIP_FLOP_P)
  ops[0] = _WRITE
  if length > 1:
    ops[-1] = _READ
  data = _bits(rng, length)
  last_write = np.maximum.accumulate(np.where(ops == _WRITE, np.arange(length), 0))
  reads = ops == _READ
  targets = data[last_write][reads]
  data[reads] = _HIDDEN
  return np.stack([ops, data], axis=1).reshape(-1), targets


# --- registry ----------------------------------------------------------------------

def _tokens(fn):
  """A task's symbol generator -> one that returns int32 tokens."""
  def generate(rng: np.random.Generator, length: int):
    if length < 1:
      raise ValueError(f'{fn.__name__}: length must be >= 1, got {length}')
    inputs, targets = fn(rng, length)
    return (np.asarray(inputs, np.int32) + FIRST_SYMBOL,
            np.asarray(targets, np.int32) + FIRST_SYMBOL)
  generate.__name__, generate.__doc__ = fn.__name__, fn.__doc__
  return generate


_DCH = 'Deletang et al. 2023, Neural Networks and the Chomsky Hierarchy'
TASKS: dict[str, Task] = {t.name: t for t in [
    Task('parity_check', 'regular', 2, _tokens(parity_check),
         f'bits -> parity of the number of ones ({_DCH}).'),
    Task('even_pairs', 'regular', 2, _tokens(even_pairs),
         f"a/b string -> 0 if #ab + #ba is even, else 1 ({_DCH})."),
    Task('cycle_navigation', 'regular', 5, _tokens(cycle_navigation),
         f'moves -1/stay/+1 -> final position on a cycle of 5 ({_DCH}).'),
    Task('modular_arithmetic', 'regular', 8, _tokens(modular_arithmetic),
         f'0..4 and + - * alternating -> value mod 5, * before +/- as in the '
         f"paper's code; even lengths drop one ({_DCH})."),
    Task('modular_arithmetic_brackets', 'context_free', 10,
         _tokens(modular_arithmetic_brackets),
         f'bracketed + - * expression over 0..4 -> value mod 5, the paper\'s '
         f'grammar with * (mult=True) ({_DCH}).'),
    Task('reverse_string', 'context_free', 2, _tokens(reverse_string),
         f'bits -> reversed ({_DCH}).'),
    Task('stack_manipulation', 'context_free', 5, _tokens(stack_manipulation),
         f'stack bottom-to-top then POP/PUSH 0/PUSH 1 -> final stack top first, '
         f'no termination symbol (the caller\'s EOS ends it) ({_DCH}).'),
    Task('duplicate_string', 'context_sensitive', 2, _tokens(duplicate_string),
         f'w -> ww ({_DCH}).', longest=lambda n: 2 * n),
    Task('missing_duplicate', 'context_sensitive', 4, _tokens(missing_duplicate),
         f'ww with one MASK (EMPTY pad at odd length) -> the masked bit ({_DCH}).'),
    Task('binary_addition', 'context_sensitive', 3, _tokens(binary_addition),
         f'a + b, LSB first -> sum LSB first, no padding or termination '
         f'symbol ({_DCH}).'),
    Task('bucket_sort', 'context_sensitive', 5, _tokens(bucket_sort),
         f'string over 5 symbols -> sorted ({_DCH}).'),
    Task('odds_first', 'context_sensitive', 2, _tokens(odds_first),
         f"w -> symbols at odd then even 1-based positions (the paper's text; its "
         f'code puts the even ones first) ({_DCH}).'),
    Task('mqar', 'retrieval', MQAR_KEYS + MQAR_VALUES, _tokens(mqar),
         'key-value pairs then every key once, contiguous, no noise tokens -> '
         'their values (Arora et al. 2023, Zoology, multi-query associative '
         'recall).', longest=lambda n: 3 * n, max_length=MQAR_KEYS),
    Task('passkey', 'retrieval', 15, _tokens(passkey),
         'filler with MARKER + 5 digits at a random place, then QUERY -> the '
         'digits, token-level and stated once (Mohtashami & Jaggi 2023, '
         'Landmark Attention).', longest=lambda n: n + 7),
    Task('flip_flop', 'retrieval', 6, _tokens(flip_flop),
         "w/r/i + bit instructions, FFL(0.8), read bits hidden -> the bits "
         "each read must copy (Liu et al. 2023, Exposing Attention Glitches "
         "with Flip-Flop Language Modeling).", longest=lambda n: 2 * n),
]}


def examples(task: str, lengths: int | tuple[int, int], num: int,
             seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """`num` (inputs, targets) pairs of `task`, 1-D int32 token arrays each.

  lengths: one length, or an inclusive range (lo, hi) each example's length
  is drawn from uniformly. The same arguments give the same arrays: the
  generator is seeded by (seed, the task's name).
  """
  if task not in TASKS:
    raise ValueError(f'unknown task {task!r}; one of {sorted(TASKS)}')
  lo, hi = (lengths, lengths) if np.ndim(lengths) == 0 else lengths
  if not 1 <= lo <= hi:
    raise ValueError(f'lengths must be 1 <= lo <= hi, got {lengths}')
  rng = np.random.default_rng([seed, zlib.crc32(task.encode())])
  generate = TASKS[task].generate
  return [generate(rng, int(rng.integers(lo, hi + 1))) for _ in range(num)]
