"""masks.Mask against loops over every (batch, query, key) written from each
mask's definition and against flax's mask builders; block_mask against the
blocks of those loops' arrays; a mask's explicit arrays through &, |, ~ and
with_arrays; the boolean array's conversion (as_mask); the rules a mask of
constructors says (rules_of); a Mask through jit and scan as a pytree."""
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import masks

B, H, N, M = 2, 3, 11, 13


def _loop(rule, n=N, m=M, q_offset=0):
  out = np.zeros((B, H, n, m), bool)
  for b, h, i, j in itertools.product(range(B), range(H), range(n), range(m)):
    out[b, h, i, j] = rule(b, h, q_offset + i, j)
  return out


RNG = np.random.default_rng(0)
KEY_VALID = RNG.random((B, M)) > 0.3
QUERY_VALID = RNG.random((B, N)) > 0.2
Q_SEG = np.sort(RNG.integers(0, 3, (B, N)), axis=1)
K_SEG = np.sort(RNG.integers(0, 3, (B, M)), axis=1)
PREFIX = np.array([4, 0])

CASES = {
    'causal': (masks.causal(), lambda b, h, i, j: j <= i),
    'window': (masks.sliding_window(3), lambda b, h, i, j: abs(j - i) <= 2),
    'causal window': (masks.sliding_window(3, True), lambda b, h, i, j: i - 3 < j <= i),
    'key padding': (masks.key_padding(KEY_VALID), lambda b, h, i, j: KEY_VALID[b, j]),
    'segments': (masks.segments(Q_SEG, K_SEG), lambda b, h, i, j: Q_SEG[b, i] == K_SEG[b, j]),
    'prefix_lm': (masks.prefix_lm(PREFIX), lambda b, h, i, j: j <= i or j < PREFIX[b]),
    'chunked causal': (masks.chunked_causal(4), lambda b, h, i, j: j <= i and j // 4 == i // 4),
    'causal & padding | prefix': (
        (masks.causal() & masks.key_padding(KEY_VALID)) | masks.prefix_lm(PREFIX),
        lambda b, h, i, j: (j <= i and KEY_VALID[b, j]) or j <= i or j < PREFIX[b]),
    'not causal': (~masks.causal(), lambda b, h, i, j: j > i),
    'per head': (masks.Mask(lambda b, h, q, k: (k + h) % 3 != 0, 'heads'),
                 lambda b, h, i, j: (j + h) % 3 != 0),
}


@pytest.mark.parametrize('name', list(CASES))
def test_each_mask_is_its_definition(name):
  mask, rule = CASES[name]
  got = np.broadcast_to(np.asarray(masks.evaluate(mask, B, H, N, M)), (B, H, N, M))
  np.testing.assert_array_equal(got, _loop(rule))


def _blocks_by_hand(dense, n, m, bq, bk, diagonal=False):
  nq, nk = -(-n // bq), -(-m // bk)
  out = np.zeros(dense.shape[:2] + (nq, nk), np.int8)
  above = np.arange(bk)[None, :] > np.arange(bq)[:, None]
  for qb, kb in itertools.product(range(nq), range(nk)):
    block = dense[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]  # real rows and keys only
    whole = block.shape[3] == bk  # a block that runs past m has keys that are not there
    for b, h in itertools.product(range(dense.shape[0]), range(dense.shape[1])):
      cells = block[b, h]
      hides_above = not (cells & above[:cells.shape[0], :cells.shape[1]]).any()
      out[b, h, qb, kb] = (masks.EMPTY if not cells.any() else
                           masks.FULL if whole and cells.all() else
                           masks.DIAGONAL if diagonal and hides_above else masks.PARTIAL)
  return out


@pytest.mark.parametrize('name', list(CASES))
@pytest.mark.parametrize('bq,bk', [(4, 4), (3, 5), (11, 13)])
def test_block_mask_marks_each_block_empty_partial_or_full(name, bq, bk):
  mask, rule = CASES[name]
  q_offset = 2 if name == 'causal' else 0  # a decoding call's later queries
  got = np.asarray(masks.block_mask(mask, B, H, N, M, bq, bk, q_offset=q_offset))
  want = _blocks_by_hand(_loop(rule, q_offset=q_offset), N, M, bq, bk)
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


@pytest.mark.parametrize('name', list(CASES))
def test_block_mask_marks_the_blocks_hidden_above_their_diagonal(name):
  mask, rule = CASES[name]
  got = np.asarray(masks.block_mask(mask, B, H, N, M, 4, 4, diagonal=True))
  want = _blocks_by_hand(_loop(rule), N, M, 4, 4, diagonal=True)
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_causal_blocks_are_the_staircase():
  got = np.asarray(masks.block_mask(masks.causal(), 1, 1, 8, 8, 4, 4, diagonal=True))[0, 0]
  np.testing.assert_array_equal(got, [[masks.DIAGONAL, masks.EMPTY],
                                      [masks.FULL, masks.DIAGONAL]])


# ---- against flax's builders ----------------------------------------------------

@pytest.mark.parametrize('causal', [False, True])
def test_padding_and_causal_equal_flax_masks(causal):
  ids = RNG.integers(1, 9, size=(3, 11))
  ids[0, 7:] = 0
  ids[1, :] = 0  # all padding
  ids[2, 3] = 0  # a hole
  mask = masks.padding(ids > 0) & masks.causal() if causal else masks.padding(ids > 0)
  want = nn.make_attention_mask(ids > 0, ids > 0)
  if causal:
    want = nn.combine_masks(want, nn.make_causal_mask(ids))
  got = masks.evaluate(mask, 3, 1, 11, 11)
  np.testing.assert_array_equal(np.broadcast_to(got, (3, 1, 11, 11)), np.asarray(want, bool))


def test_cross_attention_padding_equals_flax():
  q_valid, k_valid = RNG.random((3, 7)) < 0.75, RNG.random((3, 12)) < 0.75
  want = np.asarray(nn.make_attention_mask(q_valid, k_valid), bool)
  got = masks.evaluate(masks.query_padding(q_valid) & masks.key_padding(k_valid), 3, 1, 7, 12)
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


@pytest.mark.parametrize('q_offset', [0, 4])
def test_causal_with_offset_equals_flax_positions(q_offset):
  """Query i at position q_offset + i sees key j <= its position (a cache)."""
  n, m = 5, 12
  want = nn.make_attention_mask((q_offset + np.arange(n))[None], np.arange(m)[None],
                                pairwise_fn=jnp.greater_equal)
  got = masks.evaluate(masks.causal(), 1, 1, n, m, q_offset)
  np.testing.assert_array_equal(np.broadcast_to(got, (1, 1, n, m)), np.asarray(want, bool))


# ---- a boolean array, once at the entry -----------------------------------------

@pytest.mark.parametrize('shape', [(B, H, N, M), (B, 1, N, M), (1, 1, N, M), (B, 1, 1, M),
                                   (1, 1, N, 1), (N, M)])
@pytest.mark.parametrize('q_offset', [0, 3])
def test_a_boolean_array_converts_to_the_same_mask(shape, q_offset):
  """Row i of the array is query index q_offset + i; every broadcastable shape."""
  allowed = RNG.random(shape) < 0.6
  mask = masks.as_mask(allowed, q_offset)
  got = masks.evaluate(mask, B, H, N, M, q_offset)
  want = np.broadcast_to(allowed.reshape((1,) * (4 - len(shape)) + shape), (B, H, N, M))
  np.testing.assert_array_equal(np.broadcast_to(got, (B, H, N, M)), want)


def test_as_mask_passes_a_mask_and_none_and_refuses_anything_else():
  mask = masks.causal()
  assert masks.as_mask(mask) is mask and masks.as_mask(None) is None
  with pytest.raises(TypeError, match='masks.Mask'):
    masks.as_mask('causal')


# ---- rules ----------------------------------------------------------------------

def test_rules_of_a_mask_of_constructors_name_each_part_with_its_arrays():
  mask = (masks.causal() & masks.key_padding(KEY_VALID) & masks.query_padding(QUERY_VALID)
          & masks.segments(Q_SEG, K_SEG))
  rules = masks.rules_of(mask)
  assert rules.causal and rules.window is None
  np.testing.assert_array_equal(rules.key_valid, KEY_VALID)
  np.testing.assert_array_equal(rules.query_valid, QUERY_VALID)
  np.testing.assert_array_equal(rules.segments[0], Q_SEG)
  np.testing.assert_array_equal(rules.segments[1], K_SEG)
  window = masks.rules_of(masks.sliding_window(5, True) & masks.padding(KEY_VALID[:, :N]))
  assert (window.causal, window.window, window.window_causal) == (False, 5, True)
  assert masks.rules_of(None) == masks.Rules() and not masks.Rules(causal=True).has_more()


@pytest.mark.parametrize('mask', [masks.prefix_lm(PREFIX), masks.causal() | masks.causal(),
                                  ~masks.causal(), masks.causal() & masks.chunked_causal(4),
                                  masks.as_mask(np.ones((N, M), bool))])
def test_rules_of_any_other_mask_is_none(mask):
  assert masks.rules_of(mask) is None


def test_a_mask_passes_jit_and_scan_as_a_pytree():
  """Its arrays are the leaves: a jitted function of a mask and a scan that
  broadcasts it (scanned layers) evaluate the rule on the arrays given."""
  mask = masks.causal() & masks.key_padding(KEY_VALID)
  assert len(jax.tree.leaves(mask)) == 1
  got = jax.jit(lambda mk: masks.evaluate(mk, B, 1, N, M))(mask)
  np.testing.assert_array_equal(np.broadcast_to(got, (B, 1, N, M)),
                                _loop(lambda b, h, i, j: j <= i and KEY_VALID[b, j])[:, :1])
  _, stacked = jax.lax.scan(lambda c, _: (c, masks.evaluate(mask, B, 1, N, M)), 0, None,
                            length=2)
  np.testing.assert_array_equal(np.broadcast_to(stacked[0], got.shape), got)


def _evaluated(mask):
  return np.broadcast_to(np.asarray(masks.evaluate(mask, B, H, N, M)), (B, H, N, M))


def test_with_arrays_gives_the_same_rule_on_other_arrays():
  mask = masks.key_padding(KEY_VALID)
  assert len(mask.arrays) == 1
  other = ~KEY_VALID
  np.testing.assert_array_equal(_evaluated(mask.with_arrays([jnp.asarray(other)])),
                                _loop(lambda b, h, i, j: other[b, j]))
  np.testing.assert_array_equal(_evaluated(mask), _loop(lambda b, h, i, j: KEY_VALID[b, j]))
  with pytest.raises(ValueError):
    mask.with_arrays(())


def test_combined_masks_hand_each_part_its_own_arrays():
  mask = (masks.key_padding(KEY_VALID) & masks.segments(Q_SEG, K_SEG)) | ~masks.prefix_lm(PREFIX)
  assert [a.shape for a in mask.arrays] == [(B, M), (B, N), (B, M), (B,)]
  valid, q_seg, k_seg, prefix = KEY_VALID[::-1], Q_SEG[::-1], K_SEG[::-1], np.array([1, 6])
  replaced = mask.with_arrays(jnp.asarray(x) for x in (valid, q_seg, k_seg, prefix))
  np.testing.assert_array_equal(_evaluated(replaced), _loop(
      lambda b, h, i, j: (valid[b, j] and q_seg[b, i] == k_seg[b, j])
      or not (j <= i or j < prefix[b])))


def test_a_mask_written_with_its_own_arrays():
  per_head = RNG.integers(1, 4, H)
  mask = masks.Mask(lambda b, h, q, k, width: k % width[h] == 0, 'strided', (jnp.asarray(per_head),))
  np.testing.assert_array_equal(_evaluated(mask & masks.causal()),
                                _loop(lambda b, h, i, j: j % per_head[h] == 0 and j <= i))


def test_a_mask_that_closes_over_its_data_is_told_apart_from_one_that_takes_it():
  """A fused kernel takes a mask's data as inputs: masks.closes_over_arrays
  finds a function that captured an array (so 'auto' keeps the other
  kernels), and not one that reads its `arrays` or only its indices."""
  lengths = jnp.asarray([3, 0])
  captured = masks.Mask(lambda b, h, q, k: (k <= q) | (k < lengths[b]))
  given = masks.Mask(lambda b, h, q, k, n: (k <= q) | (k < n[b]), arrays=(lengths,))
  assert masks.closes_over_arrays(captured)
  assert not masks.closes_over_arrays(given)
  assert not masks.closes_over_arrays(masks.causal() & masks.key_padding(jnp.ones((2, 5), bool)))
  assert masks.closes_over_arrays(masks.causal() & captured)
