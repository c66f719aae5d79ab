"""TwoStreamEncoder: what reaches stream a from stream b, an explicit
concatenation reference, and padding masks."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.layers import TwoStreamEncoder, EncoderLayer, TransformerConfig

BATCH, N_A, N_B, D = 2, 3, 4, 8


def _cfg(num_layers):
  return TransformerConfig(vocab_size=1, d_model=D, num_heads=2, mlp_dim=16,
                           num_encoder_layers=num_layers, dropout_rate=0.0)


def _x(seed, n):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(BATCH, n, D)).astype(np.float32))


@functools.lru_cache
def _model(num_layers, num_bottleneck, fusion_layer, fusion='bottleneck'):
  """(module, random params); cached: tests share models. Random, not
  initialised: no init to compile, and a bottleneck table (initialised near
  0) whose effect is well above rounding in the gradient checks."""
  module = TwoStreamEncoder(_cfg(num_layers), fusion=fusion, num_bottleneck=num_bottleneck,
                            fusion_layer=fusion_layer)
  shapes = jax.eval_shape(module.init, jax.random.key(0), _x(0, N_A), _x(1, N_B))['params']
  rng = np.random.default_rng(num_layers)
  return module, jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0, 0.5, s.shape).astype(np.float32)), shapes)


def _gradients(module, params, x_a, x_b):
  """Gradients w.r.t. x_b of <r_a, out_a> and <r_z, z> for fixed random r_a,
  r_z: exactly zero where d out / d x_b is, almost surely not otherwise."""
  rng = np.random.default_rng(5)
  r_a = rng.normal(size=x_a.shape).astype(np.float32)
  r_z = rng.normal(size=(BATCH, module.num_bottleneck, D)).astype(np.float32)

  def projected(x_b):
    y_a, _, z = module.apply({'params': params}, x_a, x_b)
    return jnp.sum(y_a * r_a), (0.0 if z is None else jnp.sum(z * r_z))
  return [np.asarray(g) for g in jax.jit(jax.jacrev(projected))(x_b)]


@pytest.mark.parametrize('num_layers,num_bottleneck,fusion_layer,a_sees_b,z_sees_b', [
    (2, 0, 0, False, False),  # no bottleneck tokens
    (2, 3, 2, False, False),  # fusion_layer = num_layers: no exchange, z stays the table
    (1, 3, 0, False, True),  # the only exchange comes after a's last update
    (2, 3, 1, False, True),  # late fusion in the last layer only: the same
    (2, 3, 0, True, True),  # layer 1 of a reads z^1, made by b's layer 0
])
def test_stream_a_sees_b_from_the_layer_after_the_first_exchange(
    num_layers, num_bottleneck, fusion_layer, a_sees_b, z_sees_b):
  """Layer l of stream a reads z^l, which depends on x_b only when an earlier
  layer fused. Independence is exact: a zero gradient, not a small one."""
  module, params = _model(num_layers, num_bottleneck, fusion_layer)
  d_a, d_z = _gradients(module, params, _x(2, N_A), _x(3, N_B))
  for grad, sees in ((d_a, a_sees_b), (d_z, z_sees_b)):
    if sees:
      assert np.abs(grad).max() > 1e-3
    else:
      assert np.all(grad == 0.0)


def test_cutting_the_bottleneck_that_stream_a_reads_cuts_stream_b_off():
  """Stop gradients at the B bottleneck rows of every input of stream a's
  fused layers: d out_a / d x_b becomes exactly zero, so there is no other
  path (no attention to b's tokens, no mixing of stream tokens in the mean)."""
  module, params = _model(2, 3, 0)
  x_a, x_b = _x(2, N_A), _x(3, N_B)

  def cut(next_fun, args, kwargs, context):
    t = args[0] if args else None
    if (isinstance(context.module, EncoderLayer) and context.module.name.startswith('a_')
        and t is not None and t.shape[1] == N_A + module.num_bottleneck):
      t = jnp.concatenate([jax.lax.stop_gradient(t[:, :module.num_bottleneck]),
                           t[:, module.num_bottleneck:]], axis=1)
      args = (t, *args[1:])
    return next_fun(*args, **kwargs)

  d_intact, _ = _gradients(module, params, x_a, x_b)
  with nn.intercept_methods(cut):
    d_cut, d_z = _gradients(module, params, x_a, x_b)
  assert np.abs(d_intact).max() > 1e-3 and np.abs(d_z).max() > 1e-3
  assert np.all(d_cut == 0.0)


@functools.partial(jax.jit, static_argnums=0)
def _encoder_layer(cfg, params, x, valid):
  mask = nn.make_attention_mask(valid, valid, dtype=bool)
  return EncoderLayer(cfg).apply({'params': params}, x, mask=mask)


def _layer(params, x, valid):
  """One EncoderLayer on its own; numpy in, numpy out."""
  return np.asarray(_encoder_layer(_cfg(1), params, x, valid))


@pytest.mark.parametrize('num_layers,fusion_layer', [(1, 0), (3, 1)])
def test_matches_explicit_concatenation_reference(num_layers, fusion_layer):
  """Each layer applied by hand: alone before fusion_layer; from it on over
  np.concatenate([z, x_i]), then z = (z_a + z_b) / 2."""
  module, params = _model(num_layers, 3, fusion_layer)
  x_a, x_b = _x(2, N_A), _x(3, N_B)
  valid_a = jnp.asarray([[True] * N_A, [True, True, False]])
  valid_b = jnp.asarray([[True, True, True, False], [True] * N_B])
  y_a, y_b, z = jax.jit(module.apply)({'params': params}, x_a, x_b, valid_a=valid_a,
                                      valid_b=valid_b)

  a, b = np.asarray(x_a), np.asarray(x_b)
  zz = np.broadcast_to(np.asarray(params['bottleneck']), (BATCH, 3, D))
  ones = np.ones((BATCH, 3), bool)
  for i in range(num_layers):
    pa, pb = params[f'a_layer_{i}'], params[f'b_layer_{i}']
    if i < fusion_layer:
      a, b = _layer(pa, a, valid_a), _layer(pb, b, valid_b)
    else:
      ya = _layer(pa, np.concatenate([zz, a], 1), np.concatenate([ones, valid_a], 1))
      yb = _layer(pb, np.concatenate([zz, b], 1), np.concatenate([ones, valid_b], 1))
      a, b, zz = ya[:, 3:], yb[:, 3:], (ya[:, :3] + yb[:, :3]) / 2
  norm = nn.LayerNorm()
  np.testing.assert_allclose(np.asarray(z), zz, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y_a),
                             norm.apply({'params': params['a_final_norm']}, a), atol=1e-5)
  np.testing.assert_allclose(np.asarray(y_b),
                             norm.apply({'params': params['b_final_norm']}, b), atol=1e-5)


def test_padding_in_stream_b_changes_nothing():
  """Garbage at b's padded positions leaves every real output as it was, and
  equals running without those positions at all."""
  module, params = _model(2, 3, 0)
  x_a, x_b = _x(2, N_A), _x(3, N_B)
  valid_b = jnp.asarray([[True, True, False, False], [True, True, False, False]])
  garbage = x_b.at[:, 2:].set(_x(4, 2) * 100)
  run = jax.jit(lambda xb, vb: module.apply({'params': params}, x_a, xb, valid_b=vb))
  y_a, y_b, z = run(x_b, valid_b)
  g_a, g_b, g_z = run(garbage, valid_b)
  np.testing.assert_array_equal(np.asarray(g_a), np.asarray(y_a))
  np.testing.assert_array_equal(np.asarray(g_z), np.asarray(z))
  np.testing.assert_array_equal(np.asarray(g_b[:, :2]), np.asarray(y_b[:, :2]))

  s_a, s_b, s_z = run(x_b[:, :2], None)
  np.testing.assert_allclose(np.asarray(s_a), np.asarray(y_a), atol=1e-5)
  np.testing.assert_allclose(np.asarray(s_z), np.asarray(z), atol=1e-5)
  np.testing.assert_allclose(np.asarray(s_b), np.asarray(y_b[:, :2]), atol=1e-5)


def test_bad_fusion_layer_is_an_error_naming_the_range():
  module = TwoStreamEncoder(_cfg(2), num_bottleneck=2, fusion_layer=3)
  with pytest.raises(ValueError, match=r'fusion_layer=3 must be in \[0, 2\]'):
    module.init(jax.random.key(0), _x(0, N_A), _x(1, N_B))


@pytest.mark.parametrize('fusion,num_layers,fusion_layer,a_sees_b', [
    ('early', 2, 0, True),
    ('late', 3, 2, True),  # the last layer only
    ('late', 2, 2, False),  # fusion_layer = num_layers: the streams never meet
])
def test_joint_fusion_reaches_stream_a_only_from_fusion_layer_on(
    fusion, num_layers, fusion_layer, a_sees_b):
  """Joint layers attend across the streams: d y_a / d x_b is nonzero with a
  joint layer, exactly zero without one."""
  module, params = _model(num_layers, 0, fusion_layer, fusion)
  d_a, _ = _gradients(module, params, _x(2, N_A), _x(3, N_B))
  if a_sees_b:
    assert np.abs(d_a).max() > 1e-3
  else:
    assert np.all(d_a == 0.0)
  assert not any(k.startswith('joint_layer_') and int(k.rsplit('_', 1)[1]) < fusion_layer
                 for k in params)


@pytest.mark.parametrize('fusion,num_layers,fusion_layer', [('early', 2, 0), ('late', 3, 1)])
def test_joint_fusion_matches_explicit_concatenation_reference(fusion, num_layers, fusion_layer):
  """Each layer applied by hand: a and b alone before fusion_layer, then one
  layer over np.concatenate([a, b]) (padding of either stream masked)."""
  module, params = _model(num_layers, 0, fusion_layer, fusion)
  x_a, x_b = _x(2, N_A), _x(3, N_B)
  valid_a = jnp.asarray([[True] * N_A, [True, True, False]])
  valid_b = jnp.asarray([[True, True, True, False], [True] * N_B])
  y_a, y_b, z = jax.jit(module.apply)({'params': params}, x_a, x_b, valid_a=valid_a,
                                      valid_b=valid_b)
  assert z is None
  a, b = np.asarray(x_a), np.asarray(x_b)
  for i in range(num_layers):
    if i < fusion_layer:
      a = _layer(params[f'a_layer_{i}'], a, valid_a)
      b = _layer(params[f'b_layer_{i}'], b, valid_b)
    else:
      ab = _layer(params[f'joint_layer_{i}'], np.concatenate([a, b], 1),
                  np.concatenate([valid_a, valid_b], 1))
      a, b = ab[:, :N_A], ab[:, N_A:]
  norm = nn.LayerNorm()
  np.testing.assert_allclose(np.asarray(y_a),
                             norm.apply({'params': params['a_final_norm']}, a), atol=1e-5)
  real_b = np.asarray(valid_b)[..., None]
  np.testing.assert_allclose(np.asarray(y_b) * real_b,
                             norm.apply({'params': params['b_final_norm']}, b) * real_b,
                             atol=1e-5)
