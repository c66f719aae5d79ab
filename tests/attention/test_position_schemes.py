"""The schemes written once as block terms (kerple, sandwich, fire, xpos), each
against a float64 loop of its paper's formula, position by position, on the
dense path the registry derives and on the chunked kernel; and the contracts
`register` checks for a variant given as block terms."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import masks, registry, scheme
from flaxformer_lite.attention.kernels import product, reference

B, N, H, D = 2, 11, 4, 8
Q_OFFSET = 5  # queries at 5..15, keys at 0..15
M = N + Q_OFFSET


def _inputs(name, options, seed=0):
  r = np.random.default_rng(seed)
  q, k, v = (r.normal(size=(B, n, H, D)).astype(np.float32) for n in (N, M, M))
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, options)
  specs = variant.params(H, D, kwargs) if variant.params else {}
  params = {p: np.asarray(x) for p, x in scheme.random_params(specs, seed).items()}
  return q, k, v, params, kwargs


def _kerple_loop(form, params, i, j):
  r1, r2 = (np.maximum(np.asarray(params[p], np.float64), 1e-2) for p in ('kerple_r1', 'kerple_r2'))
  if form == 'log':
    return -r1 * np.log1p(r2 * abs(i - j))
  return -r1 * abs(i - j) ** np.minimum(r2, 2.0)


def _sandwich_loop(dim, i, j):
  inner = sum(math.cos((i - j) / 10000 ** (2 * t / dim)) for t in range(1, dim // 2 + 1))
  return np.array([(inner - dim / 2) / (8 * h / H) for h in range(1, H + 1)])


def _fire_loop(params, i, j):
  p = {k: np.asarray(x, np.float64) for k, x in params.items()}
  c, big_l = abs(p['fire_c']), abs(p['fire_threshold'])
  psi = lambda x: math.log(c * x + 1)
  x = psi(abs(i - j)) / psi(max(big_l, i))
  hidden = np.maximum(x * p['fire_w1'] + p['fire_b1'], 0)
  return hidden @ p['fire_w2'] + p['fire_b2']


def _xpos_logits(q, k, i, j, scale_base):
  """sum over pairs t of zeta_t^((i - j)/gamma) (R_i q)_t . (R_j k)_t, [H]."""
  out = np.zeros(H)
  for t in range(D // 2):
    theta = 10000.0 ** (-2 * t / D)
    zeta = (2 * t / D + 0.4) / 1.4
    a, b = i * theta, j * theta
    qr = np.stack([q[:, 2 * t] * math.cos(a) - q[:, 2 * t + 1] * math.sin(a),
                   q[:, 2 * t] * math.sin(a) + q[:, 2 * t + 1] * math.cos(a)], -1)
    kr = np.stack([k[:, 2 * t] * math.cos(b) - k[:, 2 * t + 1] * math.sin(b),
                   k[:, 2 * t] * math.sin(b) + k[:, 2 * t + 1] * math.cos(b)], -1)
    out += zeta ** ((i - j) / scale_base) * np.sum(qr * kr, -1)
  return out


def _loop(name, kwargs, q, k, v, params, causal, q_offset=Q_OFFSET):
  """softmax_j(logit(i, j)) v_j in float64, logit = q.k / sqrt(d) + the
  scheme's term for query position q_offset + i and key position j."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  n, m = q.shape[1], k.shape[1]
  out = np.zeros((B, n, H, v.shape[-1]))
  for b in range(B):
    for i in range(n):
      pos = q_offset + i
      logits = np.zeros((H, m))
      for j in range(m):
        if name == 'xpos':
          logits[:, j] = _xpos_logits(q[b, i] / math.sqrt(D), k[b, j], pos, j,
                                      kwargs['xpos_scale_base'])
          continue
        logits[:, j] = np.sum(q[b, i] * k[b, j], -1) / math.sqrt(D)
        if name == 'kerple':
          logits[:, j] += _kerple_loop(kwargs['kerple_form'], params, pos, j)
        elif name == 'sandwich':
          logits[:, j] += _sandwich_loop(kwargs['sandwich_dim'], pos, j)
        elif name == 'fire':
          logits[:, j] += _fire_loop(params, pos, j)
      if causal:
        logits[:, pos + 1:] = -np.inf
      w = np.exp(logits - logits.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      out[b, i] = np.einsum('hm,mhd->hd', w, v[b])
  return out


CASES = [('kerple', {'kerple_form': 'log'}), ('kerple', {'kerple_form': 'power'}),
         ('sandwich', {'sandwich_dim': 16}), ('fire', {'fire_threshold_init': 6.0}),
         ('xpos', {'xpos_scale_base': 8.0})]
IDS = [f'{n}-{next(iter(o.values()))}' for n, o in CASES]


def test_every_scheme_here_is_registered_from_block_terms():
  assert {name for name, _ in CASES} <= {n for n in registry.names()
                                         if registry.get(n).terms is not None}


@pytest.mark.parametrize('name,options', CASES, ids=IDS)
@pytest.mark.parametrize('causal', [True, False], ids=['causal', 'bidirectional'])
def test_dense_and_chunked_equal_a_float64_loop_of_the_paper(name, options, causal):
  if name == 'xpos' and not causal:
    pytest.skip('xpos is causal (decoder-only)')
  q, k, v, params, kwargs = _inputs(name, options)
  variant = registry.get(name)
  want = _loop(name, kwargs, q, k, v, params, causal)
  dense_mask = (np.arange(M)[None, :] <= Q_OFFSET + np.arange(N)[:, None])[None, None]
  dense = variant.fn(q, k, v, mask=jnp.asarray(dense_mask) if causal else None, bias=None,
                     q_offset=Q_OFFSET, dropout_rate=0.0, dropout_rng=None, deterministic=True,
                     dtype=jnp.float32, return_weights=False, **params, **kwargs)
  got = variant.chunked(q, k, v, mask=masks.causal() if causal else None, q_offset=Q_OFFSET,
                        chunk_size=4, dtype=jnp.float32, **params, **kwargs)
  for what, x in (('dense', dense), ('chunked', got)):
    np.testing.assert_allclose(np.asarray(x, np.float64), want, rtol=2e-5, atol=2e-5,
                               err_msg=what)


def test_xpos_at_a_16k_position_is_finite_and_equals_the_loop():
  """zeta^(i/gamma) alone underflows past 16k; the block terms measure
  positions from the block's first key. One query at 16,380 against 16,384
  keys on both kernels (the loop reads the few keys that matter: the rest
  share the same decayed terms, so a window of them suffices for the check)."""
  r = np.random.default_rng(3)
  m, q_offset = 16384, 16380
  q = r.normal(size=(B, 1, H, D)).astype(np.float32)
  k, v = (r.normal(size=(B, m, H, D)).astype(np.float32) for _ in range(2))
  kwargs = registry.resolve_kwargs('xpos', {})
  variant = registry.get('xpos')
  keep = np.arange(m) >= m - 64  # the last 64 keys: the farther ones are invisible
  mask = jnp.asarray((keep & (np.arange(m) <= q_offset))[None, None, None, :])
  want = _loop('xpos', kwargs, q, k[:, keep], v[:, keep], {}, causal=True,
               q_offset=q_offset - (m - 64))
  dense = variant.fn(q, k, v, mask=mask, bias=None, q_offset=q_offset, dropout_rate=0.0,
                     dropout_rng=None, deterministic=True, dtype=jnp.float32,
                     return_weights=False, **kwargs)
  spec = masks.key_padding(jnp.broadcast_to(jnp.asarray(keep), (B, m))) & masks.causal()
  got = variant.chunked(q, k, v, mask=spec, q_offset=q_offset, chunk_size=512,
                        dtype=jnp.float32, **kwargs)
  for what, x in (('dense', dense), ('chunked', got)):
    assert np.all(np.isfinite(np.asarray(x))), what
    np.testing.assert_allclose(np.asarray(x, np.float64), want, rtol=1e-4, atol=1e-4,
                               err_msg=what)


def _squared(p, v, params, q_pos, k_pos):
  return product.dot_values(p * p, v, params, q_pos, k_pos)


def test_a_values_term_that_is_not_linear_in_the_weights_fails_the_check():
  """scheme.check_terms, which test_registry.py runs on every registered
  scheme, refuses a values term that squares the weights."""
  terms = scheme.Terms(values=_squared, uniform=scheme.mean_values)
  with pytest.raises(TypeError, match="'squared': Terms.values is not linear in the weights"):
    scheme.check_terms('squared', terms, {}, 2, 4)


def test_looking_a_variant_up_runs_no_jax(monkeypatch):
  """registry.get is a dictionary lookup, inside a trace too: a scheme whose
  values term would fail the check is still returned, and nothing compiles."""
  monkeypatch.setattr(registry, '_REGISTRY', dict(registry._REGISTRY))  # pylint: disable=protected-access
  registry.register(registry.AttentionVariant(
      name='squared_lookup_test',
      terms=lambda num_heads: scheme.Terms(values=_squared, uniform=scheme.mean_values)))
  compiled = []
  monkeypatch.setattr(jax.stages.Lowered, 'compile',
                      lambda self, *a, **k: compiled.append(self) or 1 / 0)

  def model(x):
    assert registry.get('squared_lookup_test').name == 'squared_lookup_test'
    assert all(registry.get(name).name == name for name in registry.names())
    return x + 1

  jax.make_jaxpr(model)(1.0)
  assert not compiled


def test_a_linear_values_term_passes_the_check_under_a_reduced_default_matmul_precision():
  """A GPU's default float32 matmul (TF32) and a TPU's (bf16 passes) round a
  linear term by ~1e-3, past the check's tolerance: the check must run at
  float32 precision whatever the default. XLA:CPU ignores the setting, so
  this term rounds its operands as those backends would."""
  def rounded(p, v, params, q_pos, k_pos):
    if jax.config.jax_default_matmul_precision not in ('highest', 'float32'):
      p, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (p, v))
    return product.dot_values(p, v, params, q_pos, k_pos)

  terms = scheme.Terms(values=rounded, uniform=scheme.mean_values)
  with jax.default_matmul_precision('bfloat16'):
    scheme.check_terms('rounded', terms, {}, 2, 4)


def test_importing_the_registry_runs_no_jax_computation():
  """A multi-host process must initialise jax.distributed before any JAX
  computation, and it imports the registry first."""
  import subprocess
  import sys
  code = ('import jax, flaxformer_lite.attention, flaxformer_lite.main\n'
          'from jax._src import xla_bridge\n'
          'assert not xla_bridge.backends_are_initialized(), "a backend was initialised"')
  subprocess.run([sys.executable, '-c', code], check=True, env={**__import__('os').environ,
                                                               'JAX_PLATFORMS': 'cpu'})


def test_a_linear_values_term_registers_and_runs_on_both_kernels():
  """A term of its own (a learned vector per head added to every value,
  sum_j p_ij (v_j + u)) passes, and its dense and chunked paths agree with
  the formula, fully masked rows included (uniform)."""
  def values(p, v, params, q_pos, k_pos):
    shift = jnp.sum(p, -1, keepdims=True) * params['shift_test'][None, :, None, :]
    return product.dot_values(p, v, params, q_pos, k_pos) + shift

  def uniform(value, params, q_pos, k_pos):
    return scheme.mean_values(value, params, q_pos, k_pos) + params['shift_test'][None, None]

  variant = registry.register(registry.AttentionVariant(
      name='shifted_values_test', terms=lambda num_heads: scheme.Terms(
          values=values, uniform=uniform),
      params=lambda h, d, kw: {'shift_test': ((h, d), jax.nn.initializers.normal(1.0),
                                              ('heads', 'kv'))}))
  try:
    r = np.random.default_rng(0)
    q, k, v = (r.normal(size=(B, 6, H, D)).astype(np.float32) for _ in range(3))
    shift = r.normal(size=(H, D)).astype(np.float32)
    key_valid = np.ones((B, 6), bool)
    key_valid[1] = False  # row 1 sees no key: uniform weights
    dense = variant.fn(q, k, v, mask=jnp.asarray(key_valid[:, None, None, :]),
                       shift_test=shift)
    got = variant.chunked(q, k, v, mask=masks.key_padding(jnp.asarray(key_valid)),
                          chunk_size=4, shift_test=shift)
    s = np.einsum('bnhd,bmhd->bhnm', q, k) / math.sqrt(D)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum('bhnm,bmhd->bnhd', w, v) + shift
    want[1] = v[1].mean(0)[None] + shift
    for what, x in (('dense', dense), ('chunked', got)):
      np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-5, err_msg=what)
  finally:
    registry._REGISTRY.pop('shifted_values_test')  # pylint: disable=protected-access


def test_a_parameter_named_like_an_option_is_refused():
  with pytest.raises(ValueError, match='named like its options'):
    registry.register(registry.AttentionVariant(
        name='clash_test', terms=lambda num_heads, width: scheme.Terms(),
        options=dataclasses.make_dataclass(
            'ClashOptions', [('clash_width_test', int, dataclasses.field(default=2))],
            frozen=True),
        params=lambda h, d, kw: {'clash_width_test': ((h,), jax.nn.initializers.zeros,
                                                      ('heads',))}))


def _cope_loop(q, k, v, embedding, visible):
  """Golovneva et al. 2024 eq. 3-5 position by position in float64: gates
  sigma(q.k / sqrt(d)) over visible keys, p_ij the sum of gates from j to
  the last visible key, e[p] interpolated between floor and ceil, clipped
  at P - 1."""
  q, k, v, e = (np.asarray(x, np.float64) for x in (q, k, v, embedding))
  b_, n, h_, d = q.shape
  m, num_positions = k.shape[1], e.shape[1]
  out = np.zeros((b_, n, h_, d))
  for b in range(b_):
    for h in range(h_):
      for i in range(n):
        qi = q[b, i, h] / math.sqrt(d)
        gates = [1 / (1 + math.exp(-qi @ k[b, j, h])) if visible[b, i, j] else 0.0
                 for j in range(m)]
        logits = np.full(m, -np.inf)
        for j in range(m):
          if not visible[b, i, j]:
            continue
          p = min(sum(gates[j:]), num_positions - 1)
          lo, hi = math.floor(p), math.ceil(p)
          e_p = e[:, lo] * (1 - (p - lo)) + e[:, hi] * (p - lo)
          logits[j] = qi @ k[b, j, h] + qi @ e_p
        w = np.exp(logits - logits.max())
        out[b, i, h] = (w / w.sum()) @ v[b, :, h]
  return out


@pytest.mark.parametrize('causal', [True, False], ids=['causal', 'bidirectional'])
def test_cope_equals_a_float64_loop_of_the_paper(causal):
  r = np.random.default_rng(0)
  n, num_positions = 9, 4  # positions past P - 1 = 3 are clipped
  q, k, v = (r.normal(size=(B, n, H, D)).astype(np.float32) for _ in range(3))
  embedding = r.normal(size=(D, num_positions)).astype(np.float32)
  visible = np.ones((B, n, n), bool)
  if causal:
    visible &= np.tril(np.ones((n, n), bool))[None]
  visible[1, :, 7:] = False  # key padding in example 1
  got = registry.get('cope').fn(q, k, v, embedding, mask=jnp.asarray(visible[:, None]),
                                cope_positions_max=num_positions)
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             _cope_loop(q, k, v, embedding, visible), rtol=2e-5, atol=2e-5)


def test_fire_bias_in_row_tiles_equals_the_formula_and_the_untiled_gradient(monkeypatch):
  """A block of more than TILE_ROWS rows runs the MLP a tile at a time
  (recomputed in the backward): the same bias as the float64 formula and
  the same parameter gradients as one pass over the block."""
  from flaxformer_lite.attention.schemes import fire
  _, _, _, params, _ = _inputs('fire', {'fire_threshold_init': 100.0})
  bq, bk = 2 * fire.TILE_ROWS, 37
  q_pos, k_pos = jnp.arange(bq) + 60, jnp.arange(bk) * 5
  got = np.asarray(fire.fire_bias(params, q_pos, k_pos), np.float64)
  for i, j in [(0, 0), (5, 36), (bq - 1, 3), (fire.TILE_ROWS, 20), (bq - 1, bk - 1)]:
    np.testing.assert_allclose(got[:, i, j], _fire_loop(params, 60 + i, 5 * j), rtol=1e-5,
                               atol=1e-5)
  weights = np.random.default_rng(1).normal(size=got.shape).astype(np.float32)
  loss = lambda p: jnp.sum(fire.fire_bias(p, q_pos, k_pos) * weights)
  tiled = jax.grad(loss)(params)
  monkeypatch.setattr(fire, 'TILE_ROWS', 7)  # 256 rows do not divide: one pass
  whole = jax.grad(loss)(params)
  for name in params:
    np.testing.assert_allclose(np.asarray(tiled[name]), np.asarray(whole[name]), rtol=1e-4,
                               atol=1e-4, err_msg=name)


HAND_WRITTEN = [n for n in registry.names() if registry.get(n).terms is not None
                and 'derived_fns' not in registry.get(n).fn.__qualname__]


def test_the_hand_written_dense_forms_are_the_fused_ones_and_shaw_transformer_xl_deberta_local():
  """benchmarks/dense_forms.py: the others' derived dense paths run as fast."""
  assert set(HAND_WRITTEN) == {'dot_product', 'rotary', 'shaw', 'transformer_xl', 'deberta',
                               'local'}


@pytest.mark.parametrize('name', HAND_WRITTEN)
def test_a_hand_written_dense_form_equals_the_one_its_block_terms_give(name):
  """A variant registered with terms= and its own fn (faster, or the paper's
  reference form): both dense paths, outputs and weights, with a causal and
  padding mask and queries at an offset."""
  q, k, v, params, kwargs = _inputs(name, None, seed=2)
  variant = registry.get(name)
  mask = np.arange(M)[None, :] <= Q_OFFSET + np.arange(N)[:, None]
  mask = np.broadcast_to(mask, (B, 1, N, M)).copy()
  mask[1, :, :, 12:] = False  # key padding in example 1
  common = dict(mask=jnp.asarray(mask), bias=None, dropout_rate=0.0, dropout_rng=None,
                deterministic=True, dtype=jnp.float32, return_weights=True)
  offset = {'q_offset': Q_OFFSET} if variant.uses_positions else {}  # as the layer passes it
  got, got_w = variant.fn(q, k, v, **common, **offset, **params, **kwargs)
  want, want_w = reference.dense_attention(q, k, v, variant.terms(H, **kwargs), params,
                                            q_offset=Q_OFFSET, **common)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-5, atol=1e-6)


def test_a_first_lookup_inside_a_traced_function_checks_the_terms_eagerly():
  """A model traced under jit may be the first to look a variant up."""
  registry.register(registry.AttentionVariant(
      name='traced_lookup_test', terms=lambda num_heads: scheme.Terms()))
  try:
    assert jax.jit(lambda x: x + len(registry.get('traced_lookup_test').name))(1) == 19
  finally:
    registry._REGISTRY.pop('traced_lookup_test')  # pylint: disable=protected-access
