"""model.scan_layers: a scanned stack computes what the unrolled one does.

The same weights (unrolled, then stacked by layers/scan.py) give the same
logits, the same gradients (stacked ones unstacked) and the same greedy
tokens decoded with the cache, for every model type built of the stacks;
the converter round-trips any tree exactly. The scan reorders nothing
within a layer, so logits agree to float32 rounding.
"""
import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import decoding, models, pretrained
from flaxformer_lite.attention import registry
from flaxformer_lite.config import ConfigError
from flaxformer_lite.layers import scan
from flaxformer_lite.model_types import SCANNABLE_TYPES
from flaxformer_lite.train import partitioning

V = 13


def _model_config(model_type, scan_layers, **overrides):
  m = config_lib.base_config().model
  m.update(dict(type=model_type, vocab_size=V, d_model=16, num_heads=2, mlp_dim=32,
                max_len=16, num_encoder_layers=2, num_decoder_layers=3, dropout_rate=0.0,
                scan_layers=scan_layers) | overrides)
  models.validate(m)
  return m


def _batch(model_type):
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(3, V, (2, 7)), jnp.int32).at[1, 5:].set(models.PAD_ID)
  return (ids, ids) if model_type == 'encoder_decoder' else (ids,)


def _same_tree(a, b, **tolerance):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tolerance)


@pytest.mark.parametrize('model_type,remat', [('decoder_only', 'none'),
                                              ('encoder_decoder', 'block'),
                                              ('encoder_only', 'none')])
def test_scanned_stack_gives_the_unrolled_logits_gradients_and_decoding(model_type, remat):
  assert model_type in SCANNABLE_TYPES
  unrolled, scanned = (models.build(_model_config(model_type, s, remat=remat))
                       for s in (False, True))
  args = _batch(model_type)
  params = nn.unbox(unrolled.init(jax.random.key(0), *args))['params']
  stacked = scan.stack_layers(params)
  readout = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, V)), jnp.float32)

  @jax.jit
  def logits_and_grads(p_unrolled, p_stacked):
    def loss(model, p):  # deterministic=False runs the remat'd training path
      logits = model.apply({'params': p}, *args, deterministic=False)
      return jnp.sum(logits * readout), logits
    (_, a), ga = jax.value_and_grad(loss, argnums=1, has_aux=True)(unrolled, p_unrolled)
    (_, b), gb = jax.value_and_grad(loss, argnums=1, has_aux=True)(scanned, p_stacked)
    return a, b, ga, gb

  a, b, grads, stacked_grads = logits_and_grads(params, stacked)
  np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
  _same_tree(scan.unstack_layers(stacked_grads), grads, rtol=1e-4, atol=1e-5)
  if model_type == 'encoder_only':
    return

  def greedy(model_config, p):
    config = _model_config(model_type, model_config)
    decode_model = models.build(config, decode=True)
    if model_type == 'decoder_only':
      return decoding.greedy_generate(decode_model, p, args[0][:, :3], 8)
    return decoding.greedy_translate(models.build(config), decode_model, p, args[0], 8)

  want, got = jax.jit(lambda p, q: (greedy(False, p), greedy(True, q)))(params, stacked)
  np.testing.assert_array_equal(got, want)


def test_the_cache_and_sown_weights_are_stacked_like_the_parameters():
  """The decode model's cache and sown attention weights: scanned ones are
  the unrolled ones stacked (one prefill step with the same weights)."""
  ids = _batch('decoder_only')[0]
  out = {}
  for s in (False, True):
    model = models.build(_model_config('decoder_only', s), decode=True, sow_weights=True)
    init = nn.unbox(model.init(jax.random.key(0), ids))
    params = init['params'] if not s else scan.stack_layers(out[False][0])
    _, state = jax.jit(lambda p, c, model=model: model.apply(
        {'params': p, 'cache': c}, ids, mutable=['cache', 'intermediates']))(
            params, init['cache'])
    out[s] = params, state
  _same_tree(out[True][1], scan.stack_layers(out[False][1]), rtol=1e-5, atol=1e-6)
  assert out[True][1]['cache']['decoder']['layers']['self_attention']['cache_index'].shape == (3,)


def test_training_mode_runs_with_dropout_and_randomized_positions():
  """Dropout (hidden and attention) and drawn positions under the scan: each
  layer its own dropout rng, one position draw broadcast to all."""
  config = _model_config('decoder_only', True, dropout_rate=0.3, attention_dropout_rate=0.3,
                         randomized_positions=16, attention='rotary')
  model = models.build(config)
  ids = _batch('decoder_only')[0]
  params = nn.unbox(model.init(jax.random.key(0), ids))['params']
  run = jax.jit(lambda key: model.apply({'params': params}, ids, deterministic=False,
                                        rngs={'dropout': key}))
  a, b, again = run(jax.random.key(1)), run(jax.random.key(2)), run(jax.random.key(1))
  assert np.isfinite(a).all() and not np.allclose(a, b)
  np.testing.assert_array_equal(a, again)


# A subset of the live registry, one variant per path through the attention
# layer: the values term and its tables (shaw), a score with parameters
# (t5_bias), q/k transforms (rotary), a content-position score (deberta),
# a window mask (local), the alignment family (luong_general). All 20 that
# the decoder-only LM takes pass; run one by one they cost ~45 s of compiling.
VARIANTS = ('shaw', 't5_bias', 'rotary', 'deberta', 'local', 'luong_general')


@pytest.mark.parametrize('name', VARIANTS)
def test_attention_variants_give_the_unrolled_logits(name):
  """At d 16, 2 layers, n 8, one compile each (init, stack, both forwards)."""
  assert 'decoder_only' in registry.get(name).models
  ids = jnp.asarray(np.random.default_rng(0).integers(3, V, (1, 8)), jnp.int32)
  unrolled, scanned = (models.build(_model_config('decoder_only', s, attention=name,
                                                  num_decoder_layers=2))
                       for s in (False, True))

  @jax.jit
  def both(key):
    p = nn.unbox(unrolled.init(key, ids))['params']
    return (unrolled.apply({'params': p}, ids),
            scanned.apply({'params': scan.stack_layers(p)}, ids))

  a, b = both(jax.random.key(0))
  np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_converter_round_trips_any_tree_exactly():
  rng = np.random.default_rng(0)
  leaf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  layer = lambda: {'attn': {'kernel': leaf(4, 2), 'bias': leaf(2)}, 'norm': {'scale': leaf(4)}}
  params = {'embed': {'embedding': leaf(5, 4)},
            'encoder': {f'layer_{i}': layer() for i in range(3)} | {'final_norm': leaf(4)},
            'decoder': {f'layer_{i}': layer() for i in range(2)},
            'two_stream': {'a_layer_0': layer(), 'layer_0_forward': layer()}}
  stacked = scan.stack_layers(params)
  assert set(stacked['encoder']) == {'layers', 'final_norm'}
  assert stacked['encoder']['layers']['attn']['kernel'].shape == (3, 4, 2)
  assert stacked['decoder']['layers']['norm']['scale'].shape == (2, 4)
  assert stacked['two_stream'] == params['two_stream']  # not stacks
  assert scan.is_stacked(stacked) and not scan.is_stacked(params)
  _same_tree(scan.unstack_layers(stacked), params, rtol=0, atol=0)
  # an optimizer state (named tuples around params-like trees), a cache, sown tuples
  opt_state = optax.adam(1e-3).init(params)
  _same_tree(scan.unstack_layers(scan.stack_layers(opt_state)), opt_state, rtol=0, atol=0)
  cache = {f'layer_{i}': {'cached_key': leaf(2, 3), 'cache_index': jnp.array(i)}
           for i in range(2)}
  assert scan.stack_layers(cache)['layers']['cache_index'].tolist() == [0, 1]
  _same_tree(scan.unstack_layers(scan.stack_layers(cache)), cache, rtol=0, atol=0)
  sown = {f'layer_{i}': {'attention_weights': (leaf(1, 2),)} for i in range(2)}
  _same_tree(scan.unstack_layers(scan.stack_layers(sown)), sown, rtol=0, atol=0)
  with pytest.raises(ValueError, match='layer_0 .. layer_'):
    scan.stack_layers({'layer_0': layer(), 'layer_2': layer()})


def test_scanned_parameters_carry_the_layers_axis_which_stays_whole():
  model = models.build(_model_config('decoder_only', True))
  shapes = jax.eval_shape(model.init, jax.random.key(0), _batch('decoder_only')[0])
  axes = nn.get_partition_spec(shapes['params'])['decoder']['layers']
  assert axes['mlp']['wi']['kernel'] == jax.sharding.PartitionSpec('layers', 'embed', 'mlp')
  assert dict(partitioning.LOGICAL_RULES)['layers'] is None
  assert 'layers' in partitioning.WHOLE


def test_init_from_stacks_the_checkpoints_tensors_for_a_scanned_model(monkeypatch):
  """pretrained maps a checkpoint onto the unrolled names; a scanned model
  gets them stacked (the checkpoint reader stubbed with an unrolled model's
  own tensors)."""
  ids = _batch('encoder_only')[0]
  init = lambda s: nn.unbox(models.build(_model_config('encoder_only', s)).init(
      jax.random.key(int(s)), ids))['params']
  unrolled, fresh = init(False), init(True)
  mapped = traverse_util.flatten_dict(unrolled, sep='/')
  monkeypatch.setattr(pretrained, '_read', lambda path: (None, mapped))
  _same_tree(pretrained.init_params(fresh, 'checkpoint'), scan.stack_layers(unrolled),
             rtol=0, atol=0)


@pytest.mark.parametrize('model_type', ['two_stream', 'rnn_seq2seq'])
def test_model_types_without_one_repeated_block_refuse_scan_layers(model_type):
  m = config_lib.base_config().model
  m.update(type=model_type, scan_layers=True)
  with pytest.raises(ConfigError, match='model.scan_layers=True'):
    models.validate(m)
