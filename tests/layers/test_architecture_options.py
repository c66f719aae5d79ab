"""The architecture options pretrained checkpoints need, each against its
formula written out in numpy: model.norm (LayerNorm, RMSNorm) and its
epsilon, the gated MLPs and the exact GELU, model.use_bias,
model.tie_embeddings, model.embed_scale, and rotary's pair layout."""
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import config as config_lib, models
from flaxformer_lite.attention.schemes import rotary
from flaxformer_lite.layers import transformer
from flaxformer_lite.layers.embeddings import Embed

RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 3, 8)).astype(np.float32) * 3 + 1


def _cfg(**fields):
  return transformer.TransformerConfig(vocab_size=11, d_model=8, num_heads=2, mlp_dim=12,
                                       **fields)


def _randomised(params):
  """Every parameter replaced by a random draw (norm scales and biases not 1 and 0)."""
  leaves, tree = jax.tree.flatten(nn.unbox(params))
  return jax.tree.unflatten(tree, [RNG.normal(size=x.shape).astype(np.float32) for x in leaves])


@pytest.mark.parametrize('kind', ['layernorm', 'rmsnorm'])
def test_norms_and_their_epsilon(kind):
  eps = 0.5  # large: a wrong placement of eps shows
  layer = transformer.norm(_cfg(norm=kind, norm_eps=eps), 'n')
  params = _randomised(layer.init(jax.random.key(0), X))
  got = np.asarray(layer.apply(params, X))
  p = params['params']
  if kind == 'rmsnorm':
    want = X / np.sqrt((X ** 2).mean(-1, keepdims=True) + eps) * p['scale']
    assert set(p) == {'scale'}
  else:
    centred = X - X.mean(-1, keepdims=True)
    want = centred / np.sqrt(X.var(-1, keepdims=True) + eps) * p['scale'] + p['bias']
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


ERF = np.vectorize(math.erf)
FORMULAS = {
    'relu': lambda x: np.maximum(x, 0),
    'gelu': _gelu_tanh,
    'gelu_exact': lambda x: 0.5 * x * (1 + ERF(x / math.sqrt(2))),
    'swiglu': lambda x: x / (1 + np.exp(-x)),
    'geglu': _gelu_tanh,
}


@pytest.mark.parametrize('use_bias', [True, False])
@pytest.mark.parametrize('activation', sorted(transformer.ACTIVATIONS))
def test_mlp_blocks_plain_and_gated(activation, use_bias):
  assert set(FORMULAS) == set(transformer.ACTIVATIONS)
  block = transformer.MlpBlock(12, activation, use_bias=use_bias)
  params = _randomised(block.init(jax.random.key(0), X))
  p = params['params']
  assert ('wi_gate' in p) == (activation in transformer.GATED)
  assert all(('bias' in p[k]) == use_bias for k in p)

  def dense(name, x):
    return x @ p[name]['kernel'] + (p[name]['bias'] if use_bias else 0)

  act = FORMULAS[activation]
  hidden = dense('wi', X)
  hidden = act(dense('wi_gate', X)) * hidden if activation in transformer.GATED else act(hidden)
  np.testing.assert_allclose(np.asarray(block.apply(params, X)), dense('wo', hidden),
                             rtol=1e-4, atol=1e-4)


def _model(**options):
  c = config_lib.base_config().model
  c.update(type='decoder_only', vocab_size=11, d_model=8, num_heads=2, mlp_dim=12,
           num_decoder_layers=1, dropout_rate=0.0, **options)
  return models.build(c)


IDS = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, 10]], jnp.int32)


def test_llama_style_options_leave_no_bias_and_an_untied_head_equals_the_tied_one():
  """use_bias=False with RMSNorm: not one bias in the model. Untied logits
  whose matrix is the token table transposed give the tied model's output."""
  untied = _model(use_bias=False, norm='rmsnorm', activation='swiglu', tie_embeddings=False)
  params = nn.unbox(untied.init(jax.random.key(1), IDS)['params'])
  paths = ['/'.join(str(k.key) for k in path) for path, _ in
           jax.tree_util.tree_leaves_with_path(params)]
  assert not [p for p in paths if 'bias' in p], paths
  assert 'decoder/logits/kernel' in paths
  tied = _model(use_bias=False, norm='rmsnorm', activation='swiglu')
  tied_params = {k: v for k, v in params.items()}
  tied_params['decoder'] = {k: v for k, v in params['decoder'].items() if k != 'logits'}
  swapped = jax.tree.map(lambda x: x, params)
  swapped['decoder']['logits']['kernel'] = params['embed']['embedding'].T
  np.testing.assert_allclose(untied.apply({'params': swapped}, IDS),
                             tied.apply({'params': tied_params}, IDS), rtol=1e-5, atol=1e-5)


def test_embed_scale_multiplies_the_token_table():
  table_ids = jnp.asarray([[1, 5]], jnp.int32)
  for kwargs, factor in (({}, math.sqrt(8)), ({'scale': False}, 1.0),
                         ({'multiplier': 2.5}, 2.5), ({'scale': False, 'multiplier': 2.5}, 2.5)):
    embed = Embed(11, 8, **kwargs)
    params = embed.init(jax.random.key(0), table_ids)
    np.testing.assert_allclose(embed.apply(params, table_ids),
                               np.asarray(params['params']['embedding'])[[1, 5]][None] * factor,
                               rtol=1e-6)
  cfg = _cfg(embed_scale=2.5, init='gpt2')
  assert transformer.embed_kwargs(cfg)['multiplier'] == 2.5


@pytest.mark.parametrize('layout', rotary.LAYOUTS)
def test_rotary_layouts_rotate_their_pairs(layout):
  """apply_rotary against a loop: pair i is (2i, 2i+1) or (i, i + r/2), turned
  by position * 10000^(-2i/r); with rotary_fraction 0.5 the rest untouched."""
  b, n, h, d = 1, 5, 2, 8
  x = RNG.normal(size=(b, n, h, d)).astype(np.float32)
  positions = np.array([0, 3, 7, 100, 2000])
  got = np.asarray(rotary.apply_rotary(jnp.asarray(x), positions, rotary_layout=layout,
                                       rotary_fraction=0.5))
  want = x.astype(np.float64).copy()
  r = 4
  for t, pos in enumerate(positions):
    for i in range(r // 2):
      a, c = (2 * i, 2 * i + 1) if layout == 'interleaved' else (i, i + r // 2)
      angle = pos * 10000.0 ** (-2 * i / r)
      x0, x1 = x[0, t, :, a].astype(np.float64), x[0, t, :, c].astype(np.float64)
      want[0, t, :, a] = x0 * np.cos(angle) - x1 * np.sin(angle)
      want[0, t, :, c] = x0 * np.sin(angle) + x1 * np.cos(angle)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('key,value,says', [
    ('norm', 'batchnorm', "model.norm='batchnorm' is not valid; valid: layernorm, rmsnorm"),
    ('norm_eps', 0.0, 'model.norm_eps=0.0 must be > 0'),
    ('activation', 'swish', 'valid: relu, gelu, gelu_exact, swiglu, geglu'),
    ('embed_scale', -1.0, 'model.embed_scale=-1.0 must be >= 0'),
])
def test_bad_options_are_config_errors(key, value, says):
  c = config_lib.base_config()
  c.model[key] = value
  with pytest.raises(config_lib.ConfigError, match=re.escape(says)):
    models.validate(c.model)


def test_a_bad_rotary_layout_is_a_config_error():
  c = config_lib.base_config()
  c.model.attention = 'rotary'
  c.model.attention_kwargs.rotary_layout = 'split'
  with pytest.raises(config_lib.ConfigError, match="rotary_layout='split'; valid: interleaved, "
                                                  'halves'):
    models.validate(c.model)
