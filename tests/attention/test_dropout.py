"""Attention dropout's keep mask (attention/dropout.py): the documented hash,
computed one weight at a time in python integers, and its statistics.

That the chunked kernel draws the same mask as the dense path, forward and
backward, is checked through whole models (tests/test_chunked_models.py: the
loss curves and parameters of training with attention dropout agree)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import dropout


def test_keep_is_the_documented_hash(loop_keep):
  seed = 0xDEADBEEF
  got = dropout.keep(jnp.uint32(seed), 0.3, (2, 3), jnp.arange(5)[:, None], jnp.arange(7)[None])
  np.testing.assert_array_equal(np.asarray(got), loop_keep(seed, 0.3, 2, 3, 5, 7))


def test_a_block_draws_the_bits_of_its_indices():
  """Any block, at any offset, reads the same bits as the whole array there
  (what lets the chunked kernel draw per block, and in the backward again)."""
  seed = jnp.uint32(12345)
  whole = dropout.keep(seed, 0.5, (2, 2), jnp.arange(40)[:, None], jnp.arange(50)[None])
  block = dropout.keep(seed, 0.5, (2, 2), (13 + jnp.arange(8))[:, None],
                       (29 + jnp.arange(16))[None])
  np.testing.assert_array_equal(np.asarray(block), np.asarray(whole)[:, :, 13:21, 29:45])


@pytest.mark.parametrize('rate', [0.1, 0.5])
def test_keep_rate_and_neighbours_within_binomial_bounds(rate):
  """Over 2**21 weights the kept fraction is 1 - rate within 5 standard
  deviations, and two neighbouring keys (or queries) agree as often as two
  independent draws would: (1 - rate)**2 + rate**2."""
  keep = np.asarray(dropout.keep(dropout.seed(jax.random.key(0)), rate, (4, 8),
                                 jnp.arange(256)[:, None], jnp.arange(256)[None]))
  n = keep.size
  sd = np.sqrt(rate * (1 - rate) / n)
  assert abs(keep.mean() - (1 - rate)) < 5 * sd, keep.mean()
  agree = (1 - rate) ** 2 + rate ** 2
  for a, b in ((keep[..., 1:], keep[..., :-1]), (keep[..., 1:, :], keep[..., :-1, :])):
    same = np.mean(a == b)
    assert abs(same - agree) < 5 * np.sqrt(agree * (1 - agree) / a.size), same


def test_masks_differ_across_rows_heads_blocks_and_steps():
  shape = ((2, 2), jnp.arange(64)[:, None], jnp.arange(64)[None])
  first = np.asarray(dropout.keep(dropout.seed(jax.random.key(0)), 0.5, *shape))
  step = np.asarray(dropout.keep(dropout.seed(jax.random.fold_in(jax.random.key(0), 1)), 0.5,
                                 *shape))
  pairs = {'batch rows': (first[0], first[1]), 'heads': (first[:, 0], first[:, 1]),
           'query blocks': (first[..., :32, :], first[..., 32:, :]),
           'key blocks': (first[..., :32], first[..., 32:]), 'steps': (first, step)}
  for what, (a, b) in pairs.items():
    assert 0.4 < np.mean(a == b) < 0.6, what  # independent halves agree half the time


def test_apply_scales_kept_weights_and_is_the_identity_when_deterministic():
  w = jnp.full((1, 2, 8, 8), 0.125)
  rng = jax.random.key(3)
  np.testing.assert_array_equal(np.asarray(dropout.apply(w, 0.25, rng, True)), np.asarray(w))
  got = np.asarray(dropout.apply(w, 0.25, rng, False))
  kept = np.asarray(dropout.keep(dropout.seed(rng), 0.25, (1, 2), jnp.arange(8)[:, None],
                                 jnp.arange(8)[None]))
  np.testing.assert_allclose(got, np.where(kept, 0.125 / 0.75, 0.0))
  with pytest.raises(ValueError, match='dropout_rng'):
    dropout.apply(w, 0.25, None, False)
