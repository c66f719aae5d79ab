"""Positions as data (Ruoss et al. 2023's randomized positions): every variant
that takes positions as arrays, given sorted positions p, must equal the same
variant on its ordinary path (queries and keys at 0..L-1) with token i placed
at slot p_i of a longer sequence and the other slots masked out; and the
model draws such positions in training only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import models
from flaxformer_lite.attention import registry, scheme

B, N, H, D = 2, 6, 2, 8
L = 23
POSITIONS = np.array([0, 3, 4, 9, 15, 22])  # sorted, in 0..L-1


def _call(name, q, k, v, params, kwargs, mask, **where):
  variant = registry.get(name)
  return np.asarray(variant.fn(q, k, v, mask=jnp.asarray(mask), bias=None, dropout_rate=0.0,
                               dropout_rng=None, deterministic=True, dtype=jnp.float32,
                               return_weights=False, **params, **kwargs, **where))


@pytest.mark.parametrize('name', registry.position_array_names())
def test_positions_equal_the_tokens_placed_at_them_in_a_longer_sequence(name):
  # Causal: the same code as bidirectional attention, the mask being data.
  causal = True
  variant = registry.get(name)
  r = np.random.default_rng(0)
  kwargs = registry.resolve_kwargs(name, None)
  specs = variant.params(H, D, kwargs) if variant.params else {}
  params = {p: np.asarray(x) + 0.3 * r.normal(size=x.shape).astype(np.float32)
            for p, x in scheme.random_params(specs).items()}
  q, k, v = (r.normal(size=(B, N, H, D)).astype(np.float32) for _ in range(3))
  order = np.arange(N)
  mask = (order[None, :] <= order[:, None]) if causal else np.ones((N, N), bool)
  got = _call(name, q, k, v, params, kwargs, mask[None, None], positions=POSITIONS)
  # The reference: slot POSITIONS[i] of an L-long sequence holds token i.
  placed = [np.zeros((B, L, H, D), np.float32) for _ in range(3)]
  for x, full in zip((q, k, v), placed):
    full[:, POSITIONS] = x
  slots = np.zeros((L, L), bool)
  slots[np.ix_(POSITIONS, POSITIONS)] = mask
  want = _call(name, *placed, params, kwargs, slots[None, None], q_offset=0)[:, POSITIONS]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _lm_config(**model):
  c = config_lib.base_config().model
  c.update(dict(dict(type='decoder_only', vocab_size=11, d_model=16, num_heads=2, mlp_dim=16,
                     num_decoder_layers=1, dropout_rate=0.0, attention='alibi',
                     positions='sinusoidal', randomized_positions=40), **model))
  return c


def test_training_draws_positions_and_evaluation_reads_zero_to_n():
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 11, size=(2, 9)))
  model = models.build(_lm_config())
  plain = models.build(_lm_config(randomized_positions=0))
  params = model.init(jax.random.key(0), ids)['params']
  train = lambda seed: np.asarray(model.apply({'params': params}, ids, deterministic=False,
                                              rngs={'dropout': jax.random.key(seed)}))
  evaluated = np.asarray(model.apply({'params': params}, ids))
  np.testing.assert_array_equal(evaluated, np.asarray(plain.apply({'params': params}, ids)))
  assert not np.allclose(train(1), evaluated, atol=1e-4)
  assert not np.allclose(train(1), train(2), atol=1e-4)
  np.testing.assert_array_equal(train(1), train(1))


@pytest.mark.parametrize('model,message', [
    ({'attention': 'local'}, 'reads positions as a range only'),
    ({'positions': 'learned', 'max_len': 16}, 'learned positions have a row'),
    ({'randomized_positions': -1}, 'must be an int >= 0'),
])
def test_randomized_positions_config_errors(model, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    models.validate(_lm_config(**model))
