"""Shaw et al. 2018 relative attention against loop formulas, on the dense
kernel (the paper's reshape-and-matmul trick), on shaw_banded (no
[n, m, d] table) and on the fused Pallas kernel (interpreted: a per-query
lookup and a value lookup), each reached through attend(kernel=...)."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import main
from flaxformer_lite import models
from flaxformer_lite.attention import entry, masks, registry
from flaxformer_lite.attention.kernels import pallas_gpu
from flaxformer_lite.attention.kernels.specialised import relative_banded
from flaxformer_lite.attention.schemes import shaw
from flaxformer_lite.layers import MultiHeadAttention

def _on(kernel):
  """shaw_attention's signature, run by attend on `kernel`."""
  def run(q, kk, v, tk, tv, *, mask=None, bias=None, q_offset=0, dropout_rate=0.0,
          dropout_rng=None, deterministic=True, dtype=None):
    k = ((tk if tk is not None else tv).shape[0] - 1) // 2
    params = {n: t for n, t in (('rel_key_table', tk), ('rel_value_table', tv)) if t is not None}
    options = {'max_distance': k, 'relative_keys': tk is not None,
               'relative_values': tv is not None}
    return entry.attend(q, kk, v, scheme='shaw', kernel=kernel, mask=mask, bias=bias,
                        q_offset=q_offset, options=options, params=params,
                        dropout_rate=0.0 if deterministic else dropout_rate,
                        dropout_rng=None if deterministic else dropout_rng, dtype=dtype)
  return run


FORMS = {'dense': _on('dense'), 'shaw_banded': _on('shaw_banded'), 'pallas': _on('pallas')}
LOOPED = ('dense', 'shaw_banded')  # the fused kernel has a test of its own


def _rel_index(i, j, k, q_offset):
  return min(max(j - (i + q_offset), -k), k) + k


def _reference(q, kk, v, tk, tv, k, q_offset=0, mask=None, bias=None):
  """Eq. 3-5 with python loops: e_ij = (q_i.k_j + q_i.a^K_ij)/sqrt(d) + bias,
  softmax over unmasked j (uniform over all j if none), z_i = sum_j a_ij (v_j + a^V_ij)."""
  b, n, h, d = q.shape
  m = kk.shape[1]
  out = np.zeros((b, n, h, d))
  for bb in range(b):
    for hh in range(h):
      for i in range(n):
        logits, allowed = [], []
        for j in range(m):
          r = _rel_index(i, j, k, q_offset)
          e = q[bb, i, hh] @ kk[bb, j, hh]
          if tk is not None:
            e += q[bb, i, hh] @ tk[r]
          e /= math.sqrt(d)
          if bias is not None:
            e += bias[bb, hh, i, j]
          logits.append(e)
          allowed.append(True if mask is None else bool(mask[bb, 0, i, j]))
        if any(allowed):
          top = max(e for e, a in zip(logits, allowed) if a)
          w = [math.exp(e - top) if a else 0.0 for e, a in zip(logits, allowed)]
          w = [x / sum(w) for x in w]
        else:  # a fully masked row: uniform weights, finite output
          w = [1.0 / m] * m
        for j in range(m):
          r = _rel_index(i, j, k, q_offset)
          out[bb, i, hh] += w[j] * (v[bb, j, hh] + (tv[r] if tv is not None else 0.0))
  return out


def _arrays(seed, b=2, n=5, m=5, h=2, d=4, k=2):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.normal(size=s).astype(np.float32)
  return f(b, n, h, d), f(b, m, h, d), f(b, m, h, d), f(2 * k + 1, d), f(2 * k + 1, d)


def test_relative_positions_papers_example_and_loop():
  idx = np.asarray(shaw.relative_positions(10, 10, 3))
  assert (np.diag(idx) == 3).all()
  for i in range(10):
    for j in range(10):
      assert idx[i, j] == _rel_index(i, j, 3, 0)
      if j >= i + 3:
        assert idx[i, j] == 6
      if j <= i - 3:
        assert idx[i, j] == 0
  shifted = np.asarray(shaw.relative_positions(2, 7, 2, q_offset=4))
  assert shifted.tolist() == [[_rel_index(i, j, 2, 4) for j in range(7)] for i in range(2)]


def test_trick_functions_match_loops():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
  rel = rng.normal(size=(3, 5, 4)).astype(np.float32)
  w = rng.random(size=(2, 2, 3, 5)).astype(np.float32)
  logits = np.asarray(shaw.shaw_relative_logits(q, rel))
  values = np.asarray(shaw.shaw_relative_values(w, rel))
  for b in range(2):
    for h in range(2):
      for i in range(3):
        for j in range(5):
          assert logits[b, h, i, j] == pytest.approx(float(q[b, i, h] @ rel[i, j]), abs=1e-5)
        expect = sum(w[b, h, i, j] * rel[i, j] for j in range(5))
        np.testing.assert_allclose(values[b, i, h], expect, atol=1e-5)


@pytest.mark.parametrize('form', LOOPED)
@pytest.mark.parametrize('n,m,k,q_offset', [(5, 5, 2, 0), (3, 7, 2, 4), (6, 4, 1, 0),
                                            (1, 8, 3, 5), (5, 5, 0, 0), (4, 6, 9, 1)])
def test_shaw_attention_matches_loop(form, n, m, k, q_offset):
  q, kk, v, tk, tv = _arrays(n * 10 + m, n=n, m=m, k=k)
  got = FORMS[form](q, kk, v, tk, tv, q_offset=q_offset)
  want = _reference(q, kk, v, tk, tv, k, q_offset)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize('form', LOOPED)
def test_masks_bias_and_ablations_match_loop(form):
  q, kk, v, tk, tv = _arrays(7, n=5, m=6)
  rng = np.random.default_rng(1)
  mask = rng.random((2, 1, 5, 6)) > 0.3
  mask[0, 0, 2] = False  # one fully masked row
  bias = rng.normal(size=(2, 2, 5, 6)).astype(np.float32)
  for keys, values in ((True, True), (True, False), (False, True)):
    a, b = (tk if keys else None), (tv if values else None)
    got = FORMS[form](q, kk, v, a, b, mask=jnp.asarray(mask), bias=bias)
    want = _reference(q, kk, v, a, b, 2, mask=mask, bias=bias)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def _loop_spread(x, k, q_offset, m):
  b, h, n, _ = x.shape
  out = np.zeros((b, h, n, m), np.float32)
  for i in range(n):
    for j in range(m):
      out[:, :, i, j] = x[:, :, i, _rel_index(i, j, k, q_offset)]
  return out


def _loop_bucket_sum(y, k, q_offset):
  b, h, n, m = y.shape
  out = np.zeros((b, h, n, 2 * k + 1))
  for i in range(n):
    for j in range(m):
      out[:, :, i, _rel_index(i, j, k, q_offset)] += y[:, :, i, j]
  return out


# m up to 75 > 2 blocks of relative_banded._BLOCK keys, not a multiple of it; query
# offsets put each row's far-left bucket end anywhere in a block.
@pytest.mark.parametrize('n,m,k,q_offset', [(5, 7, 2, 0), (40, 75, 3, 10), (33, 70, 16, 0),
                                            (3, 70, 4, 66), (6, 80, 1, 90), (4, 9, 9, 0)])
def test_bucket_spread_and_sum_match_loops_and_are_transposes(n, m, k, q_offset):
  rng = np.random.default_rng(n + m + k)
  x = rng.normal(size=(2, 3, n, 2 * k + 1)).astype(np.float32)
  y = rng.normal(size=(2, 3, n, m)).astype(np.float32)
  ix = relative_banded.band_indices(n, m, k, q_offset)
  spread = np.asarray(relative_banded.bucket_spread(k, jnp.asarray(x), ix, m))
  sums = np.asarray(relative_banded.bucket_sum(k, jnp.asarray(y), ix))
  np.testing.assert_array_equal(spread, _loop_spread(x, k, q_offset, m))
  np.testing.assert_allclose(sums, _loop_bucket_sum(y, k, q_offset), atol=1e-4)
  # <spread(x), y> == <x, bucket_sum(y)>: each is the other's derivative.
  np.testing.assert_allclose(np.sum(spread * y), np.sum(x * sums), rtol=1e-4)
  traced = jax.jit(lambda q: relative_banded.bucket_sum(k, jnp.asarray(y),
                                                 relative_banded.band_indices(n, m, k, q)))(q_offset)
  np.testing.assert_allclose(np.asarray(traced), sums, atol=1e-5)  # decoding: a traced offset


# Both tables at every shape (the fused _relative_softmax); keys or values
# alone (bucket_spread, bucket_sum separately) at the rectangular one, whose
# 45 keys make one whole block of bucket_sum's far-left sums and a partial one.
@pytest.mark.parametrize('n,m,k,q_offset,tables', [
    (6, 6, 2, 0, 'both'), (20, 45, 3, 10, 'both'), (5, 9, 0, 2, 'both'), (3, 70, 4, 66, 'both'),
    (20, 45, 3, 10, 'keys'), (20, 45, 3, 10, 'values')])
def test_banded_gradients_equal_dense_with_mask_bias_and_offset(n, m, k, q_offset, tables):
  # The banded kernel's VJPs are written by hand (bucket_spread/bucket_sum and
  # the fused _relative_softmax when both tables are used): compare with the
  # dense kernel's autodiff, on a random mask with a fully masked row.
  q, kk, v, tk, tv = (jnp.asarray(x) for x in _arrays(n + m, n=n, m=m, k=k))
  tk = tk if tables in ('both', 'keys') else None
  tv = tv if tables in ('both', 'values') else None
  rng = np.random.default_rng(k)
  mask = rng.random((2, 1, n, m)) > 0.3
  mask[1, 0, n // 2] = False
  bias = jnp.asarray(rng.normal(size=(1, 2, n, m)).astype(np.float32))
  r = jnp.asarray(rng.normal(size=(2, n, 2, 4)).astype(np.float32))

  def grads(form):
    def f(q, kk, v, tk, tv, bias):
      out = FORMS[form](q, kk, v, tk, tv, mask=jnp.asarray(mask), bias=bias, q_offset=q_offset)
      return jnp.sum(out * r)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))(q, kk, v, tk, tv, bias)
  for name, got, want in zip('q k v tk tv bias'.split(), grads('shaw_banded'), grads('dense')):
    if want is None:
      continue
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-5, rtol=1e-4,
                               err_msg=name)


def test_banded_dropout_equals_dense_with_the_same_keep_mask():
  q, kk, v, tk, tv = (jnp.asarray(x) for x in _arrays(5, n=8, m=40, k=3))
  causal = jnp.tril(jnp.ones((8, 40), bool), 32)[None, None]

  def run(form):
    def f(q, tk, tv):
      out = FORMS[form](q, kk, v, tk, tv, mask=causal, dropout_rate=0.3,
                        dropout_rng=jax.random.key(7), deterministic=False)
      return jnp.sum(jnp.sin(out)), out
    return jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, tk, tv)
  (g_banded, out_banded), (g_naive, out_naive) = run('shaw_banded'), run('dense')
  np.testing.assert_allclose(np.asarray(out_banded), np.asarray(out_naive), atol=2e-5)
  for a, b in zip(g_banded, g_naive):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5)


DOCUMENTS = np.array([[0] * 16 + [1] * 21, [0] * 37])
VALID = np.ones((2, 37), bool)
VALID[1, 30:] = False  # padding: row 1's last queries see no key, and no key sees them

# The fused kernel's cases: (tables, n, m, k, q_offset, mask); its blocks of
# 16 (pallas_gpu.BLOCK) put the clip inside some blocks and past others.
FUSED = {
    'keys and values, causal, segments, padding': (
        'both', 37, 37, 3, 0, masks.causal() & masks.segments(DOCUMENTS, DOCUMENTS)
        & masks.key_padding(VALID) & masks.query_padding(VALID)),
    'keys only, decoding offset, key padding': ('keys', 9, 37, 4, 24,
                                                 masks.causal() & masks.key_padding(VALID)),
}


@pytest.mark.parametrize('case', FUSED)
def test_the_fused_kernel_equals_the_loop_forward_and_gradients(case, monkeypatch,
                                                                gradients_match_the_loop):
  """attend(kernel='pallas') (interpreted, blocks of 16) against eq. 3-5's
  float64 loop with one key/value head for two query heads: the output, and
  the gradients of q, k, v and each table along random directions against
  the loop's central differences."""
  monkeypatch.setattr(pallas_gpu, 'BLOCK', 16)
  tables, n, m, k, q_offset, mask = FUSED[case]
  q, kk, v, tk, tv = (x.astype(np.float64) for x in _arrays(3, n=n, m=m, k=k, d=8))
  kk, v = kk[:, :, :1], v[:, :, :1]  # grouped-query: one key/value head
  names = [t for t, on in (('rel_key_table', tables != 'values'),
                           ('rel_value_table', tables != 'keys')) if on]
  dense_mask = np.broadcast_to(masks.as_dense(mask, 2, 1, n, m, q_offset), (2, 1, n, m))
  cot = np.random.default_rng(4).normal(size=(2, n, 2, 8))

  def loop(q, kk, v, *arrays):
    given = dict(zip(names, arrays))
    return _reference(q, np.repeat(kk, 2, 2), np.repeat(v, 2, 2), given.get('rel_key_table'),
                      given.get('rel_value_table'), k, q_offset, mask=dense_mask)

  def fused(q, kk, v, *arrays):
    out = FORMS['pallas'](q, kk, v, *(dict(zip(names, arrays)).get(t) for t in
                                       ('rel_key_table', 'rel_value_table')),
                          mask=mask, q_offset=q_offset)
    return jnp.sum(out * cot), out

  args = [q, kk, v] + [{'rel_key_table': tk, 'rel_value_table': tv}[t] for t in names]
  grads, out = jax.grad(fused, argnums=tuple(range(len(args))), has_aux=True)(
      *(jnp.asarray(x, jnp.float32) for x in args))
  np.testing.assert_allclose(np.asarray(out), loop(*args), atol=2e-5)
  gradients_match_the_loop(loop, args, grads, cot, case)


def test_auto_takes_the_banded_kernel_past_its_table_size_and_by_lag_for_long_causal_calls():
  """select.SHAW_BANDED_MIN_ELEMENTS: gathered [n, m, d] tables below it run
  dense, above it on shaw_banded; past the dense limit a causal call runs
  split by lag, a bidirectional one blockwise."""
  def plan(n, mask=None, dense_max_mib=None):
    x = jax.ShapeDtypeStruct((1, n, 2, 64), jnp.float32)
    table = jax.ShapeDtypeStruct((33, 64), jnp.float32)
    return entry.plan(x, x, scheme='shaw', mask=mask, options={'dense_max_mib': dense_max_mib},
                      params={'rel_key_table': table, 'rel_value_table': table}).kernel.name
  assert plan(8) == 'dense' and plan(64) == 'shaw_banded'
  assert plan(64, masks.causal(), dense_max_mib=0) == 'shaw_by_lag'
  assert plan(64, dense_max_mib=0) == 'chunked'
  assert plan(64, masks.causal() & masks.sliding_window(4), dense_max_mib=0) == 'chunked'


def test_the_old_form_option_names_the_kernel_that_replaces_it():
  c = config_lib.base_config()
  c.model.attention = 'shaw'
  c.model.attention_kwargs.form = 'banded'
  with pytest.raises(config_lib.ConfigError, match="'banded' is 'shaw_banded'"):
    main.validate(c)
  with pytest.raises(ValueError, match="attention_kwargs.kernel='shaw_banded'"):
    registry.resolve_kwargs('shaw', {'form': 'banded'})


def test_the_decoder_has_shaw_tables_in_self_attention_not_cross_attention():
  # Cached decoding against the full pass, every form: tests/test_models.py.
  cfg = dict(type='encoder_decoder', vocab_size=11, d_model=16, num_heads=2,
             num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32, dropout_rate=0.0,
             attention_dropout_rate=0.0, attention='shaw',
             attention_kwargs={'max_distance': 3, 'kernel': 'shaw_banded'}, positions='none',
             max_len=16, pre_ln=True, activation='relu', dtype='float32')
  inputs, targets = jnp.ones((1, 5), jnp.int32), jnp.ones((1, 6), jnp.int32)
  params = jax.eval_shape(models.build(cfg).init, jax.random.key(0), inputs, targets)['params']
  assert 'rel_key_table' in params['encoder']['layer_0']['self_attention']
  assert 'rel_key_table' in params['decoder']['layer_0']['self_attention']
  assert 'rel_key_table' not in params['decoder']['layer_0']['cross_attention']


def test_registry_entry_and_config_validation():
  v = registry.get('shaw')
  assert v.kwargs == {'max_distance': 16, 'relative_keys': True, 'relative_values': True}
  c = config_lib.base_config()
  c.model.attention = 'shaw'
  c.model.attention_kwargs.max_distance = 8
  main.validate(c)
  c.model.attention_kwargs.max_distance = -1
  with pytest.raises(config_lib.ConfigError, match='max_distance=-1'):
    main.validate(c)
  c.model.attention_kwargs.max_distance = 2
  c.model.attention_kwargs.kernel = 'fast'
  with pytest.raises(config_lib.ConfigError, match="kernel='fast'"):
    main.validate(c)


def test_values_only_layer_has_no_key_table():
  layer = MultiHeadAttention(num_heads=2, attention='shaw',
                             attention_kwargs={'relative_keys': False, 'max_distance': 1})
  params = nn.unbox(layer.init(jax.random.key(0), jnp.ones((1, 3, 4))))['params']
  assert params['rel_value_table'].shape == (3, 2) and 'rel_key_table' not in params


def test_banded_bfloat16_close_to_float32_forward_and_gradient():
  q, kk, v, tk, tv = _arrays(9, n=12, m=40, k=3)
  causal = jnp.tril(jnp.ones((12, 40), bool), 28)[None, None]

  def run(dtype):
    def f(q, tk, tv):
      out = FORMS['shaw_banded'](*(jnp.asarray(x, dtype) for x in (q, kk, v)), tk, tv,
                                 mask=causal, dtype=dtype)
      return jnp.sum(out.astype(jnp.float32) ** 2), out
    return jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(
        jnp.asarray(q), jnp.asarray(tk), jnp.asarray(tv))
  (g16, out16), (g32, out32) = run(jnp.bfloat16), run(jnp.float32)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(out32), atol=0.05, rtol=0.05)
  for a, b in zip(g16, g32):
    scale = float(jnp.abs(b).max())
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=0.03 * scale)
