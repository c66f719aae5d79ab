"""The two-stream tasks against a plain loop over their definitions: labels,
shapes, seeded determinism, and that neither stream alone tells the label."""
import numpy as np
import pytest

from flaxformer_lite.data import two_stream
from flaxformer_lite.data.algorithmic import FIRST_SYMBOL

N, M, K, NUM = 12, 5, 6, 400


def _decode_claim(token: int):
  """A claim token -> (slot, symbol), by the docstring's layout."""
  return divmod(int(token) - FIRST_SYMBOL - K, K)


def _label(task, a_row, b_row) -> int:
  """The definition, one example at a time."""
  symbols = [int(t) - FIRST_SYMBOL for t in a_row]
  if task == 'presence_control':
    return sum(1 for s in range(M) if s in symbols)
  held = 0
  for token in b_row:
    slot, s = _decode_claim(token)
    if task == 'presence_claims':
      held += s in symbols
    else:
      held += symbols[slot] == s
  return held


@pytest.mark.parametrize('task', two_stream.TASKS)
def test_labels_match_a_plain_loop(task):
  a, b, label = two_stream.examples(task, NUM, n=N, m=M, k=K, seed=[3, 0])
  assert a.shape == (NUM, N) and b.shape == (NUM, M) and label.shape == (NUM,)
  assert a.dtype == b.dtype == label.dtype == np.int32
  assert a.min() >= FIRST_SYMBOL and a.max() < FIRST_SYMBOL + K
  assert b.min() >= FIRST_SYMBOL + K and b.max() < two_stream.vocab_size(N, K)
  want = [_label(task, a[i], b[i]) for i in range(NUM)]
  np.testing.assert_array_equal(label, want)
  assert label.min() >= 0 and label.max() < two_stream.num_classes(M)
  assert len(set(label.tolist())) > 2  # not a constant


@pytest.mark.parametrize('task', two_stream.TASKS)
def test_seeded(task):
  first = two_stream.examples(task, 50, n=N, m=M, k=K, seed=[1, 2])
  again = two_stream.examples(task, 50, n=N, m=M, k=K, seed=[1, 2])
  other = two_stream.examples(task, 50, n=N, m=M, k=K, seed=[1, 3])
  for x, y, z in zip(first, again, other):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(first[0], other[0])


def test_presence_draws_stream_a_from_half_the_alphabet():
  a, _, _ = two_stream.examples('presence_claims', NUM, n=N, m=M, k=K, seed=0)
  assert all(len(set(row.tolist())) <= K // 2 for row in a)


@pytest.mark.parametrize('task', ['presence_claims', 'position_claims'])
def test_neither_stream_alone_tells_a_claim_apart(task):
  """Each claim is true half the time, whatever the claimed symbol (B alone)
  and whatever A's symbols are (A alone): the rate stays near 1/2 within
  every group of either kind."""
  a, b, _ = two_stream.examples(task, 20_000, n=N, m=M, k=K, seed=7)
  truth = np.array([[_label('position_claims' if task == 'position_claims' else task,
                            a[i], b[i, j:j + 1]) for j in range(M)] for i in range(2000)])
  claimed = np.array([[_decode_claim(t)[1] for t in row] for row in b[:2000]])
  first_a = np.repeat(a[:2000, :1] - FIRST_SYMBOL, M, axis=1)
  assert abs(truth.mean() - 0.5) < 0.02
  for groups in (claimed, first_a):
    for g in np.unique(groups):
      rate = truth[groups == g].mean()
      assert abs(rate - 0.5) < 0.06, (g, rate)
