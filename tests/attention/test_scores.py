"""Every registered scheme's score forms, over the live registry.

A scheme's elementwise `score(s, b, h, q_pos, k_pos, tables)` is what every
kernel derives from: the blockwise kernel calls it on a whole block with the
heads as an index array [h, 1, 1]; a fused kernel calls it on one head's
block with the head as a number. Both calls must give the same scores, and a
scheme's `block_score` (its faster whole-block form) must equal them too, in
value and in the gradients of the scores and the tables.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels import product

B, H, D = 2, 4, 8


def _terms_and_tables(name, q_pos, k_pos, seed=0):
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, {})
  specs = variant.params(H, D, kwargs) if variant.params else {}
  params = scheme.random_params(specs, seed)
  terms = variant.terms(H, **kwargs)
  return terms, scheme.call_tables(terms, params, q_pos, k_pos), params


def _with(attr):
  return [n for n in registry.names()
          if registry.get(n).terms is not None
          and getattr(registry.get(n).terms(H, **registry.resolve_kwargs(n, {})), attr)]


SCORED = _with('score')
BOTH = [n for n in SCORED if n in _with('block_score')]


def test_the_schemes_with_an_elementwise_score_include_the_bias_schemes():
  assert {'alibi', 'kerple', 'fire', 'sandwich', 't5_bias'} <= set(SCORED)
  assert {'t5_bias', 'sandwich', 'fire'} <= set(BOTH)


def _positions(r, bq, bk):
  """A decoding offset's contiguous queries and keys, and sorted random
  positions with gaps (randomized positions, packing)."""
  yield np.arange(40, 40 + bq), np.arange(30, 30 + bk)
  yield (np.sort(r.choice(500, bq, replace=False)), np.sort(r.choice(500, bk, replace=False)))


@pytest.mark.parametrize('name', SCORED)
def test_a_score_called_one_head_at_a_time_equals_the_call_on_every_head(name):
  """What a fused kernel's program computes (one head, a [bq, bk] block, the
  head a number) is the blockwise kernel's [b, h, bq, bk] call's slice."""
  r = np.random.default_rng(1)
  for q_pos, k_pos in _positions(r, 5, 6):
    terms, tables, _ = _terms_and_tables(name, q_pos, k_pos)
    tables = jax.tree.map(jnp.asarray, tables)
    s = jnp.asarray(r.normal(size=(B, H, 5, 6)), jnp.float32)
    qp, kp = jnp.asarray(q_pos)[:, None], jnp.asarray(k_pos)[None, :]
    every = terms.score(s, product.rows(B), product.heads(H), qp, kp, tables)
    assert every.shape == s.shape, name
    for h in range(H):
      one = terms.score(s[1, h], jnp.int32(1), jnp.int32(h), qp, kp, tables)
      np.testing.assert_allclose(np.asarray(one), np.asarray(every[1, h]), rtol=1e-6, atol=1e-6,
                                 err_msg=f'{name} head {h}')


@pytest.mark.parametrize('name', BOTH)
def test_a_block_score_equals_the_elementwise_score_and_its_gradients(name):
  r = np.random.default_rng(2)
  bq, bk = 6, 6
  q_pos, k_pos = np.arange(40, 40 + bq), np.arange(30, 30 + bk)  # block forms read ranges
  terms, _, params = _terms_and_tables(name, q_pos[None], k_pos[None])
  s = jnp.asarray(r.normal(size=(B, H, bq, bk)), jnp.float32)
  cotangent = jnp.asarray(r.normal(size=s.shape), jnp.float32)
  q = jnp.asarray(r.normal(size=(B, bq, H, D)), jnp.float32)
  k = jnp.asarray(r.normal(size=(B, bk, H, D)), jnp.float32)

  def both(s, params):
    tables = scheme.call_tables(terms, params, jnp.asarray(q_pos), jnp.asarray(k_pos))
    block = product.Block(q, k, jnp.asarray(q_pos), jnp.asarray(k_pos), tables)
    elementwise = terms.score(s, product.rows(B), product.heads(H), jnp.asarray(q_pos)[:, None],
                              jnp.asarray(k_pos)[None, :], tables)
    return elementwise, terms.block_score(s, block)

  (e, b), pull = jax.vjp(both, s, params)
  np.testing.assert_allclose(np.asarray(b), np.asarray(e), rtol=1e-5, atol=1e-5)
  ds_e, dp_e = pull((cotangent, jnp.zeros_like(cotangent)))
  ds_b, dp_b = pull((jnp.zeros_like(cotangent), cotangent))
  np.testing.assert_allclose(np.asarray(ds_b), np.asarray(ds_e), rtol=1e-5, atol=1e-5)
  for p in params:
    np.testing.assert_allclose(np.asarray(dp_b[p]), np.asarray(dp_e[p]), rtol=1e-4, atol=1e-4,
                               err_msg=f'{name}: gradient of {p}')


LOOKED_UP = sorted(set(_with('lookups')) | set(_with('value_lookup')))


def _looked_up(terms, s, q, k, tables, q_pos, k_pos):
  """s [b, h, bq, bk] plus every lookup table's entries, read pair by pair
  on whole arrays (q scaled and mapped [b, bq, h, d], k mapped)."""
  for lookup in terms.lookups:
    rows = lookup.rows(q, k, tables)  # [b, h, bq | bk, R]
    idx = jnp.broadcast_to(lookup.index(q_pos[:, None], k_pos[None, :]), s.shape[2:])
    if lookup.side == 'query':
      s = s + jnp.take_along_axis(rows, idx[None, None], axis=3)
    else:
      s = s + jnp.swapaxes(jnp.take_along_axis(rows, idx.T[None, None], axis=3), 2, 3)
  return s


@pytest.mark.parametrize('name', LOOKED_UP)
def test_lookups_equal_the_block_score_and_a_value_lookup_the_values_term(name):
  """What the fused kernel runs in place of a block_score and a values term:
  the lookup tables (Terms.lookups) add what block_score adds, and the
  value lookup adds to p.v what the values term does, with their gradients
  in the parameters; a block away from the diagonal (decoding offset)."""
  r = np.random.default_rng(3)
  bq, bk = 6, 7
  q_pos, k_pos = jnp.arange(40, 40 + bq), jnp.arange(30, 30 + bk)
  terms, _, params = _terms_and_tables(name, q_pos[None], k_pos[None])
  s = jnp.asarray(r.normal(size=(B, H, bq, bk)), jnp.float32)
  p = jnp.asarray(r.uniform(size=(B, H, bq, bk)), jnp.float32)
  q = jnp.asarray(r.normal(size=(B, bq, H, D)), jnp.float32)
  k, v = (jnp.asarray(r.normal(size=(B, bk, H, D)), jnp.float32) for _ in range(2))

  def both(params):
    tables = scheme.call_tables(terms, params, q_pos, k_pos)
    qm = q if terms.transform_q is None else terms.transform_q(q, tables, q_pos, k_pos[0])
    km = k if terms.transform_k is None else terms.transform_k(k, tables, k_pos, k_pos[0])
    block = product.Block(qm, km, q_pos, k_pos, tables)
    scores = (_looked_up(terms, s, qm, km, tables, q_pos, k_pos),
              s if terms.block_score is None else terms.block_score(s, block))
    if terms.value_lookup is None:
      return scores, (0.0, 0.0)
    lookup = terms.value_lookup
    rows = tables[lookup.table][lookup.index(q_pos[:, None], k_pos[None, :])]  # [bq, bk, dv]
    values = product.dot_values(p, v, tables, q_pos, k_pos) + jnp.einsum('bhqk,qkd->bhqd', p,
                                                                         rows)
    return scores, (values, terms.values(p, v, tables, q_pos, k_pos))

  ((got_s, want_s), (got_v, want_v)), pull = jax.vjp(both, params)
  np.testing.assert_allclose(np.asarray(got_s), np.asarray(want_s), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_v), np.asarray(want_v), rtol=1e-5, atol=1e-5)
  cot_s = jnp.asarray(r.normal(size=s.shape), jnp.float32)
  cot_v = jax.tree.map(lambda x: jnp.asarray(r.normal(size=jnp.shape(x)), jnp.float32), got_v)
  zero = lambda x: jax.tree.map(jnp.zeros_like, x)  # noqa: E731
  (d_got,) = pull(((cot_s, zero(cot_s)), (cot_v, zero(cot_v))))
  (d_want,) = pull(((zero(cot_s), cot_s), (zero(cot_v), cot_v)))
  for name_p in params:
    np.testing.assert_allclose(np.asarray(d_got[name_p]), np.asarray(d_want[name_p]), rtol=1e-4,
                               atol=1e-4, err_msg=f'{name}: gradient of {name_p}')


def test_a_score_declared_additive_must_add_a_bias():
  """additive=True lets the kernels add score(0) once for the batch: a score
  that scales s, or one whose bias differs between batch rows, fails the
  check (scheme.check_terms, run on every registered scheme by
  test_registry.py), and alibi and kerple (biases) are declared additive."""
  for name in ('alibi', 'kerple'):
    assert registry.get(name).terms(H, **registry.resolve_kwargs(name, {})).additive
  scaled = scheme.Terms(score=lambda s, b, h, q_pos, k_pos, tables: 2.0 * s, additive=True)
  with pytest.raises(TypeError, match="'scaled_test': Terms\\(additive=True\\) but its "
                                      'score is not s \\+ score\\(0\\)'):
    scheme.check_terms('scaled_test', scaled, {}, H, D)
  by_row = scheme.Terms(score=lambda s, b, h, q_pos, k_pos, tables: s + b, additive=True)
  with pytest.raises(TypeError, match='one bias for every batch row'):
    scheme.check_terms('by_row', by_row, {}, H, D)
  bias = scheme.Terms(score=lambda s, b, h, q_pos, k_pos, tables: s + (q_pos - k_pos) * h,
                      additive=True)
  scheme.check_terms('bias', bias, {}, H, D)
