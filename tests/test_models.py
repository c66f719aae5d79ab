"""Property tests for models.build: cached decoding, causality, padding.

The decoding and causality properties run for every registered variant a
Transformer can use, with options that put its position logic to work on
sequences longer than its window (see `exercised_options`).
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import models
from flaxformer_lite.attention import registry
from flaxformer_lite.layers import AddPositions

BASE = dict(type='encoder_decoder', vocab_size=13, d_model=16, num_heads=2,
            num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32, dropout_rate=0.0,
            attention_dropout_rate=0.0, attention='dot_product', attention_kwargs={},
            positions='sinusoidal', max_len=16, pre_ln=True, activation='relu',
            dtype='float32')

SETTINGS = [('sinusoidal', True), ('learned', False), ('sinusoidal', False), ('learned', True)]
SETTING_IDS = [f'{p}-{"preln" if ln else "postln"}' for p, ln in SETTINGS]

# Encoder inputs: padded after 6 and 10 tokens. Decoder inputs contain no PAD:
# a cached decoder is fed real tokens only. Both L long, so that the encoder's
# ops have the decoder's shapes (compiled once).
INPUTS = jnp.asarray([[3, 4, 5, 6, 7, 2, 0, 0, 0, 0, 0, 0],
                      [8, 9, 10, 11, 12, 3, 4, 5, 6, 2, 0, 0]], jnp.int32)
TARGETS = jnp.asarray([[3, 9, 4, 12, 5, 8, 6, 10, 11, 4, 7, 2],
                       [7, 7, 11, 6, 10, 3, 12, 9, 5, 5, 8, 2]], jnp.int32)
L = TARGETS.shape[1]


def _config(model_type, positions, pre_ln, attention='dot_product', options=()):
  # One decoder layer beside an encoder (the cost is in the number of layers run
  # op by op); two in a decoder-only model, so that caches of several layers meet.
  layers = 1 if model_type == 'encoder_decoder' else 2
  return dict(BASE, type=model_type, positions=positions, pre_ln=pre_ln, attention=attention,
              attention_kwargs=dict(options), num_decoder_layers=layers)


# Everything runs op by op (no jit) and parameters are drawn with numpy from
# the shapes `init` would create: the per-op compilations are then shared by
# all configurations, which keeps this file fast on a small CPU.


@functools.lru_cache(maxsize=None)
def _params(model_type, positions, pre_ln, attention='dot_product', options=()):
  """Random parameters: non-zero biases, LayerNorm scales away from 1, and
  0.5 N(0, 1) for learned positions and the variant's tables and matrices."""
  model = models.build(_config(model_type, positions, pre_ln, attention, options))
  ids = models.shift_right(TARGETS)
  args = (INPUTS, ids) if model_type == 'encoder_decoder' else (ids,)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), *args))['params']
  rng = np.random.default_rng(0)

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
    else:
      x = 0.5 * x
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _zeros(shapes):
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# ---- every variant, with options that exercise its positions ----------------------

# Picked by option name, so that a renamed option (t5's max_distance ->
# bucket_max_distance, luong's window -> half_window) keeps its value. On L = 12
# tokens: windows of 2 (local's full pass takes the blocked form, its cached
# steps the plain one); shaw clips distances at 2; t5 has 8 buckets, the last
# from distance 5 on; deberta's offsets past 2 share log buckets, past 5 one row;
# cope's contextual positions are clipped at 3.
_WINDOW, _SHAW_CLIP, _T5_BUCKETS, _T5_RANGE, _COPE_POSITIONS = 2, 2, 8, 5, 4
_DEBERTA = {'position_buckets': 4, 'max_relative_positions': 6}
# Options that pick a code path or a convention, each run.
FORMS = {'local': ({'causal': False}, {'causal': True}),
         'shaw': tuple({'kernel': k} for k in ('dense', 'shaw_banded')),
         't5_bias': ({'bidirectional': True}, {'bidirectional': False})}


def exercised_options(name, extra=None) -> tuple:
  """The variant's options (sorted (name, value) pairs) for these tests."""
  defaults = registry.get(name).kwargs
  t5 = 'num_buckets' in defaults
  picks = {'window': _WINDOW, 'half_window': _WINDOW, 'num_buckets': _T5_BUCKETS,
           'max_distance': _T5_RANGE if t5 else _SHAW_CLIP, 'bucket_max_distance': _T5_RANGE,
           'cope_positions_max': _COPE_POSITIONS, **_DEBERTA}
  options = {k: v for k, v in picks.items() if k in defaults}
  unpicked = [k for k in defaults if k not in options
              and any(w in k for w in ('window', 'distance', 'bucket', 'position'))]
  assert not unpicked, f'{name}: no test value for {unpicked}'
  options.update(extra or {})
  registry.resolve_kwargs(name, options)  # raises for an option the variant lacks
  return tuple(sorted(options.items()))


def _cases(model_type):
  """(attention, options) for every variant `model_type` can use, every form."""
  return [(name, exercised_options(name, extra)) for name in registry.names()
          if model_type in registry.get(name).models for extra in FORMS.get(name, (None,))]


def _case_id(model_type, positions, pre_ln, name, options):
  shown = {k for forms in FORMS.values() for form in forms for k in form}
  forms = ''.join(f'-{k}={v}' for k, v in options if k in shown)
  return f'{name}{forms}-{model_type}-{positions}-{"preln" if pre_ln else "postln"}'


def _parametrize(settings, keep=lambda setting, name: True):
  """Every case in each (model_type, positions, pre_ln) of `settings` (those
  that keep(setting, variant name))."""
  params = [(t, p, ln, name, options) for t, p, ln in settings for name, options in _cases(t)
            if keep((t, p, ln), name)]
  return pytest.mark.parametrize('model_type,positions,pre_ln,attention,options', params,
                                 ids=[_case_id(*x) for x in params])


def test_exercised_options_are_shorter_than_the_sequence():
  # Some query has keys beyond its window / clipping distance / last bucket on both sides.
  for name, options in _cases('encoder_decoder'):
    for key, value in options:
      if 'window' in key or 'distance' in key:
        assert 2 * value < L, (name, key, value)


# ---- cached decoding == teacher-forced forward ---------------------------------

# A decoder-only model with no positions (the variant's own position logic
# alone: the most sensitive to a wrong q_offset), and an encoder-decoder with
# sinusoidal positions. In the latter a position scheme's decoder
# self-attention is the decoder-only model's and its cross-attention is
# dot_product's (transformer._attention), so only the variants that also
# cross-attend (and those without a decoder-only form) run it. Learned
# positions and post-LN have a cache of their own (AddPositions' index) that
# no variant touches: dot_product alone runs them.
DECODE_SETTINGS = [('encoder_decoder', 'sinusoidal', True),
                   ('decoder_only', 'learned', False),
                   ('decoder_only', 'none', True)]


def _cross_attends(setting, name):
  """Whether `name` in an encoder-decoder of `setting` meets code that its
  decoder-only case does not: its cross-attention, or no decoder-only case."""
  variant = registry.get(name)
  return (setting[0] != 'encoder_decoder' or not variant.uses_positions
          or 'decoder_only' not in variant.models)


def _decode_case(setting, name):
  return ((setting != ('decoder_only', 'learned', False) or name == 'dot_product')
          and _cross_attends(setting, name))


# Chunks fed to the cached decoder: one token, a chunk of 5 (whose queries
# straddle windows), again.
SCHEDULE = (1, 5, 1, 5)


@_parametrize(DECODE_SETTINGS, _decode_case)
def test_every_variant_decodes_with_the_cache_like_the_full_pass(model_type, positions, pre_ln,
                                                                 attention, options):
  """The property that relative schemes break most often: the cached query at
  step t must get position t (q_offset), not its index within the step."""
  cfg = _config(model_type, positions, pre_ln, attention, options)
  model, decoder = models.build(cfg), models.build(cfg, decode=True)
  ids = models.shift_right(TARGETS)
  params = _params(model_type, positions, pre_ln, attention, options)
  if model_type == 'encoder_decoder':
    want = model.apply({'params': params}, INPUTS, ids)
    encoded = model.apply({'params': params}, INPUTS, method='encode')
    args, step = (INPUTS, ids), lambda v, x: decoder.apply(v, encoded, INPUTS, x, method='decode',
                                                           mutable=['cache'])
  else:
    want = model.apply({'params': params}, ids)
    args, step = (ids,), lambda v, x: decoder.apply(v, x, mutable=['cache'])
  want = np.asarray(want)
  assert want.shape == (2, L, 13)
  cache = _zeros(jax.eval_shape(decoder.init, jax.random.PRNGKey(1), *args)['cache'])
  start = 0
  for size in SCHEDULE:
    logits, mutated = step({'params': params, 'cache': cache}, ids[:, start:start + size])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(logits), want[:, start:start + size],
                               atol=2e-4, rtol=2e-4, err_msg=f'positions {start}+{size}')
    start += size
  assert start == L


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


# Both model types (the decoder-only stack, an encoder-decoder's decoder), with
# positions and LN other than DECODE_SETTINGS' for the same model type; the
# encoder-decoder for the variants it adds code to (_cross_attends).
CAUSAL_SETTINGS = [('decoder_only', 'sinusoidal', False), ('encoder_decoder', 'none', False)]


@_parametrize(CAUSAL_SETTINGS, _cross_attends)
def test_no_position_sees_the_future_gradient(model_type, positions, pre_ln, attention, options):
  """d logits[t] / d (embedded decoder input at s), along random directions:
  exactly zero for every s > t, non-zero at s = t."""
  model = models.build(_config(model_type, positions, pre_ln, attention, options))
  ids = models.shift_right(TARGETS)
  args = (INPUTS, ids) if model_type == 'encoder_decoder' else (ids,)
  params = _params(model_type, positions, pre_ln, attention, options)

  def logits(delta):
    with _perturb_decoder_positions(delta):
      return model.apply({'params': params}, *args)

  dependence = _dependence(logits, dict(options).get('kernel') == 'shaw_banded')
  leaks = np.argwhere(np.triu(dependence, 1) != 0)
  assert not leaks.size, f'(example, logits at t, input at s > t): {leaks.tolist()}'
  assert np.all(np.diagonal(dependence, axis1=1, axis2=2) > 1e-6), 'logits t ignore input t'


def _dependence(logits, reverse_mode=False):
  """|d logits[t] / d delta[s]| along random directions, [b, t, s], for
  logits(delta [2, L, d_model]) -> [2, L, vocab]."""
  rng = np.random.default_rng(0)
  zeros = jnp.zeros((2, L, BASE['d_model']))
  # One compilation each: the derivatives along every direction at once (vmap).
  # shaw_banded's custom VJPs have no forward mode: a cotangent per row t.
  if reverse_mode:
    vocab = jax.eval_shape(logits, zeros).shape[-1]
    directions = np.zeros((L, 2, L, vocab), np.float32)
    for t in range(L):
      directions[t, :, t] = rng.normal(size=(2, vocab))
    pulled = jax.jit(lambda d: jax.vmap(jax.vjp(logits, zeros)[1])(d)[0])(directions)
    dependence = np.abs(np.asarray(pulled)).max(-1).transpose(1, 0, 2)  # [b, t, s]
  else:  # forward mode: a tangent per column s
    directions = np.zeros((L, *zeros.shape), np.float32)
    for s in range(L):
      directions[s, :, s] = rng.normal(size=(2, zeros.shape[-1]))
    pushed = jax.jit(jax.vmap(lambda d: jax.jvp(logits, (zeros,), (d,))[1]))(directions)
    dependence = np.abs(np.asarray(pushed)).max(-1).transpose(1, 2, 0)  # [b, t, s]
  return dependence


PREFIX = 5


@pytest.mark.parametrize('attention', ['dot_product', 'alibi'])
def test_a_prefix_lm_sees_its_prompt_both_ways_in_the_full_pass_and_the_cache(attention):
  """model.mask='prefix_lm': logits at t depend on the input at s exactly
  where s <= t or s < prefix_len (the rule, as indices here), and the cached
  decoder fed the prompt (the prefix and one more token), then one token,
  then the rest, gives the full pass's logits."""
  cfg = dict(_config('decoder_only', 'sinusoidal', False, attention), mask='prefix_lm',
             mask_kwargs={'prefix_len': PREFIX})
  model, decoder = models.build(cfg), models.build(cfg, decode=True)
  ids = models.shift_right(TARGETS)
  params = _params('decoder_only', 'sinusoidal', False, attention)

  def logits(delta):
    with _perturb_decoder_positions(delta):
      return model.apply({'params': params}, ids)

  t, s = np.arange(L)[:, None], np.arange(L)[None, :]
  allowed = (s <= t) | (s < PREFIX)
  dependence = _dependence(logits)
  assert np.all(dependence[:, ~allowed] == 0) and np.all(dependence[:, allowed] > 1e-7)
  want = np.asarray(model.apply({'params': params}, ids))
  cache = _zeros(jax.eval_shape(decoder.init, jax.random.PRNGKey(1), ids)['cache'])
  start = 0
  for size in (PREFIX + 1, 1, L - PREFIX - 2):
    got, mutated = decoder.apply({'params': params, 'cache': cache}, ids[:, start:start + size],
                                 mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(got), want[:, start:start + size], atol=2e-4,
                               rtol=2e-4, err_msg=f'positions {start}+{size}')
    start += size


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


@pytest.mark.parametrize('positions,pre_ln', SETTINGS, ids=SETTING_IDS)
def test_extra_encoder_padding_leaves_logits_unchanged(positions, pre_ln):
  cfg = _config('encoder_decoder', positions, pre_ln)
  model = models.build(cfg)
  dec_inputs = models.shift_right(TARGETS)
  params = _params('encoder_decoder', positions, pre_ln)
  want = np.asarray(model.apply({'params': params}, INPUTS, dec_inputs))
  # Two PAD fewer, the same real tokens.
  trimmed = INPUTS[:, :10]
  np.testing.assert_array_equal(np.asarray(INPUTS[:, 10:]), 0)
  got = np.asarray(model.apply({'params': params}, trimmed, dec_inputs))
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


def test_gpt2_init_draws_the_published_scales():
  """GPT-2 (Radford et al. 2019, sec. 2.3) / nanoGPT: N(0, 0.02) everywhere,
  residual output projections N(0, 0.02 / sqrt(2 * layers)), no input scale."""
  cfg = dict(BASE, type='decoder_only', vocab_size=500, d_model=64, num_heads=4, mlp_dim=256,
             num_decoder_layers=8, init='gpt2')
  model = models.build(cfg)
  params = nn.unbox(model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32)))['params']
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
