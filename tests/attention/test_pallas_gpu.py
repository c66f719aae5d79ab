"""The Pallas score kernel (kernels/pallas_gpu.py) in interpret mode against
attention written out densely in float64 numpy: outputs and q, k, v
gradients, with and without a score, causal with a decoding offset,
grouped-query heads, and lengths that do not divide the blocks."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from flaxformer_lite.attention.kernels import pallas_gpu

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)


def alibi(s, q_pos, k_pos, head, tables):
  (slope,) = tables  # this head's row of the slopes: [1]
  return s - slope[...] * jnp.abs(q_pos - k_pos).astype(jnp.float32)


BUCKETS = np.random.default_rng(9).normal(size=(4, 8)).astype(np.float32)  # [h, buckets]


def bucket_bias(s, q_pos, k_pos, head, tables):
  """A table lookup, T5's kind: this head's bias by clipped signed distance."""
  (row,) = tables  # this head's row: [8]
  return s + row[jnp.clip(k_pos - q_pos, -4, 3) + 4]


def _reference(q, k, v, *, slopes=None, buckets=None, causal=False, q_offset=0, q_pos=None,
               k_pos=None):
  """float64 numpy: softmax(q.k / sqrt(d) + score) v per head."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h, d = q.shape
  m, g = k.shape[1], k.shape[2]
  q_pos = q_offset + np.arange(n) if q_pos is None else np.asarray(q_pos)
  k_pos = np.arange(m) if k_pos is None else np.asarray(k_pos)
  out = np.zeros((b, n, h, v.shape[3]))
  for bi in range(b):
    for hi in range(h):
      kh = hi // (h // g)
      s = q[bi, :, hi] @ k[bi, :, kh].T / np.sqrt(d)
      if slopes is not None:
        s = s - slopes[hi] * np.abs(q_pos[:, None] - k_pos[None, :])
      if buckets is not None:
        s = s + buckets[hi][np.clip(k_pos[None, :] - q_pos[:, None], -4, 3) + 4]
      if causal:
        s = np.where(np.arange(m)[None, :] <= q_offset + np.arange(n)[:, None], s, -np.inf)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      out[bi, :, hi] = (p / p.sum(axis=1, keepdims=True)) @ v[bi, :, kh]
  return out


CASES = {
    'plain': dict(),
    'alibi causal': dict(score=True, causal=True),
    'alibi causal, decoding offset, GQA': dict(score=True, causal=True, q_offset=5, g=2, n=7),
    'randomized positions': dict(score=True, positions=True),
    'bucket table, causal, GQA': dict(buckets=True, causal=True, g=1),
}


def _inputs(n=13, m=None, g=4, seed=0):
  rng = np.random.default_rng(seed)
  m = m or n
  q = rng.normal(size=(2, n, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(2, m, g, 8)).astype(np.float32) for _ in range(2))
  return q, k, v


@pytest.mark.parametrize('name', list(CASES))
def test_output_and_gradients_equal_the_written_out_attention(name):
  case = CASES[name]
  n = case.get('n', 13)
  m = 12 if case.get('q_offset') else 13
  q, k, v = _inputs(n, m, case.get('g', 4))
  offset = case.get('q_offset', 0)
  positions = {}
  if case.get('positions'):
    positions = dict(q_pos=np.sort(np.random.default_rng(1).choice(100, n, replace=False)))
    positions['k_pos'] = positions['q_pos']
  slopes = SLOPES if case.get('score') else None
  buckets = BUCKETS if case.get('buckets') else None
  score, tables = None, ()
  if slopes is not None:
    score, tables = alibi, (jnp.asarray(SLOPES),)
  if buckets is not None:
    score, tables = bucket_bias, (jnp.asarray(BUCKETS),)
  kwargs = dict(score=score, tables=tables,
                causal=case.get('causal', False), q_offset=offset, block_q=4, block_k=8,
                interpret=True,
                q_positions=positions.get('q_pos'), k_positions=positions.get('k_pos'))
  out = pallas_gpu.flash_attention(q, k, v, **kwargs)
  want = _reference(q, k, v, slopes=slopes, buckets=buckets, causal=kwargs['causal'],
                    q_offset=offset, **positions)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)

  cot = np.random.default_rng(2).normal(size=want.shape).astype(np.float32)
  grads = jax.grad(lambda q, k, v: jnp.sum(pallas_gpu.flash_attention(q, k, v, **kwargs) * cot),
                   argnums=(0, 1, 2))(q, k, v)
  eps = 1e-3  # central differences of the float64 reference along random directions
  for i, (x, grad) in enumerate(zip((q, k, v), grads)):
    direction = np.random.default_rng(3 + i).normal(size=x.shape)
    def loss(t, i=i, direction=direction):
      args = [np.asarray(a, np.float64) for a in (q, k, v)]
      args[i] = args[i] + t * direction
      return np.sum(_reference(*args, slopes=slopes, buckets=buckets, causal=kwargs['causal'],
                               q_offset=offset, **positions) * cot)
    numeric = (loss(eps) - loss(-eps)) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(grad, np.float64) * direction), numeric,
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
@pytest.mark.parametrize('head_dim', [64, 128])
@pytest.mark.parametrize('score,table', [(alibi, SLOPES), (bucket_bias, BUCKETS)],
                         ids=['alibi', 'bucket table'])
def test_forward_and_backward_lower_to_triton_for_a_cuda_gpu(dtype, head_dim, score, table):
  """Lowered for the CUDA platform on this machine (no GPU needed): the
  forward is one Triton call, its gradient two more (dk and dv; dq)."""
  q = jnp.zeros((1, 256, 4, head_dim), dtype)
  k = v = jnp.zeros((1, 256, 2, head_dim), dtype)

  def out(q, k, v):
    return pallas_gpu.flash_attention(q, k, v, causal=True, score=score,
                                      tables=(jnp.asarray(table),), block_q=64, block_k=64)

  def loss(q, k, v):
    return out(q, k, v).astype(jnp.float32).sum()

  for fn, calls in ((out, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
    text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=('cuda',)).as_text()
    assert text.count('custom_call @__gpu$xla.gpu.triton') == calls, text[:2000]
