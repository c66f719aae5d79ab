"""Token ids every module agrees on, and teacher forcing's shift.

PAD_ID=0 (masked everywhere, weighs nothing), BOS_ID=1 (the first decoder
input), EOS_ID=2 (ends every target). The ground floor: tokenizers, batching,
models, decoding and training read these without importing one another.
"""
from __future__ import annotations

import jax.numpy as jnp

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def shift_right(targets, bos_id: int = BOS_ID, segmentation=None):
  """Decoder inputs for teacher forcing: [t0, t1, ...] -> [bos, t0, ...].

  targets [b, n] int -> [b, n]. With `segmentation` [b, n] (packed rows), each
  segment starts with bos, not the previous segment's last token.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
  if segmentation is None:
    return shifted
  starts = segmentation != jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(starts, bos_id, shifted)
