"""mask_tokens: BERT's 15% selection and 80/10/10 split, checked statistically.

Every bound is 5 binomial standard deviations: a correct implementation fails
one with probability < 1e-6, and the fixed keys make the test deterministic.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.data import masking
from flaxformer_lite.models import PAD_ID

DATASET_VOCAB = 20  # PAD, BOS, EOS and 17 tokens
VOCAB, MASK_ID = masking.mlm_vocab_size(DATASET_VOCAB)
FIRST = masking.FIRST_TOKEN_ID
NUM_RANDOM = DATASET_VOCAB - FIRST  # ids a random replacement can take


def _ids(batch=64, length=512, seed=0):
  """[batch, length]: BOS, tokens, EOS, then PAD; real lengths vary per row."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(FIRST, DATASET_VOCAB, size=(batch, length))
  ids[:, 0] = 1
  lengths = rng.integers(length // 4, length, size=batch)
  for row, n in enumerate(lengths):
    ids[row, n - 1] = 2
    ids[row, n:] = PAD_ID
  return jnp.asarray(ids, jnp.int32)


IDS = _ids()


def _mask(rate, seed=0, ids=IDS, **kwargs):
  kwargs = {'vocab_size': DATASET_VOCAB, 'mask_id': MASK_ID, **kwargs}
  out = masking.mask_tokens(jax.random.PRNGKey(seed), ids, rate=rate, **kwargs)
  return tuple(np.asarray(x) for x in out)


def _assert_binomial(count, trials, p):
  sigma = np.sqrt(trials * p * (1 - p))
  assert abs(count - trials * p) <= 5 * sigma, (count, trials, p, sigma)


def test_mlm_vocab_size_appends_the_mask_token():
  assert masking.mlm_vocab_size(20) == (21, 20)


@pytest.mark.parametrize('rate', [0.15, 0.5])
def test_selection_rate_and_split(rate):
  inputs, targets, weights = _mask(rate)
  ids = np.asarray(IDS)
  real = ids != PAD_ID
  selected = weights == 1.0
  assert inputs.shape == targets.shape == weights.shape == ids.shape
  assert inputs.dtype == targets.dtype == ids.dtype and weights.dtype == np.float32
  assert set(np.unique(weights)) <= {0.0, 1.0}
  _assert_binomial(selected.sum(), real.sum(), rate)

  # Of the selected: 80% mask; 10% random, which changes the token unless it
  # draws the original (1 in NUM_RANDOM for BOS.. tokens in range, never for
  # BOS/EOS); 10% kept.
  num_selected = selected.sum()
  masked = selected & (inputs == MASK_ID)
  changed = selected & (inputs != MASK_ID) & (inputs != ids)
  in_range = selected & (ids >= FIRST)
  _assert_binomial(masked.sum(), num_selected, 0.8)
  p_changed = 0.1 * (1 - in_range.sum() / num_selected / NUM_RANDOM)
  _assert_binomial(changed.sum(), num_selected, p_changed)
  _assert_binomial((selected & (inputs == ids)).sum(), num_selected, 1 - 0.8 - p_changed)


def test_pad_never_selected_and_unselected_inputs_unchanged():
  inputs, targets, weights = _mask(0.5)
  ids = np.asarray(IDS)
  assert not weights[ids == PAD_ID].any()
  unselected = weights == 0.0
  np.testing.assert_array_equal(inputs[unselected], ids[unselected])
  assert (inputs[ids == PAD_ID] == PAD_ID).all()


def test_targets_are_the_original_ids_at_selected_positions():
  _, targets, weights = _mask(0.15)
  ids = np.asarray(IDS)
  np.testing.assert_array_equal(targets, np.where(weights == 1.0, ids, 0))
  assert (targets[weights == 1.0] != PAD_ID).all()


def test_random_replacements_are_uniform_over_the_valid_range():
  inputs, _, weights = _mask(1.0)
  ids = np.asarray(IDS)
  real = ids != PAD_ID
  assert (weights[real] == 1.0).all()
  replaced = real & (inputs != MASK_ID) & (inputs != ids)
  values = inputs[replaced]
  assert values.min() >= FIRST and values.max() < DATASET_VOCAB
  # Token v is visible as a replacement at positions whose original is not v,
  # each with probability 0.1 (random branch) / NUM_RANDOM (drew v).
  for v in range(FIRST, DATASET_VOCAB):
    _assert_binomial((values == v).sum(), (real & (ids != v)).sum(), 0.1 / NUM_RANDOM)


def test_mask_id_inside_the_range_is_never_a_random_replacement():
  """If the caller gives a vocab_size that includes the mask id, the random
  draw skips it: the mask id then appears at 80% of the selected positions,
  not 80% + 10%/3."""
  small = jnp.where(IDS % 2 == 0, 3, 5)  # tokens 3 and 5 (not the mask id), no PAD
  inputs, _, weights = _mask(1.0, ids=small, vocab_size=6, mask_id=4)
  assert (weights == 1.0).all()
  _assert_binomial((inputs == 4).sum(), small.size, 0.8)
  assert set(np.unique(inputs[inputs != 4])) <= {3, 5}


def test_deterministic_for_a_fixed_key_and_jittable():
  a = _mask(0.15, seed=3)
  b = _mask(0.15, seed=3)
  c = _mask(0.15, seed=4)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a[2], c[2])
  fn = jax.jit(functools.partial(masking.mask_tokens, vocab_size=DATASET_VOCAB,
                                 mask_id=MASK_ID))
  for x, y in zip(fn(jax.random.PRNGKey(3), IDS), a):
    np.testing.assert_array_equal(np.asarray(x), y)


def test_no_tokens_to_draw_from_raises():
  with pytest.raises(ValueError, match='vocab_size=4'):
    masking.mask_tokens(jax.random.PRNGKey(0), IDS, vocab_size=4, mask_id=3)
  with pytest.raises(ValueError, match='rate=1.5'):
    masking.mask_tokens(jax.random.PRNGKey(0), IDS, vocab_size=20, mask_id=20, rate=1.5)
