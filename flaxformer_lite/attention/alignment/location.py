"""Location-sensitive attention (Chorowski et al. 2015, eq. 8-9; Tacotron 2).

  e_ij = v_h . tanh(q_i + k_j + U_h f_ij + b_h),   f_i = F * alpha_i
where alpha_i [m] is `prev_alignment`: the sum of the weights of all earlier
decoder steps (Tacotron 2's cumulative weights; Chorowski convolves the
previous step's weights only). F is a bank of `location_channels` 1-D filters
of width `location_kernel` slid over the key axis, shared by the heads; U_h
maps the channels to the head's d features.

location_mode: 'hybrid' (the formula), 'location_only' (drops k_j: where to
look depends on the query and past alignment only), 'content_only' (drops
U f: Bahdanau's additive attention plus b).

Only a step-by-step decoder knows the earlier steps' weights, so the variant
lists rnn_seq2seq only. Memory: the tanh acts on a [b, h, n, m, d] tensor,
as additive.py's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.attention.alignment.luong import attend, per_head_matrix

MODES = ('hybrid', 'location_only', 'content_only')


def location_features(alignment, filters):
  """f = F * alignment along the key axis, zero-padded to keep the length ('same').

  f[..., j, c] = sum_t filters[t, c] * alignment[..., j + t - (K - 1) / 2], with
  alignment 0 outside 0..m-1: a cross-correlation, as convolution layers
  compute (the filter is not flipped).

  Args:
    alignment: [b, h, n, m].
    filters: [K, C], K odd.
  Returns:
    [b, h, n, m, C] float32.
  """
  b, h, n, m = alignment.shape
  kernel, channels = filters.shape
  half = (kernel - 1) // 2
  x = alignment.astype(jnp.float32).reshape(b * h * n, m, 1)  # [batch, width, 1 channel]
  f = jax.lax.conv_general_dilated(
      x, filters.astype(jnp.float32)[:, None, :], window_strides=(1,),
      padding=[(half, half)], dimension_numbers=('NWC', 'WIO', 'NWC'))  # [bhn, m, C]
  return f.reshape(b, h, n, m, channels)


def location_sensitive_attention(query, key, value, location_v, location_b,
                                 location_filters=None, location_u=None, *,
                                 prev_alignment, location_mode='hybrid',
                                 location_kernel=31, location_channels=32,
                                 dtype=None, **common):
  """Location-sensitive attention (module docstring).

  Args:
    query: [b, n, h, d]; key, value: [b, m, h, d].
    location_v, location_b: [h, d].
    location_filters: [K, C]; location_u: [h, C, d]; None for content_only.
    prev_alignment: [b, h, n, m], summed weights of the earlier decoder steps.
    location_mode: one of MODES.
    common: mask, bias, dropout, return_weights, as `luong.attend`.
  Returns:
    [b, n, h, d] in `dtype` (default: query's); with return_weights,
    (that, weights [b, h, n, m]).
  """
  del location_kernel, location_channels  # carried by the filters' shape
  f32 = jnp.float32
  hidden = (jnp.transpose(query.astype(f32), (0, 2, 1, 3))[:, :, :, None]
            + location_b.astype(f32)[None, :, None, None])  # [b, h, n, 1, d]
  if location_mode != 'location_only':
    hidden = hidden + jnp.transpose(key.astype(f32), (0, 2, 1, 3))[:, :, None]
  if location_mode != 'content_only':
    features = location_features(prev_alignment, location_filters)  # [b, h, n, m, C]
    hidden = hidden + jnp.einsum('bhnmc,hcd->bhnmd', features, location_u.astype(f32))
  logits = jnp.einsum('bhnmd,hd->bhnm', jnp.tanh(hidden), location_v.astype(f32))
  return attend(logits, value, dtype=dtype or query.dtype, **common)


def _params(num_heads, head_dim, kwargs):
  params = {'location_v': ((num_heads, head_dim), jax.nn.initializers.normal(head_dim ** -0.5),
                           ('heads', 'kv')),
            'location_b': ((num_heads, head_dim), jax.nn.initializers.zeros, ('heads', 'kv'))}
  if kwargs['location_mode'] != 'content_only':
    kernel, channels = kwargs['location_kernel'], kwargs['location_channels']
    params['location_filters'] = (
        (kernel, channels), jax.nn.initializers.lecun_normal(in_axis=0, out_axis=1),
        (None, None))
    params['location_u'] = ((num_heads, channels, head_dim), per_head_matrix,
                            ('heads', None, 'kv'))
  return params


@dataclasses.dataclass(frozen=True)
class LocationOptions:
  """Location-sensitive attention's options (module docstring).

  location_channels: the filters of the bank F; >= 1.
  location_kernel: each filter's width over the key axis, odd (a 'same'
    convolution centred on each key); >= 1.
  location_mode: the terms of the score (MODES): 'hybrid', 'location_only'
    or 'content_only'.
  """
  location_channels: int = 32
  location_kernel: int = 31
  location_mode: str = 'hybrid'

  def __post_init__(self):
    registry.check_int(self, 'location_channels', 1)
    registry.check_int(self, 'location_kernel', 1)
    if self.location_kernel % 2 == 0:
      raise ValueError(f'attention_kwargs.location_kernel={self.location_kernel}; must be '
                       "odd (a 'same' convolution centred on each key)")
    registry.check_choice(self, 'location_mode', MODES)


registry.register(registry.AttentionVariant(
    name='location_sensitive',
    models=('rnn_seq2seq',),
    fn=location_sensitive_attention,
    options=LocationOptions,
    params=_params,
    doc='v_h . tanh(q + k + U_h (F * cumulative weights) + b_h) (Chorowski et al. '
        "2015, Tacotron 2); location_mode: hybrid | location_only | content_only"))
