"""Two-stream encoder fused through attention bottlenecks (Nagrani et al. 2021,
"Attention Bottlenecks for Multimodal Fusion", section 3.2, eq. 8-9).

Streams (modalities) never attend to each other. Each stream i attends over
its own tokens and B shared bottleneck tokens z:
  [x_i^{l+1}; z_i^{l+1}] = Transformer_i([x_i^l; z^l])     (eq. 8)
  z^{l+1} = mean_i z_i^{l+1}                               (eq. 9)
so everything stream a learns about stream b passes through the B tokens of z.
`fusion_step` is that wiring as a function of any layers; `BottleneckFusion`
holds the parameters: one EncoderLayer per stream per layer (streams share no
weights, as in the paper) and the learned initial bottleneck tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.layers.transformer import EncoderLayer, TransformerConfig, norm


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



def _self_mask(valid):
  """valid [b, n] bool -> [b, 1, n, n]: padding neither attends nor is attended."""
  return nn.make_attention_mask(valid, valid, dtype=bool)


class BottleneckFusion(nn.Module):
  """Streams a and b, each its own Transformer encoder, exchanging information
  only through `num_bottleneck` shared tokens.

  `__call__(x_a [b, n_a, d], x_b [b, n_b, d], *, valid_a [b, n_a] | None,
  valid_b [b, n_b] | None, deterministic)` -> (y_a [b, n_a, d],
  y_b [b, n_b, d], z [b, B, d]). Inputs are embedded tokens (positions added
  by the caller); `valid_*` are True at real tokens (None: all real).

  Layers 0 .. fusion_layer-1 run each stream alone (the paper's L_f: fusion
  starts mid-network). From layer fusion_layer on, stream i's layer runs over
  [x_i; z] and z becomes the mean of the streams' updated z (eq. 8-9). The
  bottleneck starts as a learned [B, d] table shared by all examples. y_a,
  y_b get the final LayerNorm under pre-LN; z is returned as the last layer
  left it (the initial table if no layer fused).

  Attributes:
    cfg: d_model, heads, mlp, dropout, attention variant; the number of
      layers is cfg.num_encoder_layers.
    num_bottleneck: B; 0 cuts every path between the streams.
    fusion_layer: first layer with bottleneck exchange, in
      [0, cfg.num_encoder_layers] (= num_encoder_layers: no fusion).
  """
  cfg: TransformerConfig
  num_bottleneck: int = 4
  fusion_layer: int = 0

  @nn.compact
  def __call__(self, x_a, x_b, *, valid_a=None, valid_b=None, deterministic=True):
    cfg = self.cfg
    num_layers = cfg.num_encoder_layers
    if not 0 <= self.fusion_layer <= num_layers:
      raise ValueError(f'fusion_layer={self.fusion_layer} must be in [0, {num_layers}] '
                       f'(cfg.num_encoder_layers={num_layers}; {num_layers} = no fusion)')
    if self.num_bottleneck < 0:
      raise ValueError(f'num_bottleneck={self.num_bottleneck} must be >= 0')
    b, d = x_a.shape[0], x_a.shape[-1]
    streams = [x_a, x_b]
    valid = [jnp.ones(x.shape[:2], bool) if v is None else v.astype(bool)
             for x, v in zip(streams, (valid_a, valid_b))]
    alone = [_self_mask(v) for v in valid]
    with_z = [_self_mask(jnp.concatenate([v, jnp.ones((b, self.num_bottleneck), bool)], 1))
              for v in valid]

    z = self.param('bottleneck', nn.initializers.normal(stddev=0.02),
                   (self.num_bottleneck, d))
    z = jnp.broadcast_to(z.astype(cfg.dtype), (b, self.num_bottleneck, d))
    for i in range(num_layers):
      layers = [EncoderLayer(cfg, name=f'{s}_layer_{i}') for s in 'ab']
      if i < self.fusion_layer:
        streams = [layer(x, mask=mask, deterministic=deterministic)
                   for layer, x, mask in zip(layers, streams, alone)]
      else:
        fns = [lambda t, layer=layer, mask=mask: layer(t, mask=mask,
                                                       deterministic=deterministic)
               for layer, mask in zip(layers, with_z)]
        streams, z = fusion_step(fns, streams, z)
    if cfg.pre_ln:
      streams = [norm(cfg, f'{s}_final_norm')(x)
                 for s, x in zip('ab', streams)]
    return streams[0], streams[1], z
