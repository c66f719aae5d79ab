"""causal_band.py (each query against its k nearest keys) against a loop, and
Shaw's causal chunked calls, split by lag into the chunked kernel and that
band (the kernel shaw_by_lag), against the dense paper form."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import entry, masks
from flaxformer_lite.attention.kernels import blockwise, product
from flaxformer_lite.attention.kernels.specialised import causal_band
from flaxformer_lite.attention.schemes import shaw


def _band_loop(q, key, value, k, key_rows, value_rows):
  """float64 loop: query i against keys max(0, i-k+1) .. i, the pair at lag t
  with row k - 1 - t added to its key and its value."""
  b, n, h, _ = q.shape
  out = np.zeros((b, n, h, value.shape[-1]))
  lse = np.zeros((b, h, n))
  for bi in range(b):
    for hi in range(h):
      for i in range(n):
        keys = range(max(0, i - k + 1), i + 1)
        s = np.array([q[bi, i, hi] @ (key[bi, j, hi] + key_rows[k - 1 - (i - j)]) for j in keys])
        lse[bi, hi, i] = np.log(np.sum(np.exp(s - s.max()))) + s.max()
        p = np.exp(s - lse[bi, hi, i])
        out[bi, i, hi] = sum(pj * (value[bi, j, hi] + value_rows[k - 1 - (i - j)])
                             for pj, j in zip(p, keys))
  return out, lse


@pytest.mark.parametrize('n,k', [(13, 4), (5, 8), (40, 17)])
def test_band_equals_the_loop(n, k):
  rng = np.random.default_rng(n + k)
  q, key, value = (rng.normal(size=(2, n, 3, 5)) for _ in range(3))
  rows_k, rows_v = rng.normal(size=(k, 5)), rng.normal(size=(k, 5))
  out, lse = causal_band.causal_band(*(jnp.asarray(x, jnp.float32) for x in (q, key, value)),
                                     k, jnp.asarray(rows_k, jnp.float32),
                                     jnp.asarray(rows_v, jnp.float32))
  want_out, want_lse = _band_loop(q, key, value, k, rows_k, rows_v)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_lagged_products_gradients_equal_autodiff_of_the_shifted_sums():
  """lagged_dots and lagged_sum have written-out VJPs (and lagged_dots a
  windowed forward); autodiff of the plain shifted-slice sums is the reference."""
  rng = np.random.default_rng(0)
  n, k = 37, 6  # n not a multiple of the window rows
  q, x, g = (jnp.asarray(rng.normal(size=(2, n, 3, 4)), jnp.float32) for _ in range(3))
  p = jnp.asarray(rng.normal(size=(2, n, 3, k)), jnp.float32)
  shifted = lambda y, t: jnp.pad(y, [(0, 0), (t, 0), (0, 0), (0, 0)])[:, :n]  # noqa: E731
  dots_ref = lambda q, x: jnp.stack([jnp.sum(q * shifted(x, t), -1) for t in range(k)], -1)  # noqa: E731
  sum_ref = lambda p, x: sum(p[..., t, None] * shifted(x, t) for t in range(k))  # noqa: E731
  for got_fn, ref_fn, args, cot in (
      (lambda a, b: causal_band.lagged_dots(a, b, k), dots_ref, (q, x), p),
      (causal_band.lagged_sum, sum_ref, (p, x), g)):
    got, pull = jax.vjp(got_fn, *args)
    want, pull_ref = jax.vjp(ref_fn, *args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(pull(cot), pull_ref(cot)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('n,k,g,rate,padded', [(24, 3, 4, 0.0, False), (24, 5, 2, 0.3, False),
                                               (24, 4, 4, 0.3, True), (6, 8, 4, 0.0, False)])
def test_shaw_by_lag_equals_the_paper_form(n, k, g, rate, padded):
  """Output and every gradient (q, k, v, both tables) of the kernel
  shaw_by_lag, through attend, equal shaw_attention's (the dense kernel's
  paper form) under a causal mask: grouped key/value heads (g < h),
  attention dropout, whose keep bits must be the dense path's, and padding
  (a PAD tail, PAD keys inside the band, PAD queries, which see no key: the
  dense path's uniform weights). k >= n has no far keys: the kernel refuses
  the call, and the blockwise kernel runs it."""
  rng = np.random.default_rng(n * k + g)
  h, d = 4, 8
  q = jnp.asarray(rng.normal(size=(2, n, h, d)), jnp.float32)
  key, value = (jnp.asarray(rng.normal(size=(2, n, g, d)), jnp.float32) for _ in range(2))
  tables = tuple(jnp.asarray(rng.normal(size=(2 * k + 1, d)), jnp.float32) for _ in range(2))
  drop = jax.random.PRNGKey(1) if rate else None
  cot = jnp.asarray(rng.normal(size=(2, n, h, d)), jnp.float32)
  valid = np.ones((2, n), bool)
  if padded:
    valid[0, n - 5:] = False  # a PAD tail
    valid[1, [3, 4, 9]] = False  # PAD keys inside later queries' band, PAD queries
  spec = masks.causal() & masks.padding(jnp.asarray(valid)) if padded else masks.causal()
  dense_mask = np.tril(np.ones((n, n), bool))[None, None] & valid[:, None, None, :] & (
      valid[:, None, :, None])
  kernel = 'shaw_by_lag' if k < n else 'chunked'
  if k >= n:
    with pytest.raises(ValueError, match='clipping distance'):
      entry.plan(q, key, scheme='shaw', mask=spec, kernel='shaw_by_lag',
                 options={'max_distance': k},
                 params={'rel_key_table': tables[0], 'rel_value_table': tables[1]})

  def chunked_fn(q, key, value, tk, tv):
    return entry.attend(q, key, value, scheme='shaw', mask=spec, kernel=kernel,
                        options={'max_distance': k, 'chunk_size': 8},
                        params={'rel_key_table': tk, 'rel_value_table': tv},
                        dropout_rate=rate, dropout_rng=drop)

  def dense_fn(q, key, value, tk, tv):
    key, value = (product.repeat_heads(x, h) for x in (key, value))
    return shaw.shaw_attention(q, key, value, tk, tv, mask=jnp.asarray(dense_mask),
                               dropout_rate=rate, dropout_rng=drop, deterministic=not rate)

  def out_and_grads(fn, *args):
    out, pull = jax.vjp(fn, *args)
    return out, pull(cot)

  with jax.default_matmul_precision('highest'):
    got, grads = jax.jit(out_and_grads, static_argnums=0)(chunked_fn, q, key, value, *tables)
    want, grads_ref = jax.jit(out_and_grads, static_argnums=0)(dense_fn, q, key, value, *tables)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  for name, a, b in zip(('q', 'k', 'v', 'key table', 'value table'), grads, grads_ref):
    scale = max(1.0, float(jnp.max(jnp.abs(b))))
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * scale, err_msg=name)


def test_merge_of_two_key_sets_equals_attention_over_both():
  """blockwise.merge of attention over keys [0, 7) and over [7, 12), each with
  its log-sum-exp from attend(return_lse=True), equals attention over all 12;
  the lse's gradient (its cotangent in attend's backward) included."""
  rng = np.random.default_rng(2)
  q, key, value = (jnp.asarray(rng.normal(size=(1, 12, 2, 4)), jnp.float32) for _ in range(3))
  cot = jnp.asarray(rng.normal(size=(1, 12, 2, 4)), jnp.float32)

  def split(q, key, value):
    parts = [blockwise.attend(q, key[:, s], value[:, s], chunk_size=4, return_lse=True)
             for s in (slice(0, 7), slice(7, 12))]
    return blockwise.merge(*parts[0], *parts[1])

  def whole(q, key, value):
    w = jax.nn.softmax(jnp.einsum('bnhd,bmhd->bhnm', q, key), -1)
    return jnp.einsum('bhnm,bmhd->bnhd', w, value)

  with jax.default_matmul_precision('highest'):
    got, pull = jax.vjp(split, q, key, value)
    want, pull_ref = jax.vjp(whole, q, key, value)
    for a, b in zip(pull(cot), pull_ref(cot)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
