"""Attention bottlenecks (Nagrani et al. 2021, "Attention Bottlenecks for
Multimodal Fusion", section 3.2, eq. 8-9).

Streams (modalities) never attend to each other. Each stream i attends over
its own tokens and B shared bottleneck tokens z:
  [x_i^{l+1}; z_i^{l+1}] = Transformer_i([x_i^l; z^l])     (eq. 8)
  z^{l+1} = mean_i z_i^{l+1}                               (eq. 9)
so everything stream a learns about stream b passes through the B tokens of z.
The layers are arguments: this file holds the wiring, layers/bottleneck.py
the parameters.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def fusion_step(layers: Sequence[Callable[[jax.Array], jax.Array]],
                streams: Sequence[jax.Array], bottleneck: jax.Array):
  """One bottleneck-fusion layer over any number of streams.

  Args:
    layers: one function per stream, [b, n_i + B, d] -> [b, n_i + B, d]
      (that stream's Transformer layer, its padding mask bound in).
    streams: x_i [b, n_i, d].
    bottleneck: z [b, B, d], shared by all streams.
  Returns:
    (new streams [b, n_i, d] each, new bottleneck [b, B, d]): eq. 8, then the
    mean over streams of their updated bottleneck tokens (eq. 9).
  """
  if len(layers) != len(streams):
    raise ValueError(f'{len(layers)} layers for {len(streams)} streams')
  new_streams, new_bottlenecks = [], []
  for layer, x in zip(layers, streams):
    n = x.shape[1]
    y = layer(jnp.concatenate([x, bottleneck.astype(x.dtype)], axis=1))  # [b, n + B, d]
    new_streams.append(y[:, :n])
    new_bottlenecks.append(y[:, n:])
  return new_streams, jnp.mean(jnp.stack(new_bottlenecks), axis=0)
