"""Hard attention: each query reads exactly one key (straight-through Gumbel-softmax).

Logits are dot_product's, l = q.k / sqrt(d) + bias, masked.
  training (an rng): g = jax.random.gumbel(rng, [b, h, n, m], float32),
    y_soft = softmax((l + g) / temperature), y_hard = one_hot(argmax(l + g)),
    weights = y_hard + (y_soft - stop_gradient(y_soft)).
    Forward: exactly y_hard, a sample from softmax(l) (the Gumbel-max
    trick); backward: the gradient of y_soft (Jang et al. 2017, Maddison et
    al. 2017, straight-through estimator of Bengio et al. 2013).
  eval (rng None): one_hot(argmax(l)), the most likely key.
Masked keys are never chosen. A row whose keys are all masked gets uniform
weights, softmax_weights' rule. Rows of the weights sum to 1; attention
dropout then zeroes whole choices.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dropout, registry
from flaxformer_lite.attention.softmax import masked_logits


def hard_attention(query, key, value, *, rng=None, temperature=1.0, mask=None, bias=None,
                   dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None,
                   return_weights=False):
  """Hard attention (module docstring).

  Args:
    query: [b, n, h, d]; key, value: [b, m, h, d].
    rng: PRNG key for the Gumbel noise (training), or None (eval: argmax).
    temperature: tau > 0 of the soft sample whose gradient is used.
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype); with return_weights,
    (that, weights [b, h, n, m]).
  """
  dtype = dtype or query.dtype
  m = key.shape[1]
  scaled = query.astype(dtype) / jnp.sqrt(query.shape[-1]).astype(dtype)
  logits = jnp.einsum('bnhd,bmhd->bhnm', scaled, key.astype(dtype),
                      preferred_element_type=jnp.float32)  # [b, h, n, m]
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if rng is None:
    weights = jax.nn.one_hot(jnp.argmax(masked_logits(logits, mask), -1), m)
  else:
    gumbel = jax.random.gumbel(rng, logits.shape, jnp.float32)
    # Masked after the division: a masked logit divided by a small temperature
    # would overflow to -inf, and a row of -inf is NaN after the softmax.
    noisy = masked_logits((logits + gumbel) / temperature, mask)
    y_soft = jax.nn.softmax(noisy, axis=-1)
    y_hard = jax.nn.one_hot(jnp.argmax(noisy, -1), m)
    # Bracketed so that the forward value is y_hard + 0, exactly one-hot.
    weights = y_hard + (y_soft - jax.lax.stop_gradient(y_soft))
  if mask is not None:
    # argmax over a fully masked row picks key 0; uniform as softmax_weights instead.
    visible = jnp.any(jnp.broadcast_to(mask, logits.shape), -1, keepdims=True)
    weights = jnp.where(visible, weights, 1.0 / m)
  weights = dropout.apply(weights.astype(dtype), dropout_rate, dropout_rng, deterministic)
  out = jnp.einsum('bhnm,bmhd->bnhd', weights, value.astype(dtype))
  return (out, weights) if return_weights else out


@dataclasses.dataclass(frozen=True)
class HardOptions:
  """Hard attention's option.

  temperature: of the soft weights whose gradient training takes
    (softmax((l + g) / temperature)); a number > 0.
  """
  temperature: float = 1.0

  def __post_init__(self):
    registry.check_positive(self, 'temperature')


registry.register(registry.AttentionVariant(
    name='hard',
    fn=hard_attention,
    options=HardOptions,
    doc='one key per query: straight-through Gumbel-softmax sample of softmax(q.k/sqrt(d)) '
        'in training, argmax in eval; temperature of the soft gradient'))
