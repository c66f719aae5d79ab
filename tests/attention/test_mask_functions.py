"""Masks as functions (masks.Mask) against loops over every (batch, query, key)
written from each mask's definition, and block_mask against the blocks of
those loops' arrays; a mask's explicit arrays, through &, |, ~ and
with_arrays."""
import itertools

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


def _blocks_by_hand(dense, n, m, bq, bk):
  nq, nk = -(-n // bq), -(-m // bk)
  out = np.zeros(dense.shape[:2] + (nq, nk), np.int8)
  for qb, kb in itertools.product(range(nq), range(nk)):
    block = dense[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]  # real rows and keys only
    whole = block.shape[3] == bk  # a block that runs past m has keys that are not there
    for b, h in itertools.product(range(dense.shape[0]), range(dense.shape[1])):
      cells = block[b, h]
      out[b, h, qb, kb] = (masks.EMPTY if not cells.any() else
                           masks.FULL if whole and cells.all() else masks.PARTIAL)
  return out


@pytest.mark.parametrize('name', list(CASES))
@pytest.mark.parametrize('bq,bk', [(4, 4), (3, 5), (11, 13)])
def test_block_mask_marks_each_block_empty_partial_or_full(name, bq, bk):
  mask, rule = CASES[name]
  q_offset = 2 if name == 'causal' else 0  # a decoding call's later queries
  got = np.asarray(masks.block_mask(mask, B, H, N, M, bq, bk, q_offset=q_offset))
  want = _blocks_by_hand(_loop(rule, q_offset=q_offset), N, M, bq, bk)
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_causal_blocks_are_the_staircase():
  got = np.asarray(masks.block_mask(masks.causal(), 1, 1, 8, 8, 4, 4))[0, 0]
  np.testing.assert_array_equal(got, [[masks.PARTIAL, masks.EMPTY],
                                      [masks.FULL, masks.PARTIAL]])


@pytest.mark.parametrize('parts', [
    dict(causal=True), dict(window=3), dict(window=3, window_causal=True),
    dict(causal=True, key_valid=KEY_VALID[:, :N], query_valid=QUERY_VALID),
    dict(query_segments=Q_SEG, key_segments=Q_SEG, key_valid=KEY_VALID[:, :N]),
    dict(dense=RNG.random((1, 1, N, N)) > 0.5, causal=True), dict()])
def test_a_mask_spec_as_a_function_is_its_dense_mask(parts):
  spec = masks.MaskSpec(**parts)
  want = spec.to_dense(N, N)
  want = np.ones((1, 1, N, N), bool) if want is None else np.asarray(want)
  got = masks.evaluate(spec.to_mask(), B, H, N, N)
  np.testing.assert_array_equal(np.broadcast_to(got, (B, H, N, N)),
                                np.broadcast_to(want, (B, H, N, N)))


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
