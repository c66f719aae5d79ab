"""Masked-LM inputs (BERT, Devlin et al. 2019, section 3.1 and appendix A.1).

Ids: 0 = PAD, 1 = BOS, 2 = EOS, real tokens from 3 (data/synthetic.py). The
mask token needs an id of its own that no dataset token uses: we append it
after the dataset's vocabulary, so mask_id = dataset vocab_size and the model
has one more row (`mlm_vocab_size`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.tokens import PAD_ID

FIRST_TOKEN_ID = 3  # after PAD, BOS, EOS
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # the rest of the selected is kept


def mlm_vocab_size(dataset_vocab_size: int) -> tuple[int, int]:
  """dataset_vocab_size -> (model_vocab_size, mask_id).

  The mask token takes the first unused id, dataset_vocab_size; the model's
  embedding and softmax then need dataset_vocab_size + 1 rows. Pass
  `vocab_size=dataset_vocab_size` to `mask_tokens`, so that random
  replacements are dataset tokens, never the mask.
  """
  return dataset_vocab_size + 1, dataset_vocab_size


def mask_tokens(rng, ids, *, vocab_size: int, mask_id: int, rate: float = 0.15,
                first_token_id: int = FIRST_TOKEN_ID):
  """BERT's corruption of a batch for the masked-LM loss.

  Each non-PAD position (ids != 0; BOS and EOS included) is selected
  independently with probability `rate` (BERT picks exactly round(rate * len)
  per sequence; independent draws keep this one elementwise op). A selected
  position becomes `mask_id` with probability 0.8, a token drawn uniformly
  from [first_token_id, vocab_size) minus `mask_id` with probability 0.1 (it
  may equal the original token, as in BERT; never PAD, BOS, EOS or the mask),
  and keeps its token with probability 0.1. The loss is taken at every
  selected position, whichever of the three it got.

  Args:
    rng: PRNG key.
    ids: [b, n] int token ids, PAD_ID = 0 for padding.
    vocab_size: random replacements are < vocab_size (the dataset's
      vocabulary; see `mlm_vocab_size`).
    mask_id: the mask token's id.
    rate: probability that a non-PAD position is selected.
    first_token_id: the smallest id a random replacement can take.
  Returns:
    inputs: [b, n] ids.dtype, the corrupted ids (PAD where ids is PAD).
    targets: [b, n] ids.dtype, the original id at selected positions, else 0.
    weights: [b, n] float32, 1.0 at selected positions, else 0.0.
  """
  mask_in_range = first_token_id <= mask_id < vocab_size
  num_random = vocab_size - first_token_id - int(mask_in_range)
  if num_random < 1:
    raise ValueError(f'mask_tokens: no token ids to draw random replacements from: '
                     f'[first_token_id={first_token_id}, vocab_size={vocab_size}) '
                     f'without mask_id={mask_id}')
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f'mask_tokens: rate={rate!r} must be in [0, 1]')
  select_rng, action_rng, token_rng = jax.random.split(rng, 3)
  selected = (jax.random.uniform(select_rng, ids.shape) < rate) & (ids != PAD_ID)  # [b, n]
  action = jax.random.uniform(action_rng, ids.shape)  # [b, n]
  to_mask = selected & (action < MASK_FRACTION)
  to_random = selected & (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)
  random_ids = jax.random.randint(token_rng, ids.shape, first_token_id,
                                  first_token_id + num_random)  # [b, n]
  if mask_in_range:  # skip over mask_id
    random_ids = random_ids + (random_ids >= mask_id)
  inputs = jnp.where(to_mask, mask_id, jnp.where(to_random, random_ids, ids)).astype(ids.dtype)
  targets = jnp.where(selected, ids, 0).astype(ids.dtype)
  return inputs, targets, selected.astype(jnp.float32)
