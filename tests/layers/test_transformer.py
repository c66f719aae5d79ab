"""Transformer blocks: rematerialisation (model.remat) changes what the backward
pass keeps, never what it computes.

The reference is the same model with model.remat='none': every policy in the
live REMAT table must give its loss and gradients (dropout on, one rng), and
its gradient program must hold a checkpoint (else the policy was not applied).
Recomputing a block reorders float sums, so gradients agree to ~2e-5 relative.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import main
from flaxformer_lite import models
from flaxformer_lite.layers import transformer

V = 11


def _model_config(model_type, remat):
  m = config_lib.base_config().model
  m.type, m.vocab_size, m.remat = model_type, V, remat
  m.d_model, m.num_heads, m.mlp_dim, m.max_len = 16, 2, 32, 16
  m.num_encoder_layers = m.num_decoder_layers = 2
  m.dropout_rate = 0.1
  return m


def _loss_and_grad(model_type, remat):
  """(loss, grads, jaxpr text) of a random linear read-out of the logits."""
  model = models.build(_model_config(model_type, remat))
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, V, (2, 7)), jnp.int32).at[1, 5:].set(models.PAD_ID)
  args = (ids, ids) if model_type == 'encoder_decoder' else (ids,)
  params = nn.unbox(model.init(jax.random.key(0), *args))['params']
  readout = jnp.asarray(rng.normal(size=(2, 7, V)), jnp.float32)

  def loss(p):
    logits = model.apply({'params': p}, *args, deterministic=False,
                         rngs={'dropout': jax.random.key(1)})
    return jnp.sum(logits * readout)

  value, grads = jax.value_and_grad(loss)(params)
  return value, grads, str(jax.make_jaxpr(jax.grad(loss))(params))


# The encoder-decoder holds both stacks the policy wraps (Encoder and Decoder).
@pytest.mark.parametrize('model_type', ['encoder_decoder'])
def test_every_remat_policy_keeps_the_loss_and_gradients(model_type):
  want, want_grads, plain = _loss_and_grad(model_type, 'none')
  assert 'checkpoint' not in plain and 'remat' not in plain
  policies = [p for p in transformer.REMAT if p != 'none']
  assert policies
  for policy in policies:
    got, grads, program = _loss_and_grad(model_type, policy)
    assert 'checkpoint' in program or 'remat' in program, policy
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 grads, want_grads)


def test_remat_for_the_rnn_is_a_config_error():
  config = config_lib.base_config()
  config.model.type, config.model.remat = 'rnn_seq2seq', 'block'
  with pytest.raises(config_lib.ConfigError, match='model.remat'):
    main.validate(config)
  config.model.type, config.model.remat = 'encoder_decoder', 'blocks'
  with pytest.raises(config_lib.ConfigError, match="model.remat='blocks'.*dots_saveable"):
    main.validate(config)
