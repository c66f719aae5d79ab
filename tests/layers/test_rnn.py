"""RNN seq2seq (layers/rnn.py, models.RNNSeq2Seq): cached decoding, padding,
gradients, training, config checks."""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import main
from flaxformer_lite import decoding, models
from flaxformer_lite.attention import registry
from flaxformer_lite.layers import Embed

RNN_VARIANTS = [n for n in registry.names() if 'rnn_seq2seq' in registry.get(n).models]


def _kind(name):
  v = registry.get(name)
  return v.uses_positions, v.stochastic, v.uses_alignment


# The RNN treats variants differently only through these flags (q_offset, the
# 'dropout' rng, prev_alignment), and compiling a backward pass costs seconds
# here: training runs one variant of each kind.
_FIRST_OF_KIND = {}
for _name in RNN_VARIANTS:
  _FIRST_OF_KIND.setdefault(_kind(_name), _name)
ONE_PER_KIND = sorted(_FIRST_OF_KIND.values())

BASE = dict(type='rnn_seq2seq', vocab_size=11, d_model=8, num_heads=2, num_encoder_layers=1,
            num_decoder_layers=2, mlp_dim=0, dropout_rate=0.0, attention_dropout_rate=0.0,
            attention='dot_product', attention_kwargs={}, positions='none', max_len=0,
            pre_ln=True, activation='relu', dtype='float32', rnn_cell='lstm',
            rnn_input_feeding=True)
# Example 1 is padded after 2 tokens. Decoder inputs hold no PAD: a cached
# decoder is fed real tokens only.
INPUTS = jnp.asarray([[4, 5, 6, 7, 2], [8, 2, 0, 0, 0]], jnp.int32)
DEC_INPUTS = jnp.asarray([[1, 6, 5, 4, 9, 3], [1, 8, 3, 3, 10, 5]], jnp.int32)


def _cfg(cell='lstm', attention='dot_product', **kw):
  return {**BASE, 'rnn_cell': cell, 'attention': attention, **kw}


def _random_params(cfg, seed=0):
  """Random values for every parameter (shapes from eval_shape: no compile)."""
  shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), INPUTS,
                          DEC_INPUTS)['params']
  leaves, tree = jax.tree_util.tree_flatten(shapes)
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_unflatten(
      tree, [jnp.asarray(rng.normal(size=x.shape).astype(np.float32) * 0.5) for x in leaves])


# ---- every variant: cached decoding == teacher forcing; it trains ----------------
#
# XLA compilation dominates these tests on a small CPU, so each test compiles
# one program that answers all its questions.

TARGETS = jnp.asarray([[7, 6, 5, 4, 2, 0], [8, 2, 0, 0, 0, 0]], jnp.int32)


def _cached_vs_full(cfg):
  """-> f(params, cache): (teacher-forced logits, logits fed one token at a
  time through the cache, the cache's final step) for INPUTS, DEC_INPUTS."""
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)

  def f(params, cache):
    want = model.apply({'params': params}, INPUTS, DEC_INPUTS)
    encoded = model.apply({'params': params}, INPUTS, method='encode')

    def step(cache, tokens):  # tokens [b]
      logits, variables = decode_model.apply(
          {'params': params, 'cache': cache}, encoded, INPUTS, tokens[:, None],
          method='decode', mutable=['cache'])
      return variables['cache'], logits[:, 0]
    cache, got = jax.lax.scan(step, cache, DEC_INPUTS.T)
    return want, jnp.swapaxes(got, 0, 1), cache['decoder']['carry']['step']

  cache = decoding.init_cache(decode_model, INPUTS, DEC_INPUTS)
  return f, cache


def _assert_cached_equals_full(want, got, steps):
  assert int(steps) == DEC_INPUTS.shape[1]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# test_each_kind_of_variant_trains makes this check for ONE_PER_KIND, with the
# same configuration and random parameters, in its first step's program.
@pytest.mark.parametrize('attention', [n for n in RNN_VARIANTS if n not in ONE_PER_KIND])
def test_every_variant_decodes_with_the_lstm_cache(attention):
  """Feeding one token at a time through the cache gives the teacher-forced
  logits (positions: step t is q_offset t; alignment: the running sum of the
  earlier steps' weights)."""
  f, cache = _cached_vs_full(_cfg('lstm', attention))
  _assert_cached_equals_full(*jax.jit(f)(_random_params(_cfg('lstm', attention)), cache))


@pytest.mark.parametrize('attention', RNN_VARIANTS)
def test_every_variant_decodes_with_the_gru_cache(attention):
  f, cache = _cached_vs_full(_cfg('gru', attention))
  _assert_cached_equals_full(*jax.jit(f)(_random_params(_cfg('gru', attention)), cache))


@pytest.mark.parametrize('attention', ONE_PER_KIND)
def test_each_kind_of_variant_trains(attention):
  """LSTM, two decoder layers, dropout on (stochastic variants and dropout
  draw from the 'dropout' rng inside the scan): gradients are finite and
  reach every parameter, Adam steps on a tiny batch reduce the loss, and the
  cache matches the teacher-forced pass with the random parameters (as
  test_every_variant_decodes_with_the_lstm_cache checks for the others) and
  still after the updates."""
  cfg = _cfg('lstm', attention)
  train_model = models.build({**cfg, 'dropout_rate': 0.1})
  cached_vs_full, cache = _cached_vs_full(cfg)
  weights = (TARGETS != models.PAD_ID).astype(jnp.float32)

  def loss_fn(params, rng):
    logits = train_model.apply({'params': params}, INPUTS, models.shift_right(TARGETS),
                               deterministic=False, rngs={'dropout': rng})
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, TARGETS)
    return jnp.sum(nll * weights) / jnp.sum(weights)

  tx = optax.adam(3e-2)

  @jax.jit
  def train_step_and_checks(params, opt_state, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, rng)
    updates, opt_state = tx.update(grads, opt_state)
    return (loss, grads, optax.apply_updates(params, updates), opt_state,
            cached_vs_full(params, cache))

  params = _random_params(cfg)
  opt_state, losses = tx.init(params), []
  for i in range(12):
    loss, grads, new_params, opt_state, checks = train_step_and_checks(
        params, opt_state, jax.random.key(i))
    if i == 0:
      _assert_cached_equals_full(*checks)  # checks: of the parameters before this step's update
      for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        assert np.any(g != 0), f'no gradient reaches {jax.tree_util.keystr(path)}'
    params = new_params
    losses.append(float(loss))
  _assert_cached_equals_full(*checks)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


def test_cached_decoding_takes_chunks_of_any_length():
  cfg = _cfg('gru', num_decoder_layers=1)
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  params = _random_params(cfg)

  @jax.jit
  def both(params):
    want = model.apply({'params': params}, INPUTS, DEC_INPUTS)
    encoded = model.apply({'params': params}, INPUTS, method='encode')
    # The cache from `init` is a fresh one, as for the Transformer.
    cache = decode_model.init(jax.random.key(1), INPUTS, DEC_INPUTS)['cache']
    got = []
    for lo, hi in ((0, 3), (3, 4), (4, 6)):
      logits, variables = decode_model.apply({'params': params, 'cache': cache}, encoded,
                                             INPUTS, DEC_INPUTS[:, lo:hi], method='decode',
                                             mutable=['cache'])
      cache = variables['cache']
      got.append(logits)
    return want, jnp.concatenate(got, 1)

  want, got = both(params)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_attention_weights_are_sown_per_step():
  cfg = _cfg()
  params = _random_params(cfg)
  _, state = jax.jit(functools.partial(models.build(cfg).apply, mutable=['intermediates']))(
      {'params': params}, INPUTS, DEC_INPUTS)
  (weights,) = state['intermediates']['decoder']['attention_weights']
  assert weights.shape == (2, 2, DEC_INPUTS.shape[1], INPUTS.shape[1])  # [b, h, n, m]
  np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(weights[1, :, :, 2:]), 0.0)  # PAD keys


# ---- what the attention function receives: independently captured ----------------


@pytest.fixture
def recording_variant(monkeypatch):
  """Swaps 'location_sensitive' for a test-only copy that also takes positions
  and records, per call of the attention function (in call order), the
  q_offset and prev_alignment [b, h, n, m] it receives. -> that list."""
  calls = []
  real = registry.get('location_sensitive')

  def record(q_offset, prev_alignment):
    calls.append((int(q_offset), np.asarray(prev_alignment)))

  def fn(query, key, value, *args, q_offset, prev_alignment, **kw):
    jax.debug.callback(record, q_offset, prev_alignment, ordered=True)
    return real.fn(query, key, value, *args, prev_alignment=prev_alignment, **kw)

  monkeypatch.setitem(registry._REGISTRY, 'location_sensitive',
                      dataclasses.replace(real, fn=fn, uses_positions=True))
  return calls


def _assert_alignment_and_offsets(calls, weights):
  """calls: one (q_offset, prev_alignment [b, h, 1, m]) per decoder step;
  weights: the [b, h, n, m] the decoder sowed over those steps."""
  assert [q for q, _ in calls] == list(range(weights.shape[2]))
  running = np.zeros_like(weights[:, :, :1])
  for t, (_, prev_alignment) in enumerate(calls):
    np.testing.assert_allclose(prev_alignment, running, atol=1e-6, err_msg=f'step {t}')
    running = running + weights[:, :, t:t + 1]
  assert np.all(running[1, ..., 2:] == 0) and np.any(running > 0.5)  # PAD keys; not all zero


def test_alignment_and_query_position_received_by_attention(recording_variant):
  """The attention function gets, at decoder step t, q_offset = t and
  prev_alignment = the sum of the weights the decoder sowed at steps < t
  (zeros at t = 0): teacher-forced, one token at a time, and in chunks."""
  calls = recording_variant
  cfg = _cfg('gru', 'location_sensitive', num_decoder_layers=1,
             attention_kwargs={'location_kernel': 3, 'location_channels': 2})
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  params = _random_params(cfg)
  apply = jax.jit(functools.partial(model.apply, mutable=['intermediates']))
  _, state = apply({'params': params}, INPUTS, DEC_INPUTS)
  jax.effects_barrier()
  (weights,) = state['intermediates']['decoder']['attention_weights']
  weights = np.asarray(weights)  # [b, h, n, m]
  _assert_alignment_and_offsets(calls, weights)

  encoded = model.apply({'params': params}, INPUTS, method='encode')
  decode = jax.jit(functools.partial(decode_model.apply, method='decode',
                                     mutable=['cache', 'intermediates']))
  fresh = jax.eval_shape(decode_model.init, jax.random.key(1), INPUTS, DEC_INPUTS)['cache']
  fresh = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), fresh)  # as `init` leaves it
  # Chunks of lengths 1 and 2 only: two compilations.
  for chunks in ([(t, t + 1) for t in range(DEC_INPUTS.shape[1])],
                 [(0, 2), (2, 3), (3, 5), (5, 6)]):
    cache = fresh
    calls.clear()
    sown = []
    for lo, hi in chunks:
      _, variables = decode({'params': params, 'cache': cache}, encoded, INPUTS,
                            DEC_INPUTS[:, lo:hi])
      cache = variables['cache']
      sown.append(np.asarray(variables['intermediates']['decoder']['attention_weights'][0]))
    jax.effects_barrier()
    _assert_alignment_and_offsets(calls, np.concatenate(sown, axis=2))
    np.testing.assert_allclose(np.concatenate(sown, axis=2), weights, atol=1e-5)


# ---- padding ---------------------------------------------------------------------


def _noise_on_padding(ids, rng):
  """Adds noise to the embedded inputs at PAD positions."""
  noise = jnp.asarray(rng.normal(size=ids.shape + (BASE['d_model'],)).astype(np.float32))

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if (isinstance(context.module, Embed) and context.method_name == '__call__'
        and args[0].shape == ids.shape):
      out = out + jnp.where((ids == models.PAD_ID)[..., None], noise, 0.0)
    return out
  return nn.intercept_methods(interceptor)


def test_encoder_outputs_ignore_padding():
  # Lengths are nn.RNN's business, the same for both cells.
  cfg = _cfg('lstm', num_encoder_layers=2)  # the second layer reads the first's outputs
  model = models.build(cfg)
  params = _random_params(cfg)
  encode_fn = jax.jit(functools.partial(model.apply, method='encode'))
  encode = lambda ids: np.asarray(encode_fn({'params': params}, ids))
  want = encode(INPUTS)
  np.testing.assert_array_equal(want[1, 2:], 0.0)
  # More padding columns.
  longer = jnp.pad(INPUTS, ((0, 0), (0, 3)))
  got = encode(longer)
  np.testing.assert_allclose(got[:, :INPUTS.shape[1]], want, atol=1e-6)
  np.testing.assert_array_equal(got[:, INPUTS.shape[1]:], 0.0)
  # Other content at PAD positions (both directions would read it if unmasked).
  with _noise_on_padding(longer, np.random.default_rng(0)):
    noisy = encode(longer)
  np.testing.assert_allclose(noisy, got, atol=1e-6)
  # The logits too (the bridge reads the last valid position).
  logits = lambda ids: np.asarray(jax.jit(model.apply)({'params': params}, ids, DEC_INPUTS))
  np.testing.assert_allclose(logits(longer), logits(INPUTS), atol=1e-5, rtol=1e-5)
  # Sanity: a real token does matter, to its own row only.
  other = np.asarray(INPUTS).copy()
  other[1, 0] = 9
  changed = encode(jnp.asarray(other))
  assert not np.allclose(changed[1, :2], want[1, :2], atol=1e-4)
  np.testing.assert_allclose(changed[0], want[0], atol=1e-6)


# ---- config ------------------------------------------------------------------------


def test_base_config_rnn_keys_and_validation():
  c = config_lib.base_config()
  c.model.type = 'rnn_seq2seq'
  main.validate(c)
  assert c.model.rnn_cell == 'lstm' and c.model.rnn_input_feeding is True
  back = config_lib.from_json(config_lib.to_json(c))
  assert config_lib.differences(c, back) == []


@pytest.mark.parametrize('key,value,expected', [
    ('rnn_cell', 'rnn', "model.rnn_cell='rnn' is not valid; valid: lstm, gru"),
    ('d_model', 9, 'model.d_model=9 over the two directions'),
    ('num_decoder_layers', 0, 'model.num_decoder_layers=0 must be >= 1'),
])
def test_bad_rnn_config_is_named(key, value, expected):
  c = config_lib.base_config()
  c.model.type, c.model.num_heads, c.model.positions = 'rnn_seq2seq', 1, 'none'
  c.model[key] = value
  with pytest.raises(config_lib.ConfigError) as e:
    main.validate(c)
  assert expected in str(e.value)


def test_no_input_feeding_builds_a_smaller_first_cell():
  with_feeding = _random_params(_cfg())
  without = _random_params(_cfg(rnn_input_feeding=False))
  kernel = lambda p: p['decoder']['step']['cell_0']['ii']['kernel'].shape
  assert kernel(with_feeding) == (2 * BASE['d_model'], BASE['d_model'])
  assert kernel(without) == (BASE['d_model'], BASE['d_model'])
