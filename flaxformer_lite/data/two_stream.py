"""Two-stream classification tasks (model.type=two_stream), generated from a seed.

Stream A is `n` symbols (data.max_len) of an alphabet of `k`
(data.num_symbols); stream B is `m` claims about A (data.num_claims), each
true with probability 1/2; the label is how many claims hold, 0..m.
  presence_claims  A draws its symbols from a random half of the alphabet;
                   a claim s says "s occurs in A". What B needs from A is
                   the set of symbols present: k bits, whatever n is.
  position_claims  A draws from the whole alphabet; a claim (p, s) says
                   "A[p] = s" (a false one names another symbol). Each claim
                   is checked against one token of A: the exchange is token
                   by token.
  presence_control the streams of presence_claims, labelled from A alone:
                   how many of the symbols 0..m-1 occur in A. Fusion cannot help.
Neither stream alone tells the label of the claims tasks: given A, each
claim is true with probability 1/2 whatever A is; given B, a claim's truth
depends on A, and the symbols claimed are uniform either way.

Tokens (0, 1, 2 = PAD, BOS, EOS, unused here): symbol s of A is
FIRST_SYMBOL + s; a claim (slot, s) is FIRST_SYMBOL + k + slot * k + s, slot
the position p for position_claims and 0 otherwise. The label is a class
index in [0, m].
"""
from __future__ import annotations

import numpy as np

from flaxformer_lite.data.algorithmic import FIRST_SYMBOL

TASKS = ('presence_claims', 'position_claims', 'presence_control')


def vocab_size(n: int, k: int) -> int:
  """Ids of both streams: symbols of A, then claims (slot 0..n, symbol)."""
  return FIRST_SYMBOL + k + (n + 1) * k


def num_classes(m: int) -> int:
  return m + 1


def claim_tokens(slots, symbols, k: int):
  """(slot, symbol) int arrays -> claim token ids (same shape)."""
  return FIRST_SYMBOL + k + slots * k + symbols


def examples(task: str, num: int, *, n: int, m: int, k: int, seed):
  """num examples of `task`: (a int32 [num, n], b int32 [num, m], label int32
  [num]), drawn from np.random.default_rng(seed)."""
  if task not in TASKS:
    raise ValueError(f'two-stream task {task!r}; valid: {", ".join(TASKS)}')
  rng = np.random.default_rng(seed)
  true = rng.random((num, m)) < 0.5
  if task == 'position_claims':
    a = rng.integers(0, k, size=(num, n))
    slots = rng.integers(0, n, size=(num, m))
    actual = a[np.arange(num)[:, None], slots]
    symbols = np.where(true, actual, (actual + rng.integers(1, k, size=(num, m))) % k)
    label = true.sum(axis=1)
  else:
    half = np.argsort(rng.random((num, k)), axis=1)[:, :k // 2]  # a random half
    a = np.take_along_axis(half, rng.integers(0, k // 2, size=(num, n)), axis=1)
    present = np.zeros((num, k), bool)
    present[np.arange(num)[:, None], a] = True
    # Each claim: a present symbol if true, an absent one if false, uniformly
    # (random keys sorted so that the wanted kind comes first).
    keys = rng.random((num, m, k)) + np.where(present[:, None, :] == true[..., None], 0, 2)
    symbols = np.argmin(keys, axis=-1)
    slots = np.zeros_like(symbols)
    label = (present[:, :m].sum(axis=1) if task == 'presence_control'
             else true.sum(axis=1))
  return ((FIRST_SYMBOL + a).astype(np.int32), claim_tokens(slots, symbols, k).astype(np.int32),
          label.astype(np.int32))
