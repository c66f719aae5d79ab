"""masks.MaskSpec against independent references.

`to_dense` against flax's nn.make_attention_mask / nn.make_causal_mask (and,
for what flax has no builder for, a position-by-position numpy rule); `block`
against the slice of `to_dense`; `key_block_range` / `query_block_range`
against the blocks of `to_dense` that hold a visible pair: none left out (the
chunked kernel's loops run over those ranges only) and none taken in that
holds no visible pair (the skipping that kernels/blockwise.py promises).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention.masks import MaskSpec, as_dense


def _valid(rng, b, n, p=0.75):
  """bool [b, n] with some False, including a row that is all False."""
  x = rng.random((b, n)) < p
  x[-1] = False
  return x


def _numpy_rule(n, m, q_offset, causal, window, window_causal):
  """bool [n, m]: the module docstring's rule, pair by pair."""
  out = np.ones((n, m), bool)
  for i in range(n):
    p = q_offset + i
    for j in range(m):
      if causal and not j <= p:
        out[i, j] = False
      if window is not None:
        inside = (p - window < j <= p) if window_causal else abs(j - p) < window
        if not inside:
          out[i, j] = False
  return out


# ---- to_dense ------------------------------------------------------------------

@pytest.mark.parametrize('causal', [False, True])
def test_to_dense_equals_flax_padding_and_causal_masks(causal):
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 9, size=(3, 11))
  ids[0, 7:] = 0
  ids[1, :] = 0  # all padding
  ids[2, 3] = 0  # a hole
  valid = ids > 0
  got = MaskSpec(key_valid=jnp.asarray(valid), query_valid=jnp.asarray(valid),
                 causal=causal).to_dense(11, 11)
  want = nn.make_attention_mask(ids > 0, ids > 0)
  if causal:
    want = nn.combine_masks(want, nn.make_causal_mask(ids))
  assert got.dtype == jnp.bool_ and got.shape == (3, 1, 11, 11)
  np.testing.assert_array_equal(got, np.asarray(want).astype(bool))


def test_to_dense_cross_attention_equals_flax():
  """Rectangular: decoder queries [b, n] against encoder keys [b, m]."""
  rng = np.random.default_rng(1)
  q_valid, k_valid = _valid(rng, 3, 7), _valid(rng, 3, 12)
  want = np.asarray(nn.make_attention_mask(q_valid, k_valid)).astype(bool)
  got = MaskSpec(key_valid=jnp.asarray(k_valid), query_valid=jnp.asarray(q_valid)).to_dense(7, 12)
  np.testing.assert_array_equal(got, want)
  # keys only (the encoder-decoder's cached decoding: no query validity)
  got = MaskSpec(key_valid=jnp.asarray(k_valid)).to_dense(7, 12)
  np.testing.assert_array_equal(np.broadcast_to(got, (3, 1, 7, 12)),
                                np.broadcast_to(k_valid[:, None, None, :], (3, 1, 7, 12)))


@pytest.mark.parametrize('q_offset', [0, 4])
def test_to_dense_causal_with_offset_equals_flax_positions(q_offset):
  """Query i at position q_offset + i sees key j <= its position (a cache):
  flax's make_attention_mask over positions with pairwise_fn=greater_equal."""
  n, m = 5, 12
  q_pos = (q_offset + np.arange(n))[None]
  want = nn.make_attention_mask(q_pos, np.arange(m)[None], pairwise_fn=jnp.greater_equal)
  got = MaskSpec(causal=True).to_dense(n, m, q_offset)
  np.testing.assert_array_equal(np.broadcast_to(got, (1, 1, n, m)), np.asarray(want).astype(bool))


@pytest.mark.parametrize('causal,window,window_causal', [
    (False, 3, False), (False, 3, True), (True, 4, False), (True, 2, True), (False, 1, False)])
def test_to_dense_window_and_dense_part_equal_the_rule(causal, window, window_causal):
  rng = np.random.default_rng(2)
  n, m, q_offset = 6, 11, 3
  k_valid, q_valid = _valid(rng, 2, m), _valid(rng, 2, n)
  dense = rng.random((2, 1, n, m)) < 0.8
  spec = MaskSpec(key_valid=jnp.asarray(k_valid), query_valid=jnp.asarray(q_valid),
                  dense=jnp.asarray(dense), causal=causal, window=window,
                  window_causal=window_causal)
  want = (_numpy_rule(n, m, q_offset, causal, window, window_causal)[None, None]
          & k_valid[:, None, None, :] & q_valid[:, None, :, None] & dense)
  np.testing.assert_array_equal(spec.to_dense(n, m, q_offset), want)


def test_to_dense_of_nothing_is_none_and_as_dense_passes_arrays_through():
  assert MaskSpec().to_dense(3, 4) is None
  assert as_dense(None, 2, 1, 3, 4) is None
  arr = jnp.ones((1, 1, 3, 4), bool)
  assert as_dense(arr, 2, 1, 3, 4) is arr
  np.testing.assert_array_equal(as_dense(MaskSpec(causal=True), 2, 1, 3, 4),
                                np.tril(np.ones((3, 4), bool))[None, None])


# ---- block, and the block ranges: random configurations -------------------------

def _random_spec(rng, b, n_pad, m_pad):
  """A MaskSpec with a random choice of parts; arrays sized to the padded
  lengths (the kernel pads them before asking for blocks)."""
  causal = bool(rng.integers(2))
  window = None if rng.random() < 0.3 else int(rng.integers(1, 9))
  window_causal = bool(rng.integers(2))
  kw = dict(causal=causal, window=window, window_causal=window_causal)
  if rng.random() < 0.7:
    kw['key_valid'] = jnp.asarray(_valid(rng, b, m_pad))
  if rng.random() < 0.5:
    kw['query_valid'] = jnp.asarray(_valid(rng, b, n_pad))
  if rng.random() < 0.4:  # any of the broadcastable shapes MultiHeadAttention may pass
    shape = [(b, 1, n_pad, m_pad), (1, 1, n_pad, m_pad), (b, 1, 1, m_pad), (1, 1, n_pad, 1),
             (n_pad, m_pad)][rng.integers(5)]
    kw['dense'] = jnp.asarray(rng.random(shape) < 0.8)
  return MaskSpec(**kw)


def _configs(seed, count):
  rng = np.random.default_rng(seed)
  for _ in range(count):
    bq, bk = int(rng.integers(1, 7)), int(rng.integers(1, 7))
    nq, nk = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    q_offset = int(rng.choice([0, 0, rng.integers(1, 12)]))
    yield rng, bq, bk, nq, nk, q_offset


def test_block_equals_the_slice_of_to_dense():
  for rng, bq, bk, nq, nk, q_offset in _configs(3, 16):
    b = 2
    spec = _random_spec(rng, b, nq * bq, nk * bk)

    @jax.jit  # one compilation per configuration, not one per op
    def full_and_blocks(spec):
      return spec.to_dense(nq * bq, nk * bk, q_offset), [
          [spec.block(qb * bq, kb * bk, bq, bk, q_offset) for kb in range(nk)]
          for qb in range(nq)]

    full, blocks = full_and_blocks(spec)
    for qb in range(nq):
      for kb in range(nk):
        got = blocks[qb][kb]
        if full is None:
          assert got is None
          continue
        want = np.broadcast_to(full, (b, 1, nq * bq, nk * bk))[
            :, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
        assert got.ndim == 4 and got.shape[1] == 1
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want,
                                      err_msg=f'{spec} block ({qb}, {kb}) of {bq}x{bk}, '
                                              f'q_offset={q_offset}')


def test_block_with_traced_starts_and_offset_equals_the_slice():
  rng = np.random.default_rng(4)
  bq, bk, nq, nk = 3, 4, 4, 3
  spec = MaskSpec(key_valid=jnp.asarray(_valid(rng, 2, nk * bk)),
                  query_valid=jnp.asarray(_valid(rng, 2, nq * bq)),
                  dense=jnp.asarray(rng.random((2, 1, nq * bq, nk * bk)) < 0.8),
                  causal=True, window=5)
  block = jax.jit(lambda qs, ks, off: spec.block(qs, ks, bq, bk, off))
  for qb, kb, off in [(0, 0, 0), (1, 2, 3), (3, 0, 7), (2, 2, 1)]:
    want = np.asarray(spec.to_dense(nq * bq, nk * bk, off))[:, :, qb * bq:(qb + 1) * bq,
                                                            kb * bk:(kb + 1) * bk]
    np.testing.assert_array_equal(block(qb * bq, kb * bk, off), want)


def _structural_blocks(spec, bq, bk, nq, nk, q_offset):
  """bool [nq, nk]: whether block (qb, kb) holds a pair that the causal and
  window parts allow (padded rows and columns included: the kernel's ranges
  are asked for the padded blocks)."""
  rule = _numpy_rule(nq * bq, nk * bk, q_offset, spec.causal, spec.window, spec.window_causal)
  return rule.reshape(nq, bq, nk, bk).any(axis=(1, 3))


def test_block_ranges_hold_exactly_the_blocks_with_a_visible_pair():
  """Never skip a block with a visible pair (the output would be wrong); never
  run one without (the skipping kernels/blockwise.py promises). The structural parts
  only: padding decides nothing about which blocks run."""
  checked = 0
  for rng, bq, bk, nq, nk, q_offset in _configs(5, 200):
    spec = _random_spec(rng, 1, nq * bq, nk * bk)
    visible = _structural_blocks(spec, bq, bk, nq, nk, q_offset)
    for qb in range(nq):
      q_first = q_offset + qb * bq
      lo, hi = (int(x) for x in spec.key_block_range(q_first, q_first + bq - 1, bk, nk))
      ran = np.zeros(nk, bool)
      ran[lo:hi] = True
      assert lo >= 0 and (hi <= nk or hi == lo), (spec, bq, bk, nq, nk, q_offset, qb, lo, hi)
      np.testing.assert_array_equal(ran, visible[qb], err_msg=(
          f'key blocks of query block {qb}: {spec}, bq={bq} bk={bk} nq={nq} nk={nk} '
          f'q_offset={q_offset}'))
    for kb in range(nk):
      lo, hi = (int(x) for x in spec.query_block_range(kb * bk, kb * bk + bk - 1, bq, nq,
                                                       q_offset))
      ran = np.zeros(nq, bool)
      ran[lo:hi] = True
      assert lo >= 0 and (hi <= nq or hi == lo), (spec, bq, bk, nq, nk, q_offset, kb, lo, hi)
      np.testing.assert_array_equal(ran, visible[:, kb], err_msg=(
          f'query blocks of key block {kb}: {spec}, bq={bq} bk={bk} nq={nq} nk={nk} '
          f'q_offset={q_offset}'))
    checked += visible.size
  assert checked > 1000


@pytest.mark.parametrize('causal,window,window_causal', [
    (True, None, False), (False, 5, False), (False, 3, True), (True, 6, False)])
def test_block_ranges_with_a_traced_offset_equal_the_int(causal, window, window_causal):
  """Decoding with a cache passes q_offset traced."""
  spec = MaskSpec(causal=causal, window=window, window_causal=window_causal)
  bq, bk, nq, nk = 2, 3, 4, 5

  def ranges(off):
    keys = [spec.key_block_range(off + qb * bq, off + qb * bq + bq - 1, bk, nk)
            for qb in range(nq)]
    queries = [spec.query_block_range(kb * bk, kb * bk + bk - 1, bq, nq, off)
               for kb in range(nk)]
    return jnp.asarray(keys), jnp.asarray(queries)

  traced = jax.jit(ranges)
  for off in (0, 1, 4, 9, 20):
    want_keys, want_queries = ranges(off)
    got_keys, got_queries = traced(off)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_queries, want_queries)


# ---- may_hide_rows --------------------------------------------------------------

@pytest.mark.parametrize('causal,window,window_causal', [
    (False, None, False), (True, None, False), (False, 3, False), (False, 3, True),
    (True, 2, True)])
@pytest.mark.parametrize('n,m,q_offset', [(6, 6, 0), (4, 9, 5), (5, 9, 3), (7, 3, 0), (1, 8, 7)])
def test_may_hide_rows_is_false_only_where_every_row_sees_a_key(causal, window, window_causal,
                                                              n, m, q_offset):
  """A False answer lets the chunked kernel skip the empty-row fallback, so
  it must never be wrong: checked against the numpy rule, every row."""
  spec = MaskSpec(causal=causal, window=window, window_causal=window_causal)
  empty_rows = not _numpy_rule(n, m, q_offset, causal, window, window_causal).any(1).all()
  if not spec.may_hide_rows(n, m, q_offset):
    assert not empty_rows
  if window is not None and q_offset + n > m:
    assert spec.may_hide_rows(n, m, q_offset)
  # padding, an explicit mask or a traced offset with a window: always maybe
  ones = jnp.ones((1, m), bool)
  assert spec.replace(key_valid=ones).may_hide_rows(n, m, q_offset)
  assert spec.replace(dense=jnp.ones((n, m), bool)).may_hide_rows(n, m, q_offset)
  assert spec.replace(query_valid=jnp.ones((1, n), bool)).may_hide_rows(n, m, q_offset)
  if window is not None:
    assert spec.may_hide_rows(n, m, jnp.int32(q_offset))
