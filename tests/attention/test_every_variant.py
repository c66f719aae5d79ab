"""Properties every registered variant's `return_weights=True` must have.

Each variant is called through its registry entry, as MultiHeadAttention calls
it (parameters from `AttentionVariant.params`, options from `resolve_kwargs`,
`q_offset` / `rng` / `prev_alignment` where the entry asks for them), with
default options: keys outnumber every default window (local 8, local-m/p 8)
and shaw's clipping distance (16). The weights [b, h, n, m] must put exactly 0
on masked keys and sum to 1 over the visible ones (luong_local_p: at most 1,
its documented Gaussian factor; hard: one key, weight 1), and the output must
be the weights applied to the values (shaw: sum_j alpha_ij (v_j + a^V_ij),
recomputed here with a loop, with the weights themselves).

Also, for every variant that reads positions: the cached decoder's calls
(queries t.. at q_offset=t, traced) give the full causal pass's rows; and for
every variant, through the layer: finite gradients that reach the query, key
and value projections and each parameter the variant declares.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry
from flaxformer_lite.layers import MultiHeadAttention

B, N, M, H, D = 2, 16, 20, 2, 4
Q_OFFSET = 4  # queries at absolute positions 4..19, keys at 0..19
PADDED = 15  # example 1 has keys 0..14

# Every variant, and every form of those whose option picks a code path.
FORMS = {'local': [{'causal': False}, {'causal': True}]}
CASES = [(name, extra) for name in registry.names() for extra in FORMS.get(name, [{}])]
CASE_IDS = [name + ''.join(f'-{k}={v}' for k, v in extra.items()) for name, extra in CASES]
# Documented to sum to less than 1 (a Gaussian factor after the softmax).
BELOW_ONE = {'luong_local_p'}


def _mask():
  """[b, 1, n, m]: example 0 causal (key j <= query position), example 1 key
  padding with a fully masked first query row. Every other row sees a key
  inside every variant's window."""
  mask = np.zeros((B, 1, N, M), bool)
  mask[0, 0] = np.arange(M)[None] <= Q_OFFSET + np.arange(N)[:, None]
  mask[1, 0, 1:, :PADDED] = True
  return mask


def _call(name, extra, rng=None):
  """-> (inputs {q, k, v [b, *, h, d], bias [1, h, n, m], params}, out [b, n, h, d],
  weights [b, h, n, m] float64). `rng`: hard attention's training draw."""
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, extra)
  r = np.random.default_rng(0)
  normal = lambda *shape: r.normal(size=shape).astype(np.float32)
  x = dict(q=normal(B, N, H, D), k=normal(B, M, H, D), v=normal(B, M, H, D),
           bias=0.5 * normal(1, H, N, M))
  tables = variant.params(H, D, kwargs) if variant.params else {}
  # The names and shapes the layer would create; random values (an identity W would hide W).
  x['params'] = {p: 0.5 * normal(*shape) for p, (shape, _, _) in sorted(tables.items())}
  if variant.uses_positions:
    kwargs['q_offset'] = Q_OFFSET
  if variant.stochastic:
    kwargs['rng'] = rng
  if variant.uses_alignment:
    kwargs['prev_alignment'] = np.abs(normal(B, H, N, M))
  out, weights = variant.fn(
      x['q'], x['k'], x['v'], mask=jnp.asarray(_mask()), bias=x['bias'], dropout_rate=0.0,
      dropout_rng=None, deterministic=True, dtype=jnp.float32, return_weights=True,
      **x['params'], **kwargs)
  return x, np.asarray(out), np.asarray(weights, np.float64)


def _shaw_loop(x, weights):
  """Shaw et al. eq. 3-5 position by position, in float64: (the softmax of
  (q_i.(k_j + a^K_ij)) / sqrt(d) + bias over visible keys, uniform where none
  is; sum_j alpha_ij (v_j + a^V_ij) with alpha = `weights`), a^K_ij, a^V_ij
  the table rows at clip(j - (i + q_offset), -r, r) + r."""
  q, k, v, bias = (np.asarray(x[t], np.float64) for t in ('q', 'k', 'v', 'bias'))
  a_k, a_v = (np.asarray(x['params'][t], np.float64)
              for t in ('rel_key_table', 'rel_value_table'))
  r = (a_k.shape[0] - 1) // 2
  mask = _mask()
  want_weights, want_out = np.zeros((B, H, N, M)), np.zeros((B, N, H, D))
  for b in range(B):
    for h in range(H):
      for i in range(N):
        rel = [min(max(j - (Q_OFFSET + i), -r), r) + r for j in range(M)]
        logits = np.array([q[b, i, h] @ (k[b, j, h] + a_k[rel[j]]) / math.sqrt(D)
                           + bias[0, h, i, j] for j in range(M)])
        visible = mask[b, 0, i]
        if visible.any():
          e = np.where(visible, np.exp(logits - logits[visible].max()), 0.0)
          want_weights[b, h, i] = e / e.sum()
        else:  # softmax_weights' rule
          want_weights[b, h, i] = 1 / M
        for j in range(M):
          want_out[b, i, h] += weights[b, h, i, j] * (v[b, j, h] + a_v[rel[j]])
  return want_weights, want_out


@pytest.mark.parametrize('name,extra', CASES, ids=CASE_IDS)
def test_weights_masked_keys_zero_rows_normalised_output_is_weighted_values(name, extra):
  x, out, weights = _call(name, extra)
  assert weights.shape == (B, H, N, M) and out.shape == (B, N, H, D)
  assert np.all(np.isfinite(weights)) and np.all(np.isfinite(out))
  mask = np.broadcast_to(_mask(), weights.shape)
  rows = mask.any(-1)  # [b, h, n]: the rows with a visible key
  np.testing.assert_array_equal(weights[~mask & rows[..., None]], 0.0)
  assert np.all(weights >= 0)
  total = weights.sum(-1)
  if name in BELOW_ONE:
    assert np.all(total <= 1 + 1e-6) and np.all(total[rows] > 0)
  else:
    np.testing.assert_allclose(total, 1.0, atol=1e-5)
  if name == 'hard':  # eval: the one chosen key gets exactly 1
    np.testing.assert_array_equal(np.sort(weights[rows], -1)[:, -2:], [[0.0, 1.0]] * rows.sum())
  if not any('window' in option for option in registry.get(name).kwargs):
    # A fully masked row is uniform over all keys (softmax_weights' rule; windowed
    # variants spread it over their window instead, softmax.window_softmax).
    np.testing.assert_allclose(weights[~rows], 1 / M, atol=1e-6)
  if name == 'shaw':
    want_weights, want_out = _shaw_loop(x, weights)
    np.testing.assert_allclose(weights, want_weights, atol=1e-6)
  else:
    want_out = np.einsum('bhnm,bmhd->bnhd', weights, np.asarray(x['v'], np.float64))
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)


def test_hard_attention_training_draws_are_one_visible_key():
  _, _, weights = _call('hard', {}, rng=jax.random.PRNGKey(3))
  mask = np.broadcast_to(_mask(), weights.shape)
  rows = mask.any(-1)
  np.testing.assert_array_equal(weights[~mask & rows[..., None]], 0.0)
  np.testing.assert_array_equal(np.sort(weights[rows], -1)[:, -2:], [[0.0, 1.0]] * rows.sum())


# ---- the cached decoder's calls: a step's rows are the full causal pass's ----------

# Options that put windows, clipping distances and far buckets inside DECODE_N
# tokens; t5_bias unidirectional, as a decoder's.
DECODE_OPTIONS = {'local': {'window': 3}, 'shaw': {'max_distance': 3},
                  't5_bias': {'num_buckets': 8, 'bucket_max_distance': 6, 'bidirectional': False},
                  'luong_local_m': {'half_window': 2},
                  'deberta': {'position_buckets': 4, 'max_relative_positions': 6}}
# Every variant that reads the queries' position (q_offset, the cache index
# when decoding).
DECODERS = [name for name in registry.names() if registry.get(name).uses_positions]
DECODE_N = 12
# (first query, number of queries) of each call: single tokens and chunks.
DECODE_STEPS = [(0, 1), (1, 1), (2, 3), (5, 1), (6, 3), (9, 3)]


@pytest.mark.parametrize('name', DECODERS)
def test_decoding_rows_equal_the_full_causal_pass(name):
  """The cached decoder's call: keys 0..n-1, queries t..t+size-1 at q_offset=t
  (traced), the causal mask's rows; equal to those rows of the full causal
  pass."""
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, DECODE_OPTIONS.get(name, {}))
  r = np.random.default_rng(5)
  n = DECODE_N
  q = jnp.asarray(2 * r.normal(size=(B, n, H, D)), jnp.float32)
  k, v = (jnp.asarray(r.normal(size=(B, n, H, D)), jnp.float32) for _ in range(2))
  tables = variant.params(H, D, kwargs) if variant.params else {}
  params = {p: jnp.asarray(0.5 * r.normal(size=shape), jnp.float32)
            for p, (shape, _, _) in sorted(tables.items())}
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]

  @jax.jit
  def call(q, q_offset, mask):
    return variant.fn(q, k, v, mask=mask, bias=None, dropout_rate=0.0, dropout_rng=None,
                      deterministic=True, dtype=jnp.float32, return_weights=False,
                      q_offset=q_offset, **params, **kwargs)

  full = np.asarray(call(q, 0, causal))
  assert np.all(np.isfinite(full))
  for t, size in DECODE_STEPS:
    got = call(q[:, t:t + size], t, causal[:, :, t:t + size])
    np.testing.assert_allclose(np.asarray(got), full[:, t:t + size], atol=1e-6,
                               err_msg=f'rows {t}..{t + size - 1}')


# ---- gradients, through the layer ------------------------------------------------


@pytest.mark.parametrize('name', registry.names())
def test_layer_gradients_are_finite_and_reach_the_projections_and_the_variant_params(name):
  """MultiHeadAttention in training (dropout's rng given: hard attention
  draws), causal with example 1's last 2 keys padding and a query row of
  example 0 that sees no key: every gradient is finite, and those of the
  query, key and value projections and of each parameter the variant
  declares are non-zero."""
  n = 6
  x = jnp.asarray(np.random.default_rng(14).normal(size=(2, n, 8)).astype(np.float32))
  valid = np.arange(n)[None] < np.array([[n], [n - 2]])  # [2, n]
  mask = valid[:, None, None, :] & np.tril(np.ones((n, n), bool))[None, None]
  mask[0, 0, 3] = False  # a row that sees no key
  prev = jax.nn.softmax(jnp.asarray(np.random.default_rng(15).normal(size=(2, 2, n, n))), -1)
  layer = MultiHeadAttention(num_heads=2, attention=name)
  params = nn.unbox(layer.init(jax.random.PRNGKey(0), x))['params']

  def loss(params):
    y = layer.apply({'params': params}, x, mask=jnp.asarray(mask), prev_alignment=2.0 * prev,
                    deterministic=False, rngs={'dropout': jax.random.PRNGKey(2)})
    return jnp.sum(jnp.sin(y))

  grads = jax.jit(jax.grad(loss))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(np.asarray(g))), path
  variant = registry.get(name)
  own = variant.params(2, 4, registry.resolve_kwargs(name, None)) if variant.params else {}
  for param in [*own, 'query', 'key', 'value']:
    assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(grads[param])) > 0, param
