"""attention.attend, the one entry point: ALiBi on each kernel against its
float64 formula, every scheme the fused Pallas kernel runs (live registry)
against the dense reference with its gradients, and the errors a user meets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import attend, entry, masks, registry, scheme, select

B, N, H, G, D = 2, 9, 4, 2, 8


def _inputs(seed=0, g=H):
  r = np.random.default_rng(seed)
  q = r.normal(size=(B, N, H, D)).astype(np.float32)
  k, v = (r.normal(size=(B, N, g, D)).astype(np.float32) for _ in range(2))
  return q, k, v


def test_alibi_through_attend_equals_the_written_out_formula_on_every_kernel():
  q, k, v = _inputs()
  slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
  i = np.arange(N)
  s = (np.einsum('bnhd,bmhd->bhnm', q.astype(np.float64), k) / np.sqrt(D)
       - slopes[:, None, None] * np.abs(i[:, None] - i[None, :]))
  s = np.where(i[:, None] >= i[None, :], s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum('bhnm,bmhd->bnhd', w / w.sum(-1, keepdims=True), v)
  for kernel in ('dense', 'chunked'):
    got = attend(q, k, v, scheme='alibi', mask=masks.causal(), kernel=kernel,
                 options={'chunk_size': 4})
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=kernel)


def test_attend_names_what_is_valid_when_given_a_bad_scheme_kernel_or_option():
  q, k, v = _inputs()
  with pytest.raises(ValueError, match="unknown attention variant 'alibbi'; valid: .*alibi"):
    attend(q, k, v, scheme='alibbi')
  with pytest.raises(ValueError, match="kernel='fast'; valid: 'auto', 'dense'"):
    attend(q, k, v, scheme='alibi', kernel='fast')
  with pytest.raises(ValueError, match=r"\['max_distance'\] do not apply to attention='alibi'"):
    attend(q, k, v, scheme='alibi', options={'max_distance': 3})
  with pytest.raises(ValueError, match='takes no explicit bias'):
    attend(q, k, v, scheme='dot_product', kernel='chunked', bias=jnp.zeros((1, 1, N, N)))


PALLAS = [n for n in registry.names() if registry.pallas_runs(registry.get(n))]


@pytest.mark.parametrize('name', PALLAS)
def test_the_pallas_kernel_equals_the_dense_reference_for_every_scheme_it_runs(name):
  """Over the live registry, each scheme the fused kernel runs
  (registry.pallas_runs) through attend(kernel='pallas', interpreted here)
  against attend(kernel='dense'), the derived reference: grouped heads, a
  causal mask with key padding and a query that sees no key, randomized
  positions; the output and the gradients of q, k, v and every parameter."""
  variant = registry.get(name)
  q, k, v = _inputs(4, G)
  options = registry.resolve_kwargs(name, {})
  specs = variant.params(H, D, options) if variant.params else {}
  params = scheme.random_params(specs, 5)
  valid, seen = np.ones((B, N), bool), np.ones((B, N), bool)
  valid[1, :2], seen[0, 4] = False, False  # row 1's first queries see no key
  mask = masks.causal() & masks.key_padding(valid) & masks.query_padding(seen)
  positions = np.sort(np.random.default_rng(6).choice(50, N, replace=False))
  cotangent = np.random.default_rng(7).normal(size=(B, N, H, D)).astype(np.float32)
  positions = positions if variant.position_arrays else None

  def loss(kernel):
    def f(q, k, v, params):
      out = attend(q, k, v, scheme=name, mask=mask, kernel=kernel, params=params,
                   positions=positions)
      return jnp.sum(out * cotangent)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))

  (want, dwant), (got, dgot) = (loss(kernel)(q, k, v, params) for kernel in ('dense', 'pallas'))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-4, atol=1e-4)
  for what, a, b in zip(('dq', 'dk', 'dv'), dgot[:3], dwant[:3]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4, err_msg=what)
  for p in params:
    np.testing.assert_allclose(np.asarray(dgot[3][p]), np.asarray(dwant[3][p]), rtol=2e-4,
                               atol=2e-4, err_msg=f'd {p}')


def _loop_attention(q, k, v, logit, visible):
  """softmax over the visible keys of logit(b, h, i, j), times v, in float64
  loops (q [B, N, H, D]; k, v [B, N, H, D])."""
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      for i in range(q.shape[1]):
        js = [j for j in range(k.shape[1]) if visible(i, j)]
        s = np.array([logit(b, h, i, j) for j in js])
        w = np.exp(s - s.max())
        out[b, i, h] = (w / w.sum()) @ v[b, js, h].astype(np.float64)
  return out


def test_an_inline_score_reads_the_batch_row_and_a_table_per_row_and_head():
  """attend(score=...) with a table [B, H] indexed by the batch row: the
  dense and blockwise kernels equal the loop; the fused kernel, which takes
  tables per head, refuses with the kernels that take it."""
  q, k, v = _inputs(1)
  table = np.random.default_rng(2).normal(size=(B, H)).astype(np.float32)

  def tilt(s, b, h, q_pos, k_pos, tables):
    return s + tables['tilt'][b, h] * (q_pos - k_pos).astype(jnp.float32)

  want = _loop_attention(q, k, v, lambda b, h, i, j: (
      q[b, i, h].astype(np.float64) @ k[b, j, h] / np.sqrt(D) + table[b, h] * (i - j)),
      lambda i, j: j <= i)
  for kernel in ('dense', 'chunked'):
    got = attend(q, k, v, score=tilt, tables={'tilt': table}, mask=masks.causal(),
                 kernel=kernel, options={'chunk_size': 4})
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=kernel)
  with pytest.raises(ValueError, match=r"table 'tilt' has shape \(2, 4\)"):
    attend(q, k, v, score=tilt, tables={'tilt': table}, mask=masks.causal(), kernel='pallas')
  spec = jax.ShapeDtypeStruct((B, N, H, 64), jnp.bfloat16)
  for tables, kernel in (({'tilt': table}, 'chunked'), ({'tilt': table[0]}, 'pallas')):
    with select.target_platform('gpu'):  # 'auto' takes the fused kernel only for per-head tables
      chosen = entry.plan(spec, spec, score=tilt, tables=tables, mask=masks.causal(),
                          options={'dense_max_mib': 0}, dtype=jnp.bfloat16)
    assert chosen.kernel.name == kernel, (tables, chosen)
  square = np.zeros((H, H), np.float32)  # per head by its shape, read by batch row
  with pytest.raises(ValueError, match="reads a table per head.*kernel='dense' or 'chunked'"):
    attend(q, k, v, score=tilt, tables={'tilt': square}, mask=masks.causal(), kernel='pallas')


@pytest.mark.parametrize('kernel', ['dense', 'chunked', 'pallas'])
def test_scale_replaces_one_over_the_square_root_of_the_head_size(kernel):
  q, k, v = _inputs(3)
  want = _loop_attention(q, k, v, lambda b, h, i, j: 0.7 * q[b, i, h].astype(np.float64)
                         @ k[b, j, h] - abs(i - j) * 2.0 ** (-8.0 * (h + 1) / H),
                         lambda i, j: True)
  got = attend(q, k, v, scheme='alibi', scale=0.7, kernel=kernel, options={'chunk_size': 4})
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_a_score_that_reads_a_table_the_call_lacks_says_which_and_where_tables_go():
  q, k, v = _inputs()

  def capped(s, b, h, q_pos, k_pos, tables):
    return s + tables['t'][h]

  for kernel in ('dense', 'chunked', 'pallas'):
    with pytest.raises(KeyError, match=r"reads table 't', but this call has none.*tables="):
      attend(q, k, v, score=capped, kernel=kernel)
  with pytest.raises(ValueError, match=r"attention='t5_bias' reads the parameters "
                                       r"\['rel_embedding'\].*params= holds none"):
    attend(q, k, v, scheme='t5_bias')
  with pytest.raises(ValueError, match='registered scheme or an inline score, not both'):
    attend(q, k, v, scheme='alibi', score=capped)
