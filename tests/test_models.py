"""Property tests for models.build: cached decoding, causality, padding."""
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import models
from flaxformer_lite.attention import registry
from flaxformer_lite.layers import AddPositions

BASE = dict(type='encoder_decoder', vocab_size=13, d_model=16, num_heads=2,
            num_encoder_layers=2, num_decoder_layers=2, mlp_dim=32, dropout_rate=0.0,
            attention_dropout_rate=0.0, attention='dot_product', attention_kwargs={},
            positions='sinusoidal', max_len=32, pre_ln=True, activation='relu',
            dtype='float32')

MODEL_TYPES = ['encoder_decoder', 'decoder_only']
VARIANTS = list(itertools.product(['sinusoidal', 'learned'], [True, False]))
VARIANT_IDS = [f'{p}-{"preln" if ln else "postln"}' for p, ln in VARIANTS]

# Encoder inputs: example 0 padded after 3 tokens. Decoder inputs contain no
# PAD: a cached decoder is fed real tokens only.
INPUTS = jnp.asarray([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]], jnp.int32)
TARGETS = jnp.asarray([[3, 9, 4, 12, 5, 2], [7, 7, 11, 6, 10, 2]], jnp.int32)
L = TARGETS.shape[1]


def _config(model_type, positions, pre_ln):
  return dict(BASE, type=model_type, positions=positions, pre_ln=pre_ln)


# Everything runs op by op (no jit) and parameters are drawn with numpy from
# the shapes `init` would create: the per-op compilations are then shared by
# all configurations, which keeps this file fast on a small CPU.


@functools.lru_cache(maxsize=None)
def _params(model_type, positions, pre_ln):
  """Random parameters (non-zero biases, LayerNorm scales away from 1)."""
  model = models.build(_config(model_type, positions, pre_ln))
  ids = models.shift_right(TARGETS)
  args = (INPUTS, ids) if model_type == 'encoder_decoder' else (ids,)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *args)['params']
  rng = np.random.default_rng([MODEL_TYPES.index(model_type), VARIANTS.index((positions, pre_ln))])

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    x = rng.normal(size=leaf.shape)
    if name.endswith("['scale']"):
      x = 1.0 + 0.2 * x
    elif name.endswith("['bias']"):
      x = 0.1 * x
    elif name.endswith("['kernel']"):
      x = x / np.sqrt(leaf.shape[0])
    elif name.endswith("['embedding']"):
      x = x / np.sqrt(leaf.shape[-1])
    else:  # learned positions: as large as the scaled token embeddings
      x = 0.5 * x
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _zeros(shapes):
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _schedules():
  """Chunk sizes fed to the cached decoder: single steps; a prefill, then steps."""
  return [[1] * L, [3] + [1] * (L - 3)]


# ---- cached decoding == teacher-forced forward ---------------------------------


@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_encoder_decoder_cached_decoding_matches_forward(positions, pre_ln):
  cfg = _config('encoder_decoder', positions, pre_ln)
  model, decoder = models.build(cfg), models.build(cfg, decode=True)
  dec_inputs = models.shift_right(TARGETS)
  params = _params('encoder_decoder', positions, pre_ln)
  want = np.asarray(model.apply({'params': params}, INPUTS, dec_inputs))
  assert want.shape == (2, L, 13)
  encoded = model.apply({'params': params}, INPUTS, method='encode')
  fresh_cache = _zeros(jax.eval_shape(decoder.init, jax.random.PRNGKey(1), INPUTS,
                                       dec_inputs)['cache'])
  for schedule in _schedules():
    cache, start = fresh_cache, 0
    for size in schedule:
      logits, mutated = decoder.apply({'params': params, 'cache': cache}, encoded, INPUTS,
                                      dec_inputs[:, start:start + size], method='decode',
                                      mutable=['cache'])
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
  params = _params('decoder_only', positions, pre_ln)
  want = np.asarray(model.apply({'params': params}, ids))
  assert want.shape == (2, L, 13)
  fresh_cache = _zeros(jax.eval_shape(decoder.init, jax.random.PRNGKey(1), ids)['cache'])
  for schedule in _schedules():
    cache, start = fresh_cache, 0
    for size in schedule:
      logits, mutated = decoder.apply({'params': params, 'cache': cache},
                                      ids[:, start:start + size], mutable=['cache'])
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


@pytest.mark.parametrize('model_type', MODEL_TYPES)
@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_no_position_sees_the_future_gradient(model_type, positions, pre_ln):
  # d logits / d (embedded decoder input at position s), along a random
  # direction: exactly zero at every position t < s, non-zero at t = s.
  model = models.build(_config(model_type, positions, pre_ln))
  ids = models.shift_right(TARGETS)
  args = (INPUTS, ids) if model_type == 'encoder_decoder' else (ids,)
  params = _params(model_type, positions, pre_ln)

  def logits(delta):
    with _perturb_decoder_positions(delta):
      return model.apply({'params': params}, *args)

  rng = np.random.default_rng(0)
  # linearize traces the model once; each directional derivative then
  # evaluates the linear map only.
  _, derivative = jax.linearize(logits, jnp.zeros((2, L, BASE['d_model'])))
  for s in range(L):
    direction = np.zeros((2, L, BASE['d_model']), np.float32)
    direction[:, s] = rng.normal(size=(2, BASE['d_model']))
    tangent = np.asarray(derivative(jnp.asarray(direction)))  # [b, L, V]
    np.testing.assert_array_equal(tangent[:, :s], 0.0,
                                  err_msg=f'logits before {s} depend on input {s}')
    for b in range(2):
      assert np.abs(tangent[b, s]).max() > 1e-6, f'logits {s} ignore input {s}'


@pytest.mark.parametrize('model_type,positions,pre_ln', [
    ('encoder_decoder', 'sinusoidal', True), ('decoder_only', 'learned', False)])
def test_changing_future_tokens_leaves_past_logits(model_type, positions, pre_ln):
  cfg = _config(model_type, positions, pre_ln)
  model = models.build(cfg)
  ids = models.shift_right(TARGETS)
  params = _params(model_type, positions, pre_ln)
  call = lambda x: (model.apply({'params': params}, INPUTS, x)
                    if model_type == 'encoder_decoder' else model.apply({'params': params}, x))
  base = np.asarray(call(ids))
  rng = np.random.default_rng(0)
  for t in range(L - 1):
    changed = np.asarray(ids).copy()
    # every later token moves to a different non-PAD id in 3..12
    shift = rng.integers(1, 10, size=changed[:, t + 1:].shape)
    changed[:, t + 1:] = (changed[:, t + 1:] - 3 + shift) % 10 + 3
    got = np.asarray(call(jnp.asarray(changed)))
    np.testing.assert_allclose(got[:, :t + 1], base[:, :t + 1], atol=1e-5, rtol=1e-5,
                               err_msg=f'changing tokens after {t}')
    assert not np.allclose(got[:, t + 1], base[:, t + 1], atol=1e-4)


# ---- encoder padding ----------------------------------------------------------


@pytest.mark.parametrize('positions,pre_ln', VARIANTS, ids=VARIANT_IDS)
def test_extra_encoder_padding_leaves_logits_unchanged(positions, pre_ln):
  cfg = _config('encoder_decoder', positions, pre_ln)
  model = models.build(cfg)
  dec_inputs = models.shift_right(TARGETS)
  params = _params('encoder_decoder', positions, pre_ln)
  want = np.asarray(model.apply({'params': params}, INPUTS, dec_inputs))
  # One more PAD: length L, so the encoder reuses the decoder's compiled shapes.
  padded = jnp.pad(INPUTS, ((0, 0), (0, L - INPUTS.shape[1])))
  assert padded.shape[1] > INPUTS.shape[1]
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


@pytest.mark.parametrize('attention', registry.names())
def test_every_variant_decodes_with_the_cache_like_the_full_pass(attention):
  """The property that relative schemes break most often: the cached query at
  step t must get position t (q_offset), not its index within the step."""
  cfg = dict(type='encoder_decoder', vocab_size=11, d_model=16, num_heads=2,
             num_encoder_layers=1, num_decoder_layers=2, mlp_dim=32, dropout_rate=0.0,
             attention_dropout_rate=0.0, attention=attention, attention_kwargs={},
             positions='none', max_len=16, pre_ln=True, activation='relu', dtype='float32')
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  inputs = jnp.array([[4, 5, 6, 7, 2], [8, 2, 0, 0, 0]])
  targets = jnp.array([[1, 6, 5, 4, 9, 3, 7], [1, 8, 3, 3, 2, 5, 5]])
  params = model.init(jax.random.key(0), inputs, targets)['params']
  # Random (not initial) values for every parameter, so that a position error shows.
  leaves, tree = jax.tree_util.tree_flatten(params)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_unflatten(
      tree, [jnp.asarray(rng.normal(size=x.shape).astype(np.float32) * 0.5) for x in leaves])
  want = model.apply({'params': params}, inputs, targets)
  encoded = model.apply({'params': params}, inputs, method='encode')
  cache = decode_model.init(jax.random.key(0), inputs, targets)['cache']
  got = []
  for lo, hi in ((0, 3), (3, 4), (4, 5), (5, 7)):  # prefill, steps, a chunk
    logits, variables = decode_model.apply({'params': params, 'cache': cache}, encoded, inputs,
                                           targets[:, lo:hi], method='decode', mutable=['cache'])
    cache = variables['cache']
    got.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(got, 1)), np.asarray(want),
                             atol=2e-4, rtol=2e-4)


def test_gpt2_init_draws_the_published_scales():
  """GPT-2 (Radford et al. 2019, sec. 2.3) / nanoGPT: N(0, 0.02) everywhere,
  residual output projections N(0, 0.02 / sqrt(2 * layers)), no input scale."""
  cfg = dict(BASE, type='decoder_only', vocab_size=500, d_model=64, num_heads=4, mlp_dim=256,
             num_decoder_layers=8, init='gpt2')
  model = models.build(cfg)
  params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))['params']
  out_std = 0.02 / np.sqrt(16)
  layer = params['decoder']['layer_3']
  for leaf, std in ((params['embed']['embedding'], 0.02),
                    (layer['self_attention']['query']['kernel'], 0.02),
                    (layer['mlp']['wi']['kernel'], 0.02),
                    (layer['self_attention']['out']['kernel'], out_std),
                    (layer['mlp']['wo']['kernel'], out_std)):
    assert float(np.std(leaf)) == pytest.approx(std, rel=0.1)
  # the input embedding is the table row itself (the default scales it by sqrt(d))
  table = np.asarray(params['embed']['embedding'])
  embed = models.Embed(500, 64, stddev=0.02, scale=False)
  got = embed.apply({'params': {'embedding': table}}, jnp.array([[7]]))
  np.testing.assert_allclose(got[0, 0], table[7])
