"""Grouped-query and multi-query attention (num_kv_heads), for every variant.

The reference is the plain multi-head layer with each key/value head's
projection copied to every query head of its group: query head i reads
key/value head i // (h / g) (Ainslie et al. 2023, as in Llama). The copy is
written here as that index list, not with the layer's repeat.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import models
from flaxformer_lite.attention import masks, registry
from flaxformer_lite.layers import MultiHeadAttention

B, N, F, H = 2, 12, 16, 4


def _draw(shapes, seed=0):
  """Random values of these shapes; biases non-zero, so that their copy is tested."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)


def _to_multi_head(params, h):
  """g-head 'key'/'value' [f, g, d] (bias [g, d]) -> h heads, head i a copy of i // (h / g)."""
  out = dict(params)
  for name in ('key', 'value'):
    g = params[name]['kernel'].shape[1]
    index = np.asarray([i // (h // g) for i in range(h)])
    out[name] = {'kernel': params[name]['kernel'][:, index], 'bias': params[name]['bias'][index]}
  return out


# Every variant once, g = 1 (multi-query) and g = 2 taking turns; on the chunked
# kernel where the variant has one, against the dense multi-head reference.
CASES = [(name, 1 + i % 2, 'chunked' if registry.get(name).chunked else 'dense')
         for i, name in enumerate(registry.names())]


@pytest.mark.parametrize('name,g,implementation', CASES,
                         ids=[f'{n}-g{g}-{i}' for n, g, i in CASES])
def test_every_variant_with_g_kv_heads_equals_h_heads_with_copied_projections(
    name, g, implementation, small_options):
  x = jnp.asarray(np.random.default_rng(1).normal(size=(B, N, F)), jnp.float32)
  # Causal, and example 1's last 3 keys padding: each kernel's mask handling is in play.
  mask = masks.causal() & masks.key_padding(jnp.arange(N)[None] < jnp.asarray([[N], [N - 3]]))
  grouped = MultiHeadAttention(num_heads=H, num_kv_heads=g, attention=name,
                               attention_kwargs=small_options(name, kernel=implementation,
                                                              chunk_size=5))
  reference = MultiHeadAttention(num_heads=H, attention=name,
                                 attention_kwargs=small_options(name, kernel='dense'))
  params = _draw(nn.unbox(jax.eval_shape(grouped.init, jax.random.key(0), x, mask=mask))['params'])
  assert params['key']['kernel'].shape == (F, g, F // H)
  got = jax.jit(grouped.apply)({'params': params}, x, mask=mask)
  want = jax.jit(reference.apply)({'params': _to_multi_head(params, H)}, x, mask=mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('attention,g', [('dot_product', 1), ('shaw', 2), ('rotary', 2)])
def test_the_cache_holds_g_heads_and_decoding_equals_the_full_pass(attention, g, small_options):
  cfg = dict(type='decoder_only', vocab_size=11, d_model=F, num_heads=H, num_kv_heads=g,
             num_encoder_layers=0, num_decoder_layers=2, mlp_dim=32, dropout_rate=0.0,
             attention_dropout_rate=0.0, attention=attention,
             attention_kwargs=small_options(attention), positions='none', max_len=N, pre_ln=True,
             activation='relu', dtype='float32')
  model, decoder = models.build(cfg), models.build(cfg, decode=True)
  ids = jnp.asarray(np.random.default_rng(2).integers(1, 11, size=(B, N)), jnp.int32)
  params = _draw(nn.unbox(jax.eval_shape(model.init, jax.random.key(0), ids))['params'])
  want = np.asarray(model.apply({'params': params}, ids))
  cache = jax.eval_shape(decoder.init, jax.random.key(0), ids)['cache']
  shapes = {jax.tree_util.keystr(p): s.shape for p, s in jax.tree_util.tree_leaves_with_path(cache)
            if 'cached_' in jax.tree_util.keystr(p)}
  assert len(shapes) == 4 and set(shapes.values()) == {(B, N, g, F // H)}, shapes
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
  start = 0
  for size in (1, 4, 1, 6):
    logits, mutated = decoder.apply({'params': params, 'cache': cache}, ids[:, start:start + size],
                                    mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(logits), want[:, start:start + size], rtol=2e-4,
                               atol=2e-4, err_msg=f'positions {start}+{size}')
    start += size


def test_num_kv_heads_that_does_not_divide_the_heads_is_named():
  layer = MultiHeadAttention(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match=r'num_kv_heads=3 .* num_heads=4; valid: \[1, 2, 4\]'):
    layer.init(jax.random.key(0), jnp.zeros((1, 2, 8)))
