"""MultiHeadAttention against flax.linen.MultiHeadDotProductAttention, and its cache.

Our parameters have flax's names and shapes ('query', 'key', 'value' kernels
[f, h, d], 'out' [h, d, f]), so flax's variables are loaded as they are; the
tests check that the tree structures agree before comparing outputs.
"""
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import masks, registry
from flaxformer_lite.layers import MultiHeadAttention

B, N, M, F, H = 2, 5, 4, 6, 2


def _flax_params(seed, *, features=F, qkv_features=8, out_features=5, num_heads=H):
  """Random flax MHA params; biases non-zero so that their mapping is tested."""
  layer = nn.MultiHeadDotProductAttention(num_heads=num_heads, qkv_features=qkv_features,
                                          out_features=out_features)
  shapes = nn.unbox(jax.eval_shape(layer.init, jax.random.PRNGKey(0), jnp.zeros((1, 1, features))))
  leaves, tree = jax.tree_util.tree_flatten(shapes)
  rng = np.random.default_rng(seed)
  leaves = [jnp.asarray(rng.normal(size=l.shape).astype(np.float32) * 0.5) for l in leaves]
  return layer, jax.tree_util.tree_unflatten(tree, leaves)


def _ours(flax_vars, ours_layer, *args):
  """flax's variables, after checking that our layer has the same tree."""
  ours_shapes = nn.unbox(jax.eval_shape(ours_layer.init, jax.random.PRNGKey(0), *args))
  assert (jax.tree.map(lambda x: x.shape, ours_shapes['params'])
          == jax.tree.map(lambda x: x.shape, flax.core.unfreeze(flax_vars['params'])))
  return {'params': flax_vars['params']}


def _ours_self(flax_vars):
  return _ours(flax_vars, MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5),
               jnp.zeros((1, 1, F)))


def _ours_cross(flax_vars):
  return _ours(flax_vars, MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5),
               jnp.zeros((1, 1, F)), jnp.zeros((1, 1, F)))


def _inputs(seed, n=N, features=F):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(B, n, features)).astype(np.float32))


def _padding(lengths, n):
  return jnp.asarray(np.array([[i < l for i in range(n)] for l in lengths]))


def _causal(n):
  return jnp.tril(jnp.ones((n, n), bool))[None, None]


def _self_masks():
  valid = _padding([3, 5], N)
  return {
      'none': None,
      'padding': nn.make_attention_mask(valid, valid),
      'causal': _causal(N),
      'causal+padding': nn.combine_masks(nn.make_attention_mask(valid, valid), _causal(N)),
  }


@pytest.mark.parametrize('mask_name', ['none', 'padding', 'causal', 'causal+padding'])
@pytest.mark.parametrize('seed', [0, 1])
def test_self_attention_matches_flax(mask_name, seed):
  flax_layer, flax_vars = _flax_params(seed)
  ours = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5)
  x = _inputs(seed + 10)
  mask = _self_masks()[mask_name]
  want = flax_layer.apply(flax_vars, x, mask=mask)
  got = ours.apply(_ours_self(flax_vars), x, mask=mask)
  assert got.shape == (B, N, 5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_self_attention_default_features_match_flax():
  flax_layer = nn.MultiHeadDotProductAttention(num_heads=H)
  x = _inputs(3)
  flax_vars = flax_layer.init(jax.random.PRNGKey(1), x)
  want = flax_layer.apply(flax_vars, x, mask=_causal(N))
  ours = MultiHeadAttention(num_heads=H)
  got = ours.apply(_ours(flax_vars, ours, x), x, mask=_causal(N))
  assert got.shape == x.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('masked', [False, True])
@pytest.mark.parametrize('seed', [0, 1])
def test_cross_attention_matches_flax(masked, seed):
  flax_layer, flax_vars = _flax_params(seed)
  ours = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5)
  xq, xkv = _inputs(seed + 20, n=N), _inputs(seed + 30, n=M)
  mask = None
  if masked:
    mask = nn.make_attention_mask(_padding([5, 2], N), _padding([2, 4], M))
  want = flax_layer.apply(flax_vars, xq, xkv, mask=mask)
  got = ours.apply(_ours_cross(flax_vars), xq, xkv, mask=mask)
  assert got.shape == (B, N, 5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_dropout_matches_flax_with_the_documented_keep_mask(loop_keep):
  # flax's layer around flax's weights, dropped by the keep mask that
  # attention/dropout.py documents (computed one weight at a time), with the
  # rng both modules get from make_rng('dropout') at the top level.
  _, flax_vars = _flax_params(4)
  rate, rng = 0.5, jax.random.PRNGKey(7)

  class FirstKey(nn.Module):  # the key a top-level module's first make_rng('dropout') gets
    def __call__(self):
      return self.make_rng('dropout')

  seed = int(jax.random.bits(FirstKey().apply({}, rngs={'dropout': rng}), (), jnp.uint32))

  def attention_fn(query, key, value, mask=None, **_):
    weights = nn.dot_product_attention_weights(query, key, mask=mask)
    b, h, n, m = weights.shape
    keep = jnp.asarray(loop_keep(seed, rate, b, h, n, m))
    return jnp.einsum('bhnm,bmhd->bnhd', jnp.where(keep, weights / (1 - rate), 0), value)

  flax_layer = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=8, out_features=5,
                                               attention_fn=attention_fn)
  ours = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5, dropout_rate=rate)
  x = _inputs(5)
  want = flax_layer.apply(flax_vars, x, mask=_causal(N))
  got = ours.apply(_ours_self(flax_vars), x, mask=_causal(N), deterministic=False,
                   rngs={'dropout': rng})
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_dropout_needs_rng_and_changes_output():
  _, flax_vars = _flax_params(6)
  variables = _ours_self(flax_vars)
  layer = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5, dropout_rate=0.5)
  no_dropout = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5)
  x = _inputs(7)
  with pytest.raises(flax.errors.InvalidRngError, match='dropout'):
    layer.apply(variables, x, deterministic=False)
  clean = no_dropout.apply(variables, x)
  np.testing.assert_allclose(np.asarray(layer.apply(variables, x, deterministic=True)),
                             np.asarray(clean), atol=1e-6)
  a = layer.apply(variables, x, deterministic=False, rngs={'dropout': jax.random.PRNGKey(0)})
  a2 = layer.apply(variables, x, deterministic=False, rngs={'dropout': jax.random.PRNGKey(0)})
  b = layer.apply(variables, x, deterministic=False, rngs={'dropout': jax.random.PRNGKey(1)})
  assert not np.allclose(np.asarray(a), np.asarray(clean), atol=1e-3)
  assert not np.allclose(np.asarray(a), np.asarray(b), atol=1e-3)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))


def test_qkv_features_not_divisible_by_heads_raises():
  layer = MultiHeadAttention(num_heads=3, qkv_features=8)
  with pytest.raises(ValueError, match='divisible'):
    layer.init(jax.random.PRNGKey(0), _inputs(0))


def test_mask_is_keyword_only():
  layer = MultiHeadAttention(num_heads=H)
  x = _inputs(0)
  variables = nn.unbox(layer.init(jax.random.PRNGKey(0), x))
  with pytest.raises(TypeError):
    layer.apply(variables, x, None, _causal(N))


def test_cross_attention_with_decode_raises():
  layer = MultiHeadAttention(num_heads=H, decode=True)
  with pytest.raises(ValueError, match='decode'):
    layer.init(jax.random.PRNGKey(0), _inputs(0), _inputs(1, n=M))


# ---- decoding cache ------------------------------------------------------------

L = N  # the same shapes as the tests above, so their compiled ops are reused


def _decode_setup(seed):
  x = _inputs(seed, n=L)
  full_layer = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5)
  params = nn.unbox(full_layer.init(jax.random.PRNGKey(seed), x))['params']
  want = full_layer.apply({'params': params}, x, mask=_causal(L))
  decoder = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5, decode=True)
  cache = decoder.init(jax.random.PRNGKey(seed + 1), x)['cache']
  return x, params, want, decoder, cache


def test_init_creates_cache():
  x, _, _, _, cache = _decode_setup(0)
  assert cache['cached_key'].shape == (B, L, H, 4)
  assert cache['cached_value'].shape == (B, L, H, 4)
  assert int(cache['cache_index']) == 0


@pytest.mark.parametrize('seed', [0, 1])
def test_decode_one_token_at_a_time_matches_causal_forward(seed):
  x, params, want, decoder, cache = _decode_setup(seed)
  for t in range(L):
    got, mutated = decoder.apply({'params': params, 'cache': cache}, x[:, t:t + 1],
                                 mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, t]),
                               atol=1e-5, rtol=1e-5, err_msg=f'position {t}')
  assert int(cache['cache_index']) == L


@pytest.mark.parametrize('seed', [0, 1])
def test_decode_prefill_then_steps_matches_causal_forward(seed):
  x, params, want, decoder, cache = _decode_setup(seed)
  got, mutated = decoder.apply({'params': params, 'cache': cache}, x[:, :3],
                               mutable=['cache'])
  cache = mutated['cache']
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, :3]), atol=1e-5, rtol=1e-5)
  for t in range(3, L):
    got, mutated = decoder.apply({'params': params, 'cache': cache}, x[:, t:t + 1],
                                 mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, t]),
                               atol=1e-5, rtol=1e-5, err_msg=f'position {t}')


def test_decode_chunks_after_prefill_match_causal_forward():
  # After the prefill, a call may also pass several tokens at once.
  x, params, want, decoder, cache = _decode_setup(2)
  for start, size in [(0, 2), (2, 2), (4, 1)]:
    got, mutated = decoder.apply({'params': params, 'cache': cache}, x[:, start:start + size],
                                 mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, start:start + size]),
                               atol=1e-5, rtol=1e-5, err_msg=f'positions {start}+{size}')


@pytest.mark.parametrize('implementation', ['dense', 'chunked'])
def test_decode_with_a_mask_function_keeps_its_rule_over_the_keys_written(implementation):
  """A masks.Mask reads absolute query indices and is the whole rule: a
  prefill, then one token at a time, give the full pass under the mask with
  the keys not yet written hidden, so a prefill's queries see its later keys
  where the mask lets them (a prompt read both ways), never an empty slot."""
  x, params, _, _, _ = _decode_setup(3)
  mask = masks.Mask(lambda b, h, q, k: (k % 2 == 0) | (q - k < 2), 'even_or_near')
  kwargs = {'kernel': implementation, 'chunk_size': 2}
  full = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5,
                            attention_kwargs=kwargs)
  decoder = MultiHeadAttention(num_heads=H, qkv_features=8, out_features=5, decode=True,
                               attention_kwargs=kwargs)
  cache = decoder.init(jax.random.PRNGKey(0), x)['cache']
  q, k = np.arange(L)[:, None], np.arange(L)[None, :]
  for start, size in [(0, 3)] + [(t, 1) for t in range(3, L)]:
    allowed = ((k % 2 == 0) | (q - k < 2)) & (k < start + size)  # the rule, by hand
    want = full.apply({'params': params}, x, mask=jnp.asarray(allowed)[None, None])
    got, mutated = decoder.apply({'params': params, 'cache': cache}, x[:, start:start + size],
                                 mask=mask, mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, start:start + size]),
                               atol=1e-5, rtol=1e-5, err_msg=f'positions {start}+{size}')


@pytest.mark.parametrize('attention', registry.names())
def test_every_variant_computes_in_bfloat16_close_to_float32(attention):
  """bf16 compute (float32 params) stays within bf16 rounding of float32."""
  x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 6, 8)).astype(np.float32))
  mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
  f32 = MultiHeadAttention(num_heads=2, attention=attention)
  bf16 = MultiHeadAttention(num_heads=2, attention=attention, dtype=jnp.bfloat16)
  params = nn.unbox(f32.init(jax.random.PRNGKey(0), x))
  want = f32.apply(params, x, mask=mask)
  got = bf16.apply(params, x, mask=mask)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05, rtol=0.05)
