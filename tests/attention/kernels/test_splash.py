"""Splash attention (attention/splash.py) held to dot_product's dense path,
run by Pallas's interpreter on CPU; the rule that picks it (kernels.table.splash_fits);
and the path a layer lowered for a TPU on this machine takes, read from its HLO."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import entry, masks, registry, select
from flaxformer_lite.attention.kernels import splash
from flaxformer_lite.attention.kernels import table as kernels
from flaxformer_lite.layers import MultiHeadAttention


def _inputs(b=2, n=128, h=4, g=2, d=32):
  q, k, v = (jax.random.normal(jax.random.key(i), shape)
             for i, shape in enumerate([(b, n, h, d), (b, n, g, d), (b, n, g, d)]))
  # example 0: its last 28 keys and queries are padding; example 1: its first
  # 8 keys are, so its first 8 causal rows see no key at all
  key_valid = jnp.array([np.arange(n) < n - 28, np.arange(n) >= 8])
  query_valid = jnp.array([np.arange(n) < n - 28, np.ones(n, bool)])
  return (q, k, v), query_valid, key_valid


@pytest.mark.parametrize('causal', [True, False])
def test_splash_matches_the_dense_path_forward_and_gradients(causal):
  """Grouped-query (4 query heads on 2), padded keys and queries: the same
  output and gradients w.r.t. q, k, v as the dense path under the same
  mask, rows that see no key included (uniform weights), never NaN."""
  qkv, query_valid, key_valid = _inputs()
  n = qkv[0].shape[1]
  dense_mask = query_valid[:, None, :, None] & key_valid[:, None, None, :]
  if causal:
    dense_mask = dense_mask & jnp.tril(jnp.ones((n, n), bool))
  cotangent = jax.random.normal(jax.random.key(9), qkv[0].shape)

  def ours(q, k, v):
    return splash.splash_attention(q, k, v, causal=causal, query_valid=query_valid,
                                   key_valid=key_valid, interpret=True)

  def dense(q, k, v):
    return registry.get('dot_product').fn(q, k, v, mask=dense_mask, implementation='dense')

  got, want = ours(*qkv), dense(*qkv)
  assert not jnp.isnan(got).any()
  np.testing.assert_allclose(got, want, atol=2e-6)
  grads = [jax.grad(lambda *x, f=f: jnp.sum(f(*x) * cotangent), argnums=(0, 1, 2))(*qkv)
           for f in (ours, dense)]
  for got_grad, want_grad in zip(*grads):
    assert not jnp.isnan(got_grad).any()
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-5)


def _fits(platform='tpu', n=256, m=None, d=128, dtype='bfloat16', mask_kind='causal',
          dropout=False, return_weights=False):
  """Whether kernels.splash_fits takes attend's call on these shapes."""
  query = jax.ShapeDtypeStruct((2, n, 8, d), dtype)
  key = jax.ShapeDtypeStruct((2, n if m is None else m, 2, d), dtype)
  mask = {'causal': masks.causal(), 'full': None,
          None: masks.prefix_lm(jnp.zeros(1, int))}[mask_kind]
  with select.target_platform(platform):
    call, _, _ = entry.describe_call(
        query, key, mask=mask, dtype=dtype, dropout_rate=0.1 if dropout else 0.0,
        dropout_rng=jax.random.key(0) if dropout else None, return_weights=return_weights)
  return kernels.splash_fits(call) is None


def test_splash_fits_on_tpu_for_causal_or_full_masks_in_whole_blocks():
  assert _fits() and _fits(mask_kind='full') and _fits(dtype='float32') and _fits(d=256)
  assert _fits(n=128, m=512)  # cross-attention
  assert not _fits('gpu') and not _fits('cpu')
  assert not _fits(mask_kind=None)  # windows, segments, an explicit array
  assert not _fits(n=100) and not _fits(m=200) and not _fits(n=1, m=256)  # decoding step
  assert not _fits(d=64) and not _fits(dtype='float16')
  assert not _fits(dropout=True) and not _fits(return_weights=True)


def test_mask_kind_reads_causal_or_full_with_padding_only():
  valid = jnp.ones((2, 8), bool)
  assert select.mask_kind(None) == 'full'
  assert select.mask_kind(masks.padding(valid)) == 'full'
  assert select.mask_kind(masks.causal() & masks.key_padding(valid)) == 'causal'
  assert select.mask_kind(masks.causal(), q_offset=jnp.int32(3)) is None
  assert select.mask_kind(masks.causal() & masks.sliding_window(4)) is None
  assert select.mask_kind(masks.segments(valid, valid)) is None
  assert select.mask_kind(masks.as_mask(valid[:, None, None])) is None


def _tpu_hlo(attention='dot_product', n=128, dropout=False, grad=False, mask=None):
  """StableHLO of a MultiHeadAttention (2 heads of 128, batch 2) at length
  n, causal and key-padded unless `mask` is given, its forward or (grad) the
  gradient of its sum by its parameters, lowered for a TPU as a TPU would
  choose."""
  layer = MultiHeadAttention(num_heads=2, qkv_features=256, attention=attention,
                             dropout_rate=0.1 if dropout else 0.0, dtype=jnp.bfloat16)
  x = jax.ShapeDtypeStruct((2, n, 256), jnp.float32)
  params = jax.eval_shape(layer.init, jax.random.key(0), x)
  if mask is None:
    mask = masks.causal() & masks.key_padding(jnp.arange(n)[None] < jnp.array([[n], [n - 9]]))

  def forward(params, x):
    return layer.apply(params, x, mask=mask, deterministic=not dropout,
                       rngs={'dropout': jax.random.key(1)}).astype(jnp.float32).sum()
  with select.target_platform('tpu'):
    traced = jax.jit(jax.grad(forward) if grad else forward).trace(params, x)
    return traced.lower(lowering_platforms=('tpu',)).as_text()


def test_dot_product_and_rotary_lower_to_splash_for_a_tpu_where_it_fits():
  assert 'tpu_custom_call' in _tpu_hlo()
  assert 'tpu_custom_call' in _tpu_hlo(grad=True)
  assert 'tpu_custom_call' in _tpu_hlo('rotary', n=256)
  assert 'tpu_custom_call' not in _tpu_hlo(n=100)
  assert 'tpu_custom_call' not in _tpu_hlo(dropout=True)
  assert 'tpu_custom_call' not in _tpu_hlo(mask=masks.causal() & masks.sliding_window(16))
  assert 'tpu_custom_call' not in _tpu_hlo('alibi')
