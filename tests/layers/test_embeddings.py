"""Positions and token embeddings against closed forms and numpy."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.layers import AddPositions, Embed, sinusoidal_positions


def _closed_form(length, features, offset=0):
  """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same), p = offset + row."""
  pe = np.zeros((length, features))
  for row in range(length):
    p = offset + row
    for i in range(features // 2):
      angle = p / 10000 ** (2 * i / features)
      pe[row, 2 * i] = math.sin(angle)
      pe[row, 2 * i + 1] = math.cos(angle)
  return pe


@pytest.mark.parametrize('length,features', [(1, 2), (7, 4), (12, 10)])
@pytest.mark.parametrize('offset', [0, 3])
def test_sinusoidal_matches_closed_form(length, features, offset):
  got = jax.jit(lambda o: sinusoidal_positions(length, features, offset=o))(offset)
  assert got.shape == (length, features)
  np.testing.assert_allclose(np.asarray(got), _closed_form(length, features, offset),
                             atol=1e-5)


def test_sinusoidal_python_offset():
  got = sinusoidal_positions(4, 6, offset=5)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _closed_form(4, 6, 5), atol=1e-5)


@pytest.mark.parametrize('offset', [1, 4])
def test_sinusoidal_offset_shifts_rows(offset):
  shifted = sinusoidal_positions(5, 8, offset=offset)
  longer = sinusoidal_positions(5 + offset, 8)
  np.testing.assert_allclose(np.asarray(shifted), np.asarray(longer[offset:]), atol=1e-5)


@pytest.mark.parametrize('features', [1, 7])
def test_sinusoidal_odd_features_raises(features):
  with pytest.raises(ValueError, match=str(features)):
    sinusoidal_positions(4, features)


def _x(n=6, f=8, b=2, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, n, f)).astype(np.float32))


def test_add_sinusoidal_positions():
  x = _x()
  layer = AddPositions('sinusoidal', max_len=16)
  variables = layer.init(jax.random.PRNGKey(0), x)
  assert not variables.get('params')  # fixed table, nothing learned
  got = layer.apply(variables, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) + _closed_form(6, 8)[None],
                             atol=1e-5)


def test_add_learned_positions():
  x = _x()
  layer = AddPositions('learned', max_len=16)
  variables = layer.init(jax.random.PRNGKey(0), x)
  table = np.asarray(variables['params']['pos_embedding'])
  assert table.shape == (16, 8)
  got = layer.apply(variables, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) + table[None, :6], atol=1e-6)


def test_add_no_positions_is_identity():
  x = _x()
  layer = AddPositions('none')
  got = layer.apply(layer.init(jax.random.PRNGKey(0), x), x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_add_positions_bad_kind_raises():
  with pytest.raises(ValueError, match='rotary'):
    AddPositions('rotary').init(jax.random.PRNGKey(0), _x())


@pytest.mark.parametrize('kind', ['sinusoidal', 'learned'])
@pytest.mark.parametrize('prefill', [1, 3])
def test_add_positions_decode_step_t_gets_position_t(kind, prefill):
  n = 6
  x = _x(n=n, seed=1)
  full = AddPositions(kind, max_len=16)
  params = full.init(jax.random.PRNGKey(0), x).get('params', {})
  want = np.asarray(full.apply({'params': params}, x))
  step = AddPositions(kind, max_len=16, decode=True)
  cache = step.init(jax.random.PRNGKey(0), x)['cache']
  got, mutated = step.apply({'params': params, 'cache': cache}, x[:, :prefill],
                            mutable=['cache'])
  cache = mutated['cache']
  np.testing.assert_allclose(np.asarray(got), want[:, :prefill], atol=1e-6)
  for t in range(prefill, n):
    got, mutated = step.apply({'params': params, 'cache': cache}, x[:, t:t + 1],
                              mutable=['cache'])
    cache = mutated['cache']
    np.testing.assert_allclose(np.asarray(got[:, 0]), want[:, t], atol=1e-6,
                               err_msg=f'step {t}')


def test_embed_lookup_is_scaled_table_rows():
  vocab, f = 11, 6
  ids = jnp.asarray([[0, 3, 10, 3], [7, 1, 2, 9]])
  layer = Embed(vocab, f)
  variables = layer.init(jax.random.PRNGKey(0), ids)
  table = np.asarray(variables['params']['embedding'])
  assert table.shape == (vocab, f)
  got = np.asarray(layer.apply(variables, ids))
  for b in range(2):
    for i in range(4):
      np.testing.assert_allclose(got[b, i], table[int(ids[b, i])] * math.sqrt(f), atol=1e-6)


def test_embed_attend_is_matmul_with_table_transpose():
  vocab, f = 11, 6
  layer = Embed(vocab, f)
  variables = layer.init(jax.random.PRNGKey(1), jnp.zeros((1, 1), jnp.int32))
  table = np.asarray(variables['params']['embedding'], np.float64)
  x = np.random.default_rng(2).normal(size=(2, 3, f)).astype(np.float32)
  got = np.asarray(layer.apply(variables, jnp.asarray(x), method='attend'))
  assert got.shape == (2, 3, vocab)
  want = np.zeros((2, 3, vocab))
  for b in range(2):
    for i in range(3):
      for v in range(vocab):
        want[b, i, v] = sum(float(x[b, i, c]) * table[v, c] for c in range(f))
  np.testing.assert_allclose(got, want, atol=1e-5)
