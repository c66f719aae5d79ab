"""Property tests for models.build: cached decoding, causality, padding."""
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import models
from flaxformer_lite.layers import AddPositions

BASE = dict(type='encoder_decoder', vocab_size=13, d_model=16, num_heads=2,
            num_encoder_layers=2, num_decoder_layers=2, mlp_dim=32, dropout_rate=0.0,
            attention_dropout_rate=0.0, attention='dot_product', attention_kwargs={},
            positions='sinusoidal', max_len=32, pre_ln=True, activation='relu',
            dtype='float32')

VARIANTS = list(itertools.product(['sinusoidal', 'learned'], [True, False]))
VARIANT_IDS = [f'{p}-{"preln" if ln else "postln"}' for p, ln in VARIANTS]

# Encoder inputs: example 0 padded after 3 tokens. Decoder inputs contain no
# PAD: a cached decoder is fed real tokens only.
INPUTS = jnp.asarray([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]], jnp.int32)
TARGETS = jnp.asarray([[3, 9, 4, 12, 5, 2], [7, 7, 11, 6, 10, 2]], jnp.int32)
L = TARGETS.shape[1]


def _config(model_type, positions, pre_ln):
  return dict(BASE, type=model_type, positions=positions, pre_ln=pre_ln)


def _params(model, *args, seed=0):
  params = model.init(jax.random.PRNGKey(seed), *args)['params']
  # Learned position tables start at stddev 0.02; make them matter as much as
  # the token embeddings so that a wrong position shows up clearly.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * 25 if 'pos_embedding' in jax.tree_util.keystr(path) else x,
      params)
  return params


def _schedules():
  return [[1] * L, [3] + [1] * (L - 3), [2, 3, 1]]


# ---- cached decoding == teacher-forced forward ---------------------------------


@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_encoder_decoder_cached_decoding_matches_forward(positions, pre_ln):
  cfg = _config('encoder_decoder', positions, pre_ln)
  model, decoder = models.build(cfg), models.build(cfg, decode=True)
  dec_inputs = models.shift_right(TARGETS)
  params = _params(model, INPUTS, dec_inputs)
  want = np.asarray(model.apply({'params': params}, INPUTS, dec_inputs))
  assert want.shape == (2, L, 13)
  encoded = model.apply({'params': params}, INPUTS, method='encode')
  fresh_cache = decoder.init(jax.random.PRNGKey(1), INPUTS, dec_inputs)['cache']
  step = jax.jit(lambda variables, tokens: decoder.apply(
      variables, encoded, INPUTS, tokens, method='decode', mutable=['cache']))
  for schedule in _schedules():
    cache, start = fresh_cache, 0
    for size in schedule:
      logits, mutated = step({'params': params, 'cache': cache},
                             dec_inputs[:, start:start + size])
      cache = mutated['cache']
      np.testing.assert_allclose(np.asarray(logits), want[:, start:start + size],
                                 atol=1e-4, rtol=1e-4,
                                 err_msg=f'schedule {schedule}, positions {start}+{size}')
      start += size
    assert start == L


@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_decoder_only_cached_decoding_matches_forward(positions, pre_ln):
  cfg = _config('decoder_only', positions, pre_ln)
  model, decoder = models.build(cfg), models.build(cfg, decode=True)
  ids = models.shift_right(TARGETS)
  params = _params(model, ids)
  want = np.asarray(model.apply({'params': params}, ids))
  assert want.shape == (2, L, 13)
  shapes = jax.eval_shape(decoder.init, jax.random.PRNGKey(1), ids)['cache']
  fresh_cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  step = jax.jit(lambda variables, tokens: decoder.apply(variables, tokens,
                                                         mutable=['cache']))
  for schedule in _schedules():
    cache, start = fresh_cache, 0
    for size in schedule:
      logits, mutated = step({'params': params, 'cache': cache}, ids[:, start:start + size])
      cache = mutated['cache']
      np.testing.assert_allclose(np.asarray(logits), want[:, start:start + size],
                                 atol=1e-4, rtol=1e-4,
                                 err_msg=f'schedule {schedule}, positions {start}+{size}')
      start += size


# ---- causality -------------------------------------------------------------------


def _perturb_decoder_positions(delta):
  """Adds `delta` [b, n, d_model] to the decoder's embedded inputs."""
  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if (isinstance(context.module, AddPositions) and context.method_name == '__call__'
        and context.module.path[0] == 'decoder'):
      out = out + delta
    return out
  return nn.intercept_methods(interceptor)


@pytest.mark.parametrize('model_type', models.MODEL_TYPES)
@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_no_position_sees_the_future_gradient(model_type, positions, pre_ln):
  cfg = _config(model_type, positions, pre_ln)
  model = models.build(cfg)
  ids = models.shift_right(TARGETS)[:1]
  args = (INPUTS[:1], ids) if model_type == 'encoder_decoder' else (ids,)
  params = _params(model, *args)

  def logits(delta):
    with _perturb_decoder_positions(delta):
      return model.apply({'params': params}, *args)

  jac = np.asarray(jax.jacrev(logits)(jnp.zeros((1, L, 16))))  # [1, L, V, 1, L, 16]
  assert jac.shape == (1, L, 13, 1, L, 16)
  for t in range(L):
    for s in range(L):
      block = jac[0, t, :, 0, s, :]
      if s > t:
        np.testing.assert_array_equal(block, 0.0, err_msg=f'logits {t} see input {s}')
      else:
        assert np.abs(block).max() > 1e-6, f'logits {t} do not depend on input {s}'


@pytest.mark.parametrize('model_type', models.MODEL_TYPES)
@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_changing_future_tokens_leaves_past_logits(model_type, positions, pre_ln):
  cfg = _config(model_type, positions, pre_ln)
  model = models.build(cfg)
  ids = models.shift_right(TARGETS)
  call = lambda p, x: (model.apply({'params': p}, INPUTS, x) if model_type == 'encoder_decoder'
                       else model.apply({'params': p}, x))
  params = _params(model, *((INPUTS, ids) if model_type == 'encoder_decoder' else (ids,)))
  call = jax.jit(call)
  base = np.asarray(call(params, ids))
  rng = np.random.default_rng(0)
  for t in range(L - 1):
    changed = np.asarray(ids).copy()
    # every later token moves to a different non-PAD id in 3..12
    shift = rng.integers(1, 10, size=changed[:, t + 1:].shape)
    changed[:, t + 1:] = (changed[:, t + 1:] - 3 + shift) % 10 + 3
    got = np.asarray(call(params, jnp.asarray(changed)))
    np.testing.assert_allclose(got[:, :t + 1], base[:, :t + 1], atol=1e-5, rtol=1e-5,
                               err_msg=f'changing tokens after {t}')
    assert not np.allclose(got[:, t + 1], base[:, t + 1], atol=1e-4)


# ---- encoder padding ----------------------------------------------------------


@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_extra_encoder_padding_leaves_logits_unchanged(positions, pre_ln):
  cfg = _config('encoder_decoder', positions, pre_ln)
  model = models.build(cfg)
  dec_inputs = models.shift_right(TARGETS)
  params = _params(model, INPUTS, dec_inputs)
  want = np.asarray(model.apply({'params': params}, INPUTS, dec_inputs))
  padded = jnp.pad(INPUTS, ((0, 0), (0, 3)))
  got = np.asarray(model.apply({'params': params}, padded, dec_inputs))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # The decoder does read the encoder: a real token changed changes the logits.
  other = np.asarray(INPUTS).copy()
  other[0, 1] = 11
  changed = np.asarray(model.apply({'params': params}, jnp.asarray(other), dec_inputs))
  assert not np.allclose(changed[0], want[0], atol=1e-4)
  np.testing.assert_allclose(changed[1], want[1], atol=1e-5, rtol=1e-5)


# ---- build and helpers ------------------------------------------------------------


def test_bad_model_type_raises_naming_valid_types():
  with pytest.raises(ValueError, match='transformer_xl') as e:
    models.build(dict(BASE, type='transformer_xl'))
  for name in ('encoder_decoder', 'decoder_only'):
    assert name in str(e.value)


def test_shift_right_hand_computed():
  targets = jnp.asarray([[5, 6, 7, 2], [8, 2, 0, 0]])
  np.testing.assert_array_equal(np.asarray(models.shift_right(targets)),
                                [[1, 5, 6, 7], [1, 8, 2, 0]])
  np.testing.assert_array_equal(np.asarray(models.shift_right(targets, bos_id=9)),
                                [[9, 5, 6, 7], [9, 8, 2, 0]])
