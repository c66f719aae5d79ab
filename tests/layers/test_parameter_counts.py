"""Parameter counts against the 2017 paper's formulas (Vaswani et al., "Attention
Is All You Need", sections 3.2-3.4 and Table 3).

The formulas are written from the paper, d = d_model, h heads of
d_k = d_v = d / h:
  attention: W^Q, W^K, W^V, W^O, each d x d in all heads together -> 4d^2
             weights, and a bias per projection -> 4d;
  FFN:       W_1 [d, d_ff], W_2 [d_ff, d] -> 2 d d_ff weights, d_ff + d biases;
  LayerNorm: a gain and a bias, 2d;
  encoder layer: self-attention + FFN + 2 LayerNorms (12d^2 weights at d_ff = 4d);
  decoder layer: self- + cross-attention + FFN + 3 LayerNorms (16d^2 at d_ff = 4d);
  embeddings: one [V, d] matrix shared by both embedding layers and the
             pre-softmax projection (section 3.4); sinusoidal positions have none.
Two things the paper leaves open are counted as this code's design says: pre-LN
stacks (the default) end with one more LayerNorm each, and learned positions
are one [max_len, d] table per stack.

Shapes come from `jax.eval_shape` of `init`: nothing is compiled.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import models
from flaxformer_lite.layers import (DecoderLayer, EncoderLayer, MlpBlock, MultiHeadAttention,
                                    TransformerConfig)


def attention_count(d):
  return {'weights': 4 * d * d, 'other': 4 * d}


def ffn_count(d, d_ff):
  return {'weights': 2 * d * d_ff, 'other': d_ff + d}


def layer_norm_count(d):
  return {'weights': 0, 'other': 2 * d}


def total(*counts):
  return {k: sum(c[k] for c in counts) for k in ('weights', 'other')}


def encoder_layer_count(d, d_ff):
  return total(attention_count(d), ffn_count(d, d_ff), layer_norm_count(d), layer_norm_count(d))


def decoder_layer_count(d, d_ff):
  return total(attention_count(d), attention_count(d), ffn_count(d, d_ff),
               *[layer_norm_count(d)] * 3)


def counted(params):
  """Parameter tree -> {'weights': elements of matrices (kernels, embedding
  tables), 'other': biases and LayerNorm gains}. By leaf name, not by rank: a
  per-head projection's bias is [h, d]."""
  out = {'weights': 0, 'other': 0}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    name = path[-1].key
    assert name in ('kernel', 'embedding', 'pos_embedding', 'bias', 'scale'), path
    out['other' if name in ('bias', 'scale') else 'weights'] += x.size
  return out


def init_shapes(module, *args, **kwargs):
  return nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *args, **kwargs))['params']


@pytest.mark.parametrize('d,heads', [(16, 1), (64, 8), (96, 4)])
def test_attention_layer_has_4d2_weights_and_4d_biases(d, heads):
  x = jnp.zeros((1, 3, d))
  assert counted(init_shapes(MultiHeadAttention(num_heads=heads), x)) == attention_count(d)
  # Cross-attention: keys/values from another sequence, same projections.
  y = jnp.zeros((1, 5, d))
  assert counted(init_shapes(MultiHeadAttention(num_heads=heads), x, y)) == attention_count(d)
  no_bias = MultiHeadAttention(num_heads=heads, use_bias=False)
  assert counted(init_shapes(no_bias, x)) == {'weights': 4 * d * d, 'other': 0}


@pytest.mark.parametrize('d,heads,kv_heads', [(16, 4, 1), (64, 8, 2), (96, 4, 2)])
def test_grouped_query_attention_has_2d2_plus_2d2g_over_h_weights(d, heads, kv_heads):
  # W^Q and W^O stay d x d; W^K and W^V project onto g heads of d/h: d x (d g / h) each.
  x = jnp.zeros((1, 3, d))
  layer = MultiHeadAttention(num_heads=heads, num_kv_heads=kv_heads)
  kv = d * kv_heads // heads
  assert counted(init_shapes(layer, x)) == {'weights': 2 * d * d + 2 * d * kv,
                                           'other': 2 * d + 2 * kv}


@pytest.mark.parametrize('d,d_ff', [(16, 64), (32, 48)])
def test_ffn_has_2_d_dff_weights(d, d_ff):
  assert counted(init_shapes(MlpBlock(d_ff), jnp.zeros((1, 3, d)))) == ffn_count(d, d_ff)


def _cfg(d, d_ff, pre_ln=True, **kw):
  return TransformerConfig(vocab_size=11, d_model=d, num_heads=4, mlp_dim=d_ff, pre_ln=pre_ln,
                           **kw)


@pytest.mark.parametrize('pre_ln', [True, False])
def test_encoder_and_decoder_layers_12d2_and_16d2(pre_ln):
  d = 32
  x, encoded = jnp.zeros((1, 3, d)), jnp.zeros((1, 5, d))
  encoder = counted(init_shapes(EncoderLayer(_cfg(d, 4 * d, pre_ln)), x, mask=None))
  decoder = counted(init_shapes(DecoderLayer(_cfg(d, 4 * d, pre_ln)), x, encoded,
                                self_mask=None))
  assert encoder == {'weights': 12 * d * d, 'other': 13 * d}  # 4d + (4d + d) + 2 * 2d
  assert decoder == {'weights': 16 * d * d, 'other': 19 * d}  # 8d + (4d + d) + 3 * 2d
  assert encoder == encoder_layer_count(d, 4 * d) and decoder == decoder_layer_count(d, 4 * d)
  # Any d_ff. A decoder layer without an encoder (decoder-only LM) drops the
  # cross-attention and its LayerNorm: an encoder layer's count.
  d_ff = 40
  assert counted(init_shapes(EncoderLayer(_cfg(d, d_ff, pre_ln)), x, mask=None)) == \
      encoder_layer_count(d, d_ff)
  assert counted(init_shapes(DecoderLayer(_cfg(d, d_ff, pre_ln)), x, self_mask=None)) == \
      encoder_layer_count(d, d_ff)


def _model_config(vocab, d, heads, d_ff, enc_layers, dec_layers, pre_ln, positions, max_len):
  m = config_lib.base_config().model
  m.update(type='encoder_decoder', vocab_size=vocab, d_model=d, num_heads=heads, mlp_dim=d_ff,
           num_encoder_layers=enc_layers, num_decoder_layers=dec_layers, pre_ln=pre_ln,
           positions=positions, max_len=max_len, attention='dot_product')
  return m


def encoder_decoder_count(vocab, d, d_ff, enc_layers, dec_layers, pre_ln, positions, max_len):
  """The paper's model (shared [V, d] embedding) plus this code's two choices."""
  c = total(*[encoder_layer_count(d, d_ff)] * enc_layers,
            *[decoder_layer_count(d, d_ff)] * dec_layers)
  weights = c['weights'] + vocab * d + (2 * max_len * d if positions == 'learned' else 0)
  other = c['other'] + (2 * 2 * d if pre_ln else 0)  # one final LayerNorm per stack
  return weights + other


@pytest.mark.parametrize('pre_ln,positions', [(True, 'sinusoidal'), (False, 'learned')])
def test_encoder_decoder_total(pre_ln, positions):
  args = dict(vocab=37, d=16, d_ff=64, enc_layers=2, dec_layers=3, pre_ln=pre_ln,
              positions=positions, max_len=24)
  model = models.build(_model_config(heads=4, **args))
  ids = jnp.ones((1, 5), jnp.int32)
  params = init_shapes(model, ids, ids)
  assert sum(x.size for x in jax.tree.leaves(params)) == encoder_decoder_count(**args)
  # One [V, d] embedding serves the encoder, the decoder and the softmax.
  assert [x.shape for x in jax.tree.leaves(params) if args['vocab'] in x.shape] == [(37, 16)]


def test_2017_base_model_is_about_65m():
  """Table 3, base: N=6, d=512, d_ff=2048, h=8, a shared 37000-token vocabulary
  (section 5.1), post-LN, sinusoidal positions; the paper reports 65M.

  This code shares the embedding three ways as the paper does (section 3.4),
  so the paper's formula applies unchanged: 6 (12d^2 + 13d) + 6 (16d^2 + 19d)
  + 37000 d = 63,082,496. The paper's rounded 65M is ~3% above its own
  formula (it does not give the count; ~3,700 more vocabulary rows would close
  the gap); an untied softmax would give 82M, a missing cross-attention 57M.
  """
  args = dict(vocab=37000, d=512, d_ff=2048, enc_layers=6, dec_layers=6, pre_ln=False,
              positions='sinusoidal', max_len=256)
  want = encoder_decoder_count(**args)
  assert want == 63_082_496
  ids = jnp.ones((1, 4), jnp.int32)
  params = init_shapes(models.build(_model_config(heads=8, **args)), ids, ids)
  got = sum(x.size for x in jax.tree.leaves(params))
  assert got == want
  assert abs(got - 65e6) / 65e6 < 0.035
