"""Masks as functions (masks.Mask) in the kernels: the blockwise kernel takes
any Mask, with no kernel code for it, and equals the dense path.

Every variant in the live registry that has a chunked form runs under one of
four Masks (taken in turn; dot_product and alibi under all four) on b=2 rows of n=19 queries and keys in blocks of 4 (five query and
key blocks, the last one short), so that blocks are empty, partial and full:
  prefix_lm:      a prompt of 7 keys in row 0, none in row 1;
  documents:      packed rows, causal inside each document;
  chunked_causal: causal inside chunks of 10 positions;
  combination:    (causal & key_padding) | (prefix_lm & ~causal), 13 queries
                  at 6..18 (a traced q_offset) against 19 keys: key padding
                  under the diagonal, the prompt above it; in row 1 (no
                  prompt, its first 8 keys padding) queries 6 and 7 see no
                  key (the dense path's uniform rule). prefix_lm itself
                  sees every key up to the query, so or-ed whole it would
                  leave the padding no part.
The dense form gets the mask as a boolean array written here from each
mask's definition (independent of masks.evaluate), the chunked form the
Mask; the outputs and the gradients of q, k, v and every parameter table
must agree. All of it is traced into one jit and compiled once.

Also: the blocks the kernel computes are exactly the non-empty blocks of the
call (forward and backward, each once; the full ones without the select),
counted through blockwise.VISIT_HOOK; and a mask written here in two lines
runs through MultiHeadAttention on both kernels.
"""
import collections
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import masks, registry, select
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.layers import MultiHeadAttention
from tests.xla_options import BLOCK_KERNEL_COMPILE

B, H, D, N, CHUNK = 2, 2, 4, 19, 4
# Small options so that windows, clipping distances and buckets end inside
# these lengths.
OPTIONS = {'shaw': {'max_distance': 3}, 'local': {'window': 3},
           't5_bias': {'num_buckets': 8, 'bucket_max_distance': 4},
           'deberta': {'position_buckets': 4, 'max_relative_positions': 6}}

PREFIX = np.array([7, 0])
DOCUMENTS = np.array([[0] * 12 + [1] * 7, [0] * 9 + [1] * 10])
KEY_VALID = np.ones((B, N), bool)
KEY_VALID[0, [3, 10, 11]] = False
KEY_VALID[1, :8] = False
COMBINATION_OFFSET, COMBINATION_N = 6, 13


def _grid(n, m, q_offset):
  """Index arrays (b, i, j) broadcasting to [B, 1, n, m], i the query's
  index q_offset + row."""
  return (np.arange(B)[:, None, None, None], (q_offset + np.arange(n))[None, None, :, None],
          np.arange(m)[None, None, None, :])


def _cases():
  """{name: (Mask, bool [B, 1, n, m] from its definition, n, q_offset)}."""
  b, i, j = _grid(N, N, 0)
  cases = {
      'prefix_lm': (masks.prefix_lm(PREFIX), (j <= i) | (j < PREFIX[b]), N, 0),
      'documents': (masks.causal() & masks.segments(DOCUMENTS, DOCUMENTS),
                    (j <= i) & (DOCUMENTS[b, i] == DOCUMENTS[b, j]), N, 0),
      'chunked_causal': (masks.chunked_causal(10), (j <= i) & (j // 10 == i // 10), N, 0),
  }
  b, i, j = _grid(COMBINATION_N, N, COMBINATION_OFFSET)
  combination = ((masks.causal() & masks.key_padding(KEY_VALID))
                 | (masks.prefix_lm(PREFIX) & ~masks.causal()))
  cases['combination'] = (combination, ((j <= i) & KEY_VALID[b, j]) | ((j > i) & (j < PREFIX[b])),
                          COMBINATION_N, COMBINATION_OFFSET)
  return cases


CASES = _cases()
VARIANTS = registry.chunked_names()
# Each variant under one mask, the masks taken in turn over the variants, and
# dot_product and alibi under all four: every variant and every mask run, at
# a third of the whole matrix's compile time.
PAIRS = sorted({(name, list(CASES)[i % len(CASES)]) for i, name in enumerate(VARIANTS)}
               | {(name, case) for name in ('dot_product', 'alibi') for case in CASES})


def _params(name, seed):
  """Random values for the tables the variant declares (not the initializers':
  an identity W would hide W)."""
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, OPTIONS.get(name, {}))
  tables = variant.params(H, D, kwargs) if variant.params else {}
  rng = np.random.default_rng(seed)
  return {p: (0.5 * rng.normal(size=shape)).astype(np.float32)
          for p, (shape, _, _) in sorted(tables.items())}


def _inputs(n, seed):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(B, length, H, D)).astype(np.float32) for length in (n, N, N, n)]


def _out_and_grads(fn, q, k, v, params, g):
  out, pull = jax.vjp(fn, q, k, v, params)
  dq, dk, dv, dparams = pull(g)
  return {'out': out, 'dq': dq, 'dk': dk, 'dv': dv, 'dparams': dparams}


def _both(name, mask, dense_mask, q_offset, q, k, v, params, g):
  """(dense, chunked) outputs and gradients of variant `name`."""
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, OPTIONS.get(name, {}))
  dense_kwargs = dict(kwargs)
  if variant.uses_positions:
    dense_kwargs['q_offset'] = q_offset
  if variant.plain_product:
    dense_kwargs['implementation'] = 'dense'

  def dense(q, k, v, p):
    return variant.fn(q, k, v, mask=dense_mask, bias=None, dropout_rate=0.0, dropout_rng=None,
                      deterministic=True, dtype=jnp.float32, return_weights=False, **p,
                      **dense_kwargs)

  def blocks(q, k, v, p):
    return variant.chunked(q, k, v, mask=mask, q_offset=q_offset, chunk_size=CHUNK,
                           dtype=jnp.float32, **p, **kwargs)
  return (_out_and_grads(dense, q, k, v, params, g),
          _out_and_grads(blocks, q, k, v, params, g))


# blockwise.attend's calls while tracing (the fixture counts them): the chunked
# forms must run the block kernel, once.
_ATTEND_CALLS = []
_TRACED_ATTEND_CALLS = {}


def _all(inputs, params, traced_offset):
  results = {}
  for name, case in PAIRS:
    mask, dense_mask, n, q_offset = CASES[case]
    offset = traced_offset if q_offset else 0
    q, k, v, g = inputs[case]
    before = len(_ATTEND_CALLS)
    results[name, case] = _both(name, mask, dense_mask, offset, q, k, v, params[name], g)
    _TRACED_ATTEND_CALLS[name, case] = len(_ATTEND_CALLS) - before
  return results


@pytest.fixture(scope='module')
def results(counting_chunked_attend):
  inputs = {case: _inputs(n, seed) for seed, (case, (_, _, n, _)) in enumerate(CASES.items())}
  params = {name: _params(name, 100 + i) for i, name in enumerate(VARIANTS)}
  with counting_chunked_attend(_ATTEND_CALLS):
    lowered = jax.jit(_all).lower(inputs, params, COMBINATION_OFFSET)
    compiled = lowered.compile(BLOCK_KERNEL_COMPILE)
  return jax.tree.map(np.asarray, compiled(inputs, params, COMBINATION_OFFSET))


def _assert_close(got, want, what, tol=1e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), f'{what}: not finite'
  scale = max(1.0, float(np.max(np.abs(want))))
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def _expected_visits(dense_mask, n, m):
  """{(qb, kb): masked} for the blocks that some real pair of some row sees,
  masked False where every real query of the block sees every key of it in
  every row (keys past m count as hidden), from the dense array."""
  visible = np.broadcast_to(dense_mask, (B, H, n, m))
  want = {}
  for qb in range(-(-n // CHUNK)):
    for kb in range(-(-m // CHUNK)):
      block = visible[:, :, qb * CHUNK:(qb + 1) * CHUNK, kb * CHUNK:(kb + 1) * CHUNK]
      if block.any():
        want[qb, kb] = not (block.all() and kb * CHUNK + CHUNK <= m)
  return want


def test_the_cases_have_empty_partial_and_full_blocks_and_rows_that_see_nothing():
  """Each case's blocks, for the whole call: some skipped, some full, some
  partial; and masks.evaluate gives the arrays written from the definitions."""
  for case, (mask, dense_mask, n, q_offset) in CASES.items():
    visits = _expected_visits(dense_mask, n, N)
    assert 0 < len(visits) < -(-n // CHUNK) * -(-N // CHUNK), case
    assert set(visits.values()) == {False, True}, case
    np.testing.assert_array_equal(
        np.broadcast_to(masks.evaluate(mask, B, H, n, N, q_offset), (B, H, n, N)),
        np.broadcast_to(dense_mask, (B, H, n, N)), err_msg=case)
  assert not CASES['combination'][1][1, 0, :2].any()  # row 1's first two queries see no key


def test_every_variant_and_every_mask_runs():
  assert {name for name, _ in PAIRS} == set(VARIANTS)
  assert {case for _, case in PAIRS} == set(CASES)


@pytest.mark.parametrize('name,case', PAIRS, ids=[f'{n}-{c}' for n, c in PAIRS])
def test_blockwise_output_and_gradients_equal_the_dense_path(results, name, case):
  dense, got = results[name, case]
  assert _TRACED_ATTEND_CALLS[name, case] == 1  # the block kernel ran, once
  assert set(got['dparams']) == set(_params(name, 0))  # every table has a gradient
  for what in ('out', 'dq', 'dk', 'dv'):
    _assert_close(got[what], dense[what], f'{name} {case} {what}')
  for table in dense['dparams']:
    _assert_close(got['dparams'][table], dense['dparams'][table], f'{name} {case} d {table}')


# ---- the blocks visited ------------------------------------------------------------

@pytest.mark.parametrize('case', ['prefix_lm', 'documents'])
def test_the_kernel_computes_exactly_the_non_empty_blocks_once_each(case, monkeypatch):
  mask, dense_mask, n, q_offset = CASES[case]
  visits = collections.Counter()
  monkeypatch.setattr(blockwise, 'UNMASKED_MIN_SCORES', 0)  # full blocks apart at any size
  monkeypatch.setattr(blockwise, 'VISIT_HOOK', lambda pass_name, masked, qb, kb: visits.update(
      [(pass_name, int(qb), int(kb), masked)]))
  q, k, v, g = _inputs(n, 0)

  def grads(q, k, v):
    out, pull = jax.vjp(lambda q, k, v: blockwise.attend(q, k, v, mask=mask, chunk_size=CHUNK),
                        q, k, v)
    return pull(g)
  jax.block_until_ready(jax.jit(grads)(q, k, v))
  jax.effects_barrier()
  want = _expected_visits(dense_mask, n, N)
  for pass_name in ('forward', 'backward'):
    got = {(qb, kb, masked): count for (p, qb, kb, masked), count in visits.items()
           if p == pass_name}
    assert got == {(qb, kb, masked): 1 for (qb, kb), masked in want.items()}, pass_name


# ---- a new mask, no kernel change ----------------------------------------------------

def sentence_or_first_two(sentences):
  """A query sees the keys of its own sentence and the first two keys."""
  return masks.Mask(lambda b, h, q, k: (sentences[b, q] == sentences[b, k]) | (k < 2),
                    'sentence_or_first_two')


def test_a_new_mask_runs_on_both_kernels_through_the_layer():
  sentences = jnp.asarray(np.cumsum(np.random.default_rng(3).random((B, N)) < 0.25, axis=1))
  s = np.asarray(sentences)
  want_mask = (s[:, None, :, None] == s[:, None, None, :]) | (np.arange(N) < 2)
  x = np.random.default_rng(4).normal(size=(B, N, 8)).astype(np.float32)

  def layer(implementation):
    return MultiHeadAttention(num_heads=H, qkv_features=8, attention='alibi', attention_kwargs={
        'kernel': implementation, 'chunk_size': CHUNK})

  params = layer('dense').init(jax.random.key(0), x)['params']

  def run(params, x):
    def loss(implementation, mask, params):
      return jnp.sum(jnp.sin(layer(implementation).apply({'params': params}, x, mask=mask)))
    mask = sentence_or_first_two(sentences)
    return {what: jax.value_and_grad(functools.partial(loss, implementation, m))(params)
            for what, implementation, m in (('reference', 'dense', want_mask),
                                            ('dense', 'dense', mask),
                                            ('chunked', 'chunked', mask))}
  out = jax.jit(run)(nn.unbox(params), x)
  for what in ('dense', 'chunked'):
    _assert_close(out[what][0], out['reference'][0], f'{what} loss')
    jax.tree_util.tree_map_with_path(
        lambda path, got, want, what=what: _assert_close(
            got, want, f'{what} d{jax.tree_util.keystr(path)}'),
        out[what][1], out['reference'][1])


def test_auto_reads_a_rule_only_from_the_rule_constructors():
  """splash takes rules (causal, padding), not functions: a mask made of
  the constructors is read as its rules; any other function, even one that
  computes the causal rule, is not (select.mask_kind None: splash refuses)."""
  assert select.mask_kind(masks.causal() & masks.key_padding(KEY_VALID)) == 'causal'
  assert select.mask_kind(masks.Mask(lambda b, h, q, k: k <= q, 'causal')) is None
  assert select.mask_kind(masks.causal() | masks.causal()) is None
