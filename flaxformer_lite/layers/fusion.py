"""Two streams of tokens (modalities), each with its own Transformer layers,
fused from layer `fusion_layer` on (Nagrani et al. 2021, "Attention
Bottlenecks for Multimodal Fusion", section 3.2):
  early, late  one joint sequence [x_a; x_b] through shared layers, full
               attention across the streams (eq. 5); early from layer 0,
               late from fusion_layer;
  bottleneck   the streams never attend to each other. Each stream i
               attends over its own tokens and B shared bottleneck tokens z:
                 [x_i^{l+1}; z_i^{l+1}] = Transformer_i([x_i^l; z^l])   (eq. 8)
                 z^{l+1} = mean_i z_i^{l+1}                             (eq. 9)
               so everything stream a learns about stream b passes through
               the B tokens of z.
`fusion_step` is eq. 8-9 as a function of any layers; `TwoStreamEncoder`
holds the parameters: one EncoderLayer per stream per unfused or bottleneck
layer (streams share no weights, as in the paper), one per joint layer, and
the learned initial bottleneck tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks
from flaxformer_lite.layers.transformer import EncoderLayer, TransformerConfig, norm

FUSIONS = ('early', 'late', 'bottleneck')


def fusion_step(layers: Sequence[Callable[[jax.Array], jax.Array]],
                streams: Sequence[jax.Array], bottleneck: jax.Array):
  """One bottleneck-fusion layer over any number of streams.

  Args:
    layers: one function per stream, [b, B + n_i, d] -> [b, B + n_i, d]
      (that stream's Transformer layer, its padding mask bound in).
    streams: x_i [b, n_i, d].
    bottleneck: z [b, B, d], shared by all streams.
  Returns:
    (new streams [b, n_i, d] each, new bottleneck [b, B, d]): eq. 8, then the
    mean over streams of their updated bottleneck tokens (eq. 9).
  The bottleneck tokens go first, [z; x_i]: a relative position scheme then
  sees them at the same distances from a stream's tokens however much
  padding ends the stream.
  """
  if len(layers) != len(streams):
    raise ValueError(f'{len(layers)} layers for {len(streams)} streams')
  new_streams, new_bottlenecks = [], []
  num = bottleneck.shape[1]
  for layer, x in zip(layers, streams):
    y = layer(jnp.concatenate([bottleneck.astype(x.dtype), x], axis=1))  # [b, B + n, d]
    new_streams.append(y[:, num:])
    new_bottlenecks.append(y[:, :num])
  return new_streams, jnp.mean(jnp.stack(new_bottlenecks), axis=0)



def _self_mask(valid) -> masks.Mask:
  """valid [b, n] bool: padding neither attends nor is attended."""
  return masks.padding(valid)


class TwoStreamEncoder(nn.Module):
  """Streams a and b, each its own Transformer layers until `fusion_layer`,
  then fused as `fusion` says (module docstring).

  `__call__(x_a [b, n_a, d], x_b [b, n_b, d], *, valid_a [b, n_a] | None,
  valid_b [b, n_b] | None, deterministic)` -> (y_a [b, n_a, d],
  y_b [b, n_b, d], z [b, B, d] or None). Inputs are embedded tokens
  (positions added by the caller); `valid_*` are True at real tokens (None:
  all real).

  Layers 0 .. fusion_layer-1 run each stream alone (the paper's L_f).
  bottleneck: from fusion_layer on stream i's layer runs over [z; x_i] and
  z becomes the mean of the streams' updated z (eq. 8-9); z starts as a
  learned [B, d] table shared by all examples and is returned as the last
  layer left it. A stream reads the other's contribution one layer after z
  took it in: bottleneck fusion in the last layer alone carries nothing from
  one stream's outputs to the other's. early / late: from fusion_layer on one layer runs over
  [x_a; x_b], z is None; a relative variant sees its positions 0..n_a+n_b-1,
  stream b's after stream a's padded width (fixed for a task's streams).
  y_a, y_b get a final norm per stream under pre-LN.

  Attributes:
    cfg: d_model, heads, mlp, dropout, attention variant; the number of
      layers is cfg.num_encoder_layers.
    fusion: early | late | bottleneck.
    num_bottleneck: B (bottleneck); 0 cuts every path between the streams.
    fusion_layer: the first fused layer, in [0, cfg.num_encoder_layers]
      (= num_encoder_layers: the streams never meet here).
  """
  cfg: TransformerConfig
  fusion: str = 'bottleneck'
  num_bottleneck: int = 4
  fusion_layer: int = 0

  @nn.compact
  def __call__(self, x_a, x_b, *, valid_a=None, valid_b=None, deterministic=True):
    cfg = self.cfg
    num_layers = cfg.num_encoder_layers
    if self.fusion not in FUSIONS:
      raise ValueError(f'fusion={self.fusion!r}; valid: {", ".join(FUSIONS)}')
    if not 0 <= self.fusion_layer <= num_layers:
      raise ValueError(f'fusion_layer={self.fusion_layer} must be in [0, {num_layers}] '
                       f'(cfg.num_encoder_layers={num_layers}; {num_layers} = no fusion)')
    if self.num_bottleneck < 0:
      raise ValueError(f'num_bottleneck={self.num_bottleneck} must be >= 0')
    b, d = x_a.shape[0], x_a.shape[-1]
    streams = [x_a, x_b]
    valid = [jnp.ones(x.shape[:2], bool) if v is None else v.astype(bool)
             for x, v in zip(streams, (valid_a, valid_b))]
    bottleneck = self.fusion == 'bottleneck'
    z = None
    if bottleneck:
      z = self.param('bottleneck', nn.initializers.normal(stddev=0.02),
                     (self.num_bottleneck, d))
      z = jnp.broadcast_to(z.astype(cfg.dtype), (b, self.num_bottleneck, d))
    joint_mask = _self_mask(jnp.concatenate(valid, axis=1))
    with_z = [_self_mask(jnp.concatenate([jnp.ones((b, self.num_bottleneck), bool), v], 1))
              for v in valid]
    n_a = x_a.shape[1]
    for i in range(num_layers):
      if i < self.fusion_layer:
        streams = [EncoderLayer(cfg, name=f'{s}_layer_{i}')(x, mask=_self_mask(v),
                                                             deterministic=deterministic)
                   for s, x, v in zip('ab', streams, valid)]
      elif bottleneck:
        fns = [lambda t, layer=EncoderLayer(cfg, name=f'{s}_layer_{i}'), mask=mask:
               layer(t, mask=mask, deterministic=deterministic)
               for s, mask in zip('ab', with_z)]
        streams, z = fusion_step(fns, streams, z)
      else:
        joint = EncoderLayer(cfg, name=f'joint_layer_{i}')(
            jnp.concatenate(streams, axis=1), mask=joint_mask, deterministic=deterministic)
        streams = [joint[:, :n_a], joint[:, n_a:]]
    if cfg.pre_ln:
      streams = [norm(cfg, f'{s}_final_norm')(x) for s, x in zip('ab', streams)]
    return streams[0], streams[1], z
