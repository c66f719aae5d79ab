"""The chunked kernel (blockwise.attend) and every variant's chunked form,
against the dense path (the reference for every fast path) and float64 loops.

Every variant in the live registry that has a chunked form is called as
MultiHeadAttention calls it: the dense form with the Mask evaluated
(masks.evaluate), the chunked form with the Mask itself. Two mask
configurations, each with a chunk size (8) that divides neither length:
  causal:        n=19 queries at positions 3..21, m=27 keys, causal, key and
                 query padding;
  bidirectional: n=27 queries at positions 5..31, m=19 keys (queries past
                 the last key: local's windows run empty), padding and a
                 boolean array (what a user may pass the layer).
Example 0 has random key and query padding, example 1 no key at all (every
row fully masked: the dense path's uniform rule), example 2 none.

The outputs and the gradients of query, key, value and every parameter table
must match the dense form's. All cases are traced into one jit and compiled
once with XLA:CPU's LLVM code generation at -O0: far less compile time than a
compilation per case at full optimisation (XLA's HLO passes still run).

The two skew helpers the relative forms use per block (rel_shift, by_offset)
are checked index by index against their formulas.
"""
import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.attention import masks, registry, scheme
from flaxformer_lite.attention.kernels.reference import dot_product_attention
from flaxformer_lite.attention.kernels import blockwise, product
from tests.xla_options import BLOCK_KERNEL_COMPILE

B, H, D, CHUNK = 3, 2, 4, 8
CONFIGS = {
    'causal': dict(n=19, m=27, q_offset=3, causal=True, dense=False),
    'bidirectional': dict(n=27, m=19, q_offset=5, causal=False, dense=True),
}
# Options that make far blocks occur at these lengths (shaw: blocks wholly
# beyond the clipping distance; t5: blocks wholly in one bucket; deberta: log
# buckets and clamped rows), and every form whose option picks a code path.
FORMS = {
    'shaw': [{'max_distance': 3}, {'max_distance': 5, 'relative_keys': False}],
    'local': [{'window': 4, 'causal': False}, {'window': 4, 'causal': True}],
    't5_bias': [{'num_buckets': 8, 'bucket_max_distance': 4},
                {'num_buckets': 8, 'bucket_max_distance': 6, 'bidirectional': False}],
    # deberta: offsets past 2 share clamped rows, so its row table stops at
    # deberta.saturation (6) plus a block, and far blocks read its end rows; the
# paper's p2c row here, the released one (the default) in test_chunked_models.
    'deberta': [{'position_buckets': 4, 'max_relative_positions': 4, 'p2c_row': 'paper'}],
}
VARIANTS = [(name, extra) for name in registry.chunked_names()
            for extra in FORMS.get(name, [{}])]
VARIANT_IDS = [name + ''.join(f'-{k}={v}' for k, v in extra.items()) for name, extra in VARIANTS]
CASES = [(i, config) for i in range(len(VARIANTS)) for config in CONFIGS]
CASE_IDS = [f'{VARIANT_IDS[i]}-{config}' for i, config in CASES]


def _compile(fn, *args):
  return jax.jit(fn).lower(*args).compile(BLOCK_KERNEL_COMPILE)


def _inputs(config, dtype=np.float32):
  """q [b, n, h, d], k, v [b, m, h, d], cotangent [b, n, h, d] and the
  mask's arrays, for a configuration."""
  c = CONFIGS[config]
  n, m = c['n'], c['m']
  rng = np.random.default_rng(len(config))
  normal = lambda *shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
  key_valid = np.ones((B, m), bool)
  key_valid[0] = rng.random(m) < 0.75
  key_valid[0, -1] = False
  key_valid[1] = False  # no key at all
  query_valid = np.ones((B, n), bool)
  query_valid[0] = rng.random(n) < 0.8
  query_valid[0, 0] = False
  arrays = dict(q=normal(B, n, H, D), k=normal(B, m, H, D), v=normal(B, m, H, D),
                g=normal(B, n, H, D), key_valid=key_valid, query_valid=query_valid)
  if c['dense']:
    arrays['dense'] = rng.random((B, 1, n, m)) < 0.85
  return arrays


def _spec(config, arrays):
  c = CONFIGS[config]
  mask = masks.key_padding(arrays['key_valid']) & masks.query_padding(arrays['query_valid'])
  if 'dense' in arrays:
    mask = mask & masks.as_mask(arrays['dense'], c['q_offset'])
  return masks.causal() & mask if c['causal'] else mask


def _dense_mask(spec, n, m, q_offset):
  """The mask as the dense form takes it: a boolean array, or None."""
  return None if spec is None else masks.evaluate(spec, B, H, n, m, q_offset)


def _params(index, dtype=np.float32):
  """Random values (not the initializers': an identity W would hide W) for the
  tables AttentionVariant.params declares."""
  name, extra = VARIANTS[index]
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, extra)
  tables = variant.params(H, D, kwargs) if variant.params else {}
  rng = np.random.default_rng(100 + index)
  return {p: (0.5 * rng.normal(size=shape)).astype(dtype)
          for p, (shape, _, _) in sorted(tables.items())}


def _dense_fn(index, spec, n, m, q_offset, dtype=jnp.float32):
  """(q, k, v, params) -> out: the dense form, as MultiHeadAttention calls it."""
  name, extra = VARIANTS[index]
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, extra)
  if variant.uses_positions:
    kwargs['q_offset'] = q_offset
  if variant.plain_product:
    kwargs['implementation'] = 'dense'

  def fn(q, k, v, params):
    return variant.fn(q, k, v, mask=_dense_mask(spec, n, m, q_offset), bias=None, dropout_rate=0.0,
                      dropout_rng=None, deterministic=True, dtype=dtype, return_weights=False,
                      **params, **kwargs)
  return fn


def _chunked_fn(index, spec, q_offset, dtype=jnp.float32, chunk_size=CHUNK):
  """(q, k, v, params) -> out: the chunked form, as MultiHeadAttention calls it."""
  name, extra = VARIANTS[index]
  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, extra)

  def fn(q, k, v, params):
    return variant.chunked(q, k, v, mask=spec, q_offset=q_offset, chunk_size=chunk_size,
                           dtype=dtype, **params, **kwargs)
  return fn


def _out_and_grads(fn, q, k, v, params, g):
  out, pull = jax.vjp(fn, q, k, v, params)
  dq, dk, dv, dparams = pull(g.astype(out.dtype))
  return {'out': out, 'dq': dq, 'dk': dk, 'dv': dv, 'dparams': dparams}


# blockwise.attend's calls while tracing (the fixture counts them): the chunked
# forms must run the block kernel, not fall back on a dense computation.
_ATTEND_CALLS = []
_TRACED_ATTEND_CALLS = {}


def _all_cases(inputs, params, q_offsets):
  """Every case's dense and chunked results; q_offsets {config: traced int}."""
  results = {}
  for index, config in CASES:
    x, p = inputs[config], params[index]
    c = CONFIGS[config]
    spec = _spec(config, x)
    args = (x['q'], x['k'], x['v'], p, x['g'])
    dense = _out_and_grads(_dense_fn(index, spec, c['n'], c['m'], c['q_offset']), *args)
    before = len(_ATTEND_CALLS)
    # q_offset traced, as when decoding with a cache
    got = _out_and_grads(_chunked_fn(index, spec, q_offsets[config]), *args)
    _TRACED_ATTEND_CALLS[index, config] = len(_ATTEND_CALLS) - before
    results[index, config] = {'dense': dense, 'chunked': got}
    if config == 'causal':
      # bfloat16 compute, float32 tables (as the layer's param_dtype)
      q, k, v = (x[t].astype(jnp.bfloat16) for t in 'qkv')
      results[index, config]['dense_bf16'] = _dense_fn(
          index, spec, c['n'], c['m'], c['q_offset'], jnp.bfloat16)(q, k, v, p)
      results[index, config]['chunked_bf16'] = _chunked_fn(
          index, spec, c['q_offset'], jnp.bfloat16)(q, k, v, p)
  return results


@pytest.fixture(scope='module')
def cases(counting_chunked_attend):
  """(results of every case, the compiled function and its arguments: one
  compilation for the whole module's comparisons)."""
  inputs = {config: _inputs(config) for config in CONFIGS}
  params = [_params(i) for i in range(len(VARIANTS))]
  offsets = {config: c['q_offset'] for config, c in CONFIGS.items()}
  with counting_chunked_attend(_ATTEND_CALLS):
    compiled = _compile(_all_cases, inputs, params, offsets)
  results = jax.tree.map(np.asarray, compiled(inputs, params, offsets))
  return results, compiled, (inputs, params, offsets)


def _assert_close(got, want, what, tol=1e-5):
  """|got - want| <= tol * (|want| + max(1, max|want|)): float32 rounding of
  sums over blocks in another order, far below any wrong term."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), f'{what}: not finite'
  scale = max(1.0, float(np.max(np.abs(want))))
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


@pytest.mark.parametrize('index,config', CASES, ids=CASE_IDS)
def test_output_and_every_gradient_equal_the_dense_form(cases, index, config):
  results, _, _ = cases
  dense, got = results[index, config]['dense'], results[index, config]['chunked']
  assert _TRACED_ATTEND_CALLS[index, config] == 1  # the block kernel ran, once
  assert set(got['dparams']) == set(_params(index))  # every table has a gradient
  for what in ('out', 'dq', 'dk', 'dv'):
    _assert_close(got[what], dense[what], what)
  for table in dense['dparams']:
    _assert_close(got['dparams'][table], dense['dparams'][table], f'd {table}')


@pytest.mark.parametrize('index', range(len(VARIANTS)), ids=VARIANT_IDS)
def test_bfloat16_close_to_dense_bfloat16_and_to_float32(cases, index):
  """bfloat16 keeps 8 significant bits: the chunked form's output is within
  that of the dense bfloat16 output, and its error against the float32
  result (root mean square, a steadier measure than the maximum) is of the
  dense bfloat16 form's size, not more (measured: 0.66 to 0.98 of it)."""
  results, _, _ = cases
  r = results[index, 'causal']
  got, dense, exact = (np.asarray(x, np.float64)
                       for x in (r['chunked_bf16'], r['dense_bf16'], r['dense']['out']))
  assert r['chunked_bf16'].dtype == jnp.bfloat16 and np.all(np.isfinite(got))
  scale = max(1.0, float(np.max(np.abs(exact))))
  np.testing.assert_allclose(got, dense, atol=0.03 * scale)
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
  assert rms(got - exact) <= 1.5 * rms(dense - exact), (rms(got - exact), rms(dense - exact))


def test_bfloat16_backward_multiplies_in_bfloat16_as_accurately_as_dense():
  """FlashAttention-2's bfloat16 backward: dO and ds in bfloat16, so every
  matmul of the gradient (dot_general) takes two bfloat16 operands (and
  accumulates in float32), and each gradient's error against the float32
  one (root mean square) is of the dense bfloat16 gradient's size (measured:
  1.0 to 1.2 of it). Causal, n = m = 64, chunk 16."""
  n, chunk = 64, 16
  rng = np.random.default_rng(11)
  q, k, v, g = (rng.normal(size=(2, n, H, 8)).astype(np.float32) for _ in range(4))
  spec = masks.causal()
  fns = {'dense': lambda q, k, v: dot_product_attention(q, k, v, mask=_dense_mask(spec, n, n, 0)),
         'chunked': lambda q, k, v: registry.get('dot_product').chunked(
             q, k, v, mask=spec, chunk_size=chunk)}

  def grads(fn, dtype):
    out, pull = jax.vjp(fn, *(jnp.asarray(x, dtype) for x in (q, k, v)))
    return pull(jnp.asarray(g, out.dtype))

  exact = [np.asarray(x, np.float64) for x in jax.jit(grads, static_argnums=(0, 1))(
      fns['dense'], jnp.float32)]
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
  errors = {}
  for name, fn in fns.items():
    got = jax.jit(grads, static_argnums=(0, 1))(fn, jnp.bfloat16)
    errors[name] = [rms(np.asarray(x, np.float64) - e) / rms(e) for x, e in zip(got, exact)]
  for what, c, d in zip(('dq', 'dk', 'dv'), errors['chunked'], errors['dense']):
    assert c <= 1.5 * d, (what, c, d)
  hlo = jax.jit(grads, static_argnums=(0, 1)).lower(fns['chunked'], jnp.bfloat16).as_text()
  # The matmuls (4-d results); D = rowsum(dO * O) is a float32 row-wise dot, as in FA-2.
  matmuls = [line for line in hlo.splitlines() if 'stablehlo.dot_general' in line
             and line.split('-> tensor<')[1].count('x') == 4]
  assert len(matmuls) >= 6, matmuls  # two forward, four backward
  for line in matmuls:
    operands = line.split(': (')[1].split(') ->')[0]
    assert operands.count('bf16>') == 2, line


# ---- determinism ----------------------------------------------------------------

WITH_TABLES = [i for i in range(len(VARIANTS)) if _params(i)]


@pytest.mark.parametrize('index', WITH_TABLES, ids=[VARIANT_IDS[i] for i in WITH_TABLES])
def test_table_gradients_are_deterministic_and_built_without_scatter(cases, index):
  """Two runs give bitwise-equal table gradients, and their program holds no
  scatter (XLA:GPU's scatter-add is the op whose order varies run to run; the
  dense path's gather-based tables have one in their gradient)."""
  results, compiled, args = cases
  again = compiled(*args)
  for config in CONFIGS:
    for table, want in results[index, config]['chunked']['dparams'].items():
      np.testing.assert_array_equal(np.asarray(again[index, config]['chunked']['dparams'][table]),
                                    want, err_msg=f'{config} d {table}')
  x = _inputs('causal')
  spec = _spec('causal', x)
  fn = _chunked_fn(index, spec, CONFIGS['causal']['q_offset'])
  grad = jax.grad(lambda p: jnp.sum(fn(x['q'], x['k'], x['v'], p) * x['g']))
  hlo = jax.jit(grad).lower(_params(index)).as_text()
  assert 'scatter' not in hlo


# ---- hidden blocks are not computed -----------------------------------------------

def _poisoned_terms(structural):
  """Terms whose scores and values are NaN in a block where the causal /
  window rule allows no pair: such a block, if it ran, would turn the output
  (forward) or the gradients (backward) into NaN.

  The block's positions are those the kernel sees, padding rows and columns
  included: a block visible only to the padding rows of the last query block
  does run (n=21, q_offset=7, chunk 4, causal: key block 28..31 for real query
  position 27 alone), a cost of at most one block per row or column of blocks,
  not a wrong result.
  """
  def hidden(q_pos, k_pos):
    return ~jnp.any(structural(q_pos[:, None], k_pos[None, :]))

  def score(s, block):
    return s * jnp.where(hidden(block.q_pos, block.k_pos), jnp.nan, 1.0)

  def values(p, v, tables, q_pos, k_pos):
    poison = jnp.where(hidden(q_pos, k_pos), jnp.nan, 1.0)
    return product.dot_values(p, v, tables, q_pos, k_pos) * poison
  return scheme.Terms(block_score=score, values=values, uniform=scheme.mean_values)


SKIP_MASKS = {
    'causal': masks.causal(),
    'window': masks.sliding_window(3),
    'window_causal': masks.sliding_window(5, True),
    'causal_and_window': masks.causal() & masks.sliding_window(6),
}
# (mask, q_offset); offset 7 is traced
SKIP_CASES = [('causal', 7), ('window', 0), ('window', 7), ('window_causal', 7),
              ('causal_and_window', 0)]


def test_hidden_blocks_are_skipped_forward_and_backward():
  """Blocks wholly hidden by the causal or window parts never run: with
  NaN-poisoned block terms there, the output and gradients stay finite and
  equal dense dot-product attention. n=21 queries, m=29 keys, chunk 4."""
  n, m, chunk = 21, 29, 4
  rng = np.random.default_rng(7)
  q, k, v, g = (rng.normal(size=(2, length, H, D)).astype(np.float32)
                for length in (n, m, m, n))

  def run(traced_offset):
    out = {}
    for name, q_offset in SKIP_CASES:
      spec = SKIP_MASKS[name]
      offset = traced_offset if q_offset == 7 else q_offset
      terms = _poisoned_terms(lambda q_pos, k_pos, spec=spec: spec(0, 0, q_pos, k_pos))
      fn = functools.partial(blockwise.attend, terms=terms, mask=spec, q_offset=offset,
                             chunk_size=chunk)
      scale = 1 / math.sqrt(D)
      got = _out_and_grads(lambda q, k, v, p: fn(q * scale, k, v), q, k, v, {}, g)

      def dense(q, k, v, p, spec=spec, q_offset=q_offset):
        return dot_product_attention(q, k, v, mask=_dense_mask(spec, n, m, q_offset))
      out[name, q_offset] = got, _out_and_grads(dense, q, k, v, {}, g)
    return out

  results = _compile(run, 7)(7)
  for (name, q_offset), (got, want) in results.items():
    for what in ('out', 'dq', 'dk', 'dv'):
      _assert_close(got[what], want[what], f'{name} q_offset={q_offset} {what}')


def _paddings(rng, rows: int, length: int):
  """bool [rows, length] valid-token masks: none hidden, a PAD tail of a
  different length in each row (what the data pipeline makes), and PAD
  tokens anywhere."""
  tails = np.arange(length)[None] < length - rng.integers(0, length // 2, size=(rows, 1))
  return {'none': np.ones((rows, length), bool), 'tails': tails,
          'anywhere': rng.random((rows, length)) < 0.9}


@pytest.mark.parametrize('causal', [True, False], ids=['causal', 'bidirectional'])
def test_each_block_row_lists_exactly_the_blocks_of_each_state(causal):
  """mask_blocks' lists against the dense mask, block by block: per query
  block, its FULL key blocks (every pair of real queries and keys seen, in
  every row of the batch, keys all real), its DIAGONAL ones (with the
  staircase on: some pair seen, none above the block's diagonal, in every
  row that sees one) and PARTIAL ones (the others with a pair seen), each
  list in order; per key block the same by query block. No padding, PAD
  tails, PAD tokens anywhere; decoding offsets; small blocks (one list)."""
  rng = np.random.default_rng(4)
  configs = [(21, 29, 0, 4), (21, 29, 5, 8), (24, 24, 0, 8), (24, 24, 0, 5), (7, 30, 23, 4)]
  for n, m, q_offset, chunk in configs:
    key_paddings, query_paddings = _paddings(rng, 2, m), _paddings(rng, 2, n)
    for padding in key_paddings:
      spec = masks.key_padding(key_paddings[padding]) & masks.query_padding(
          query_paddings[padding])
      spec = masks.causal() & spec if causal else spec
      for split, rise in ((True, chunk // 2 if chunk % 2 == 0 else None), (False, None)):
        blocks = blockwise.plan(2, 1, n, m, chunk, 0.0)
        blocks = dataclasses.replace(blocks, split=split, rise=rise)
        got = blockwise.mask_blocks(spec, q_offset, 2, 1, blocks)
        want = _states_by_hand(np.asarray(masks.evaluate(spec, 2, 1, n, m, q_offset))[:, 0],
                               chunk, split, rise is not None)
        for lists, states in ((got.by_query, want), (got.by_key, want.T)):
          for state, (cols, count) in zip(blocks.visited, lists):
            for row in range(states.shape[0]):
              listed = list(np.asarray(cols[row, :int(count[row])]))
              assert listed == list(np.flatnonzero(states[row] == state)), (
                  n, m, q_offset, chunk, padding, split, state, row)


def _states_by_hand(dense, chunk, split, diagonal):
  """dense bool [b, n, m] -> int8 [nq, nk], mask_blocks' states for the call."""
  b, n, m = dense.shape
  nq, nk = -(-n // chunk), -(-m // chunk)
  out = np.zeros((nq, nk), np.int8)
  above = np.arange(chunk)[None, :] > np.arange(chunk)[:, None]
  for qb, kb in itertools.product(range(nq), range(nk)):
    cells = dense[:, qb * chunk:(qb + 1) * chunk, kb * chunk:(kb + 1) * chunk]
    rows_seeing = [c for c in cells if c.any()]
    if not rows_seeing:
      state = masks.EMPTY
    elif split and cells.shape[2] == chunk and cells.all():
      state = masks.FULL
    elif diagonal and not any((c & above[:c.shape[0], :c.shape[1]]).any() for c in rows_seeing):
      state = masks.DIAGONAL
    else:
      state = masks.PARTIAL
    out[qb, kb] = state
  return out


def test_unmasked_blocks_equal_the_dense_form_forward_and_backward(monkeypatch):
  """With the unmasked path on for blocks of any size (UNMASKED_MIN_SCORES
  = 0) and masks without arrays, the blocks every pair sees run without
  the select: output and every gradient still equal the dense form's. Causal
  n = 19 queries at a traced offset 3 and m = 27 keys, and bidirectional
  n = m = 21 (chunk 8: partial last blocks, which stay masked). The block
  math is the variant's own in both loops (every variant against its dense
  form: test_output_and_every_gradient_equal_the_dense_form); what differs
  is which blocks take which loop, here on dot_product."""
  monkeypatch.setattr(blockwise, 'UNMASKED_MIN_SCORES', 0)
  index = [i for i, (v, _) in enumerate(VARIANTS) if v == 'dot_product'][0]
  params = _params(index)
  rng = np.random.default_rng(3)
  shapes = {'causal': (19, 27, masks.causal()), 'bidirectional': (21, 21, None)}
  inputs = {c: [rng.normal(size=(2, length, H, D)).astype(np.float32) for length in (n, m, m, n)]
            for c, (n, m, _) in shapes.items()}

  def run(q_offset):
    out = {}
    for c, (n, m, spec) in shapes.items():
      offset, traced = (3, q_offset) if c == 'causal' else (0, 0)
      args = (*inputs[c][:3], params, inputs[c][3])
      out[c] = (_out_and_grads(_chunked_fn(index, spec, traced), *args),
                _out_and_grads(_dense_fn(index, spec, n, m, offset), *args))
    return out

  for c, (got, want) in _compile(run, 3)(3).items():
    for what in ('out', 'dq', 'dk', 'dv'):
      _assert_close(got[what], want[what], f'{c} {what}')
    for table in want['dparams']:
      _assert_close(got['dparams'][table], want['dparams'][table], f'{c} d {table}')


def _hooks(name, extra):
  """Which Terms hooks the variant's terms set (its kind, for the staircase)."""
  variant = registry.get(name)
  if variant.terms is None:
    return (name,)
  kwargs = registry.resolve_kwargs(name, extra)
  terms = variant.terms(H, **kwargs)
  return tuple(getattr(terms, f) is not None for f in
               ('score', 'prepare', 'transform_q', 'transform_k', 'product')) + (
                   terms.values is not product.dot_values,)


def test_diagonal_staircase_equals_the_dense_form_for_each_kind_of_variant(monkeypatch):
  """The DIAGONAL blocks as a staircase (blockwise._forward_staircase and
  _backward_staircase), turned on for small blocks: causal, q_offset 0,
  n = m = 24 in blocks of 8, steps of 4 rows (against 4, then 8 keys), under
  a padding mask whose PAD tokens in row 1 (17, 18 and a tail from 22) fall
  in the last diagonal block: block (1, 0) runs unmasked, blocks (2, 0) and
  (2, 1) masked, the steps hide the PAD keys (from the queries after them)
  and queries. The
  chunked output, its q, k, v and table gradients equal the dense
  form's (the first of its FORMS: the steps call the same block terms as
  whole blocks do, which test_output_and_every_gradient_equal_the_dense_form
  runs on every form), and dot_product's with attention dropout and no
  padding equal dense dropout with the same keep bits. One variant of each
  set of block-term hooks runs (_hooks, from the live registry): the steps
  differ between variants only by the hooks they call. Without a gradient
  the forward reads keys heads first and maps them by Terms.transform_k
  once, each from its block's first key: that output is checked on the
  variants with and without one (rotary, xpos, dot_product). Each variant's
  trace must have built the staircase, forward and backward. (A window, as `local` has, leaves every
  block masked: no staircase to test.)"""
  monkeypatch.setattr(blockwise, 'UNMASKED_MIN_SCORES', 0)
  monkeypatch.setattr(blockwise, 'STAIRCASE_ROWS', 4)
  steps = []
  for name in ('_forward_staircase', '_backward_staircase'):
    monkeypatch.setattr(blockwise, name, functools.partial(
        lambda name, fn, *a: steps.append(name) or fn(*a), name, getattr(blockwise, name)))
  n, chunk, spec = 24, 8, masks.causal()
  valid = np.ones((B, n), bool)
  valid[1, 17:19] = valid[1, 22:] = False
  padded = masks.causal() & masks.padding(valid)
  rng = np.random.default_rng(11)
  q, k, v, g = (rng.normal(size=(B, n, H, D)).astype(np.float32) for _ in range(4))
  drop_rng = jax.random.PRNGKey(5)
  firsts = {}
  for i, (name, extra) in enumerate(VARIANTS):
    if 'window' not in registry.resolve_kwargs(name, extra):
      key = name if name in ('dot_product', 'rotary', 'xpos') else _hooks(name, extra)
      firsts.setdefault(key, i)
  indices = list(firsts.values())
  built = {}

  def run():
    out = {}
    for index in indices:
      params = _params(index)
      chunked_fn = _chunked_fn(index, padded, 0, chunk_size=chunk)
      before = len(steps)
      got = _out_and_grads(chunked_fn, q, k, v, params, g)
      built[VARIANT_IDS[index]] = sorted(set(steps[before:]))
      want = _out_and_grads(_dense_fn(index, padded, n, n, 0), q, k, v, params, g)
      if VARIANTS[index][0] in ('dot_product', 'rotary', 'xpos'):
        got['out without a gradient'] = chunked_fn(q, k, v, params)
        want['out without a gradient'] = want['out']
      out[VARIANT_IDS[index]] = got, want
    scale = 1 / math.sqrt(D)
    out['dot_product with dropout'] = (
        _out_and_grads(lambda q, k, v, p: blockwise.attend(
            q * scale, k, v, mask=spec, chunk_size=chunk, dropout_rate=0.3,
            dropout_rng=drop_rng), q, k, v, {}, g),
        _out_and_grads(lambda q, k, v, p: dot_product_attention(
            q, k, v, mask=_dense_mask(spec, n, n, 0), dropout_rate=0.3, dropout_rng=drop_rng,
            deterministic=False), q, k, v, {}, g))
    return out

  results = _compile(run)()
  assert built and all(names == ['_backward_staircase', '_forward_staircase']
                       for names in built.values()), built
  for what, (got, want) in results.items():
    for part in ('out', 'dq', 'dk', 'dv', 'out without a gradient'):
      if part in want:
        _assert_close(got[part], want[part], f'{what} {part}')
    for table in want['dparams']:
      _assert_close(got['dparams'][table], want['dparams'][table], f'{what} d {table}')


def test_blocks_hidden_by_padding_or_segments_are_skipped_forward_and_backward():
  """Packed rows (three segments of 8 tokens, the same in both rows) whose
  last 4 keys are padding, chunk 4: a block whose pairs are all cross-segment
  or padding keys in every row never runs (NaN-poisoned terms there leave the
  output and gradients finite and equal to dense dot-product attention)."""
  n = m = 24
  segments = jnp.asarray(np.repeat([[1, 2, 3]], 2, axis=0).repeat(8, axis=1))  # [2, 24]
  key_valid = jnp.arange(m)[None].repeat(2, axis=0) < m - 4
  spec = masks.segments(segments, segments) & masks.key_padding(key_valid)
  rng = np.random.default_rng(8)
  q, k, v, g = (rng.normal(size=(2, n, H, D)).astype(np.float32) for _ in range(4))

  def seen(q_pos, k_pos):  # q_pos [bq, 1], k_pos [1, bk] -> [rows, bq, bk]
    return (segments[:, q_pos] == segments[:, k_pos]) & key_valid[:, k_pos]
  terms = _poisoned_terms(seen)
  scale = 1 / math.sqrt(D)

  def run():
    got = _out_and_grads(lambda q, k, v, p: blockwise.attend(q * scale, k, v, terms, mask=spec,
                                                           chunk_size=4), q, k, v, {}, g)
    want = _out_and_grads(lambda q, k, v, p: dot_product_attention(
        q, k, v, mask=masks.evaluate(spec, 2, 1, n, m)), q, k, v, {}, g)
    return got, want

  got, want = _compile(run)()
  for what in ('out', 'dq', 'dk', 'dv'):
    _assert_close(got[what], want[what], what)


# ---- table gradients against float64 loops, by central differences ------------------

def _loop_softmax_rows(logits, visible):
  """Row softmax over the visible keys; uniform over all keys where none is."""
  w = np.zeros_like(logits)
  for idx in np.ndindex(logits.shape[:-1]):
    row, ok = logits[idx], visible[idx]
    if ok.any():
      e = np.where(ok, np.exp(row - row[ok].max()), 0.0)
      w[idx] = e / e.sum()
    else:
      w[idx] = 1.0 / row.shape[-1]
  return w


def _shaw_loop(q, k, v, tk, tv, r, q_offset, visible):
  """Shaw eq. 3-5 in float64, pair by pair: the table rows at
  clip(j - (i + q_offset), -r, r) + r."""
  b, n, h, d = q.shape
  m = k.shape[1]
  logits = np.zeros((b, h, n, m))
  for bb, hh, i, j in np.ndindex(b, h, n, m):
    rel = min(max(j - (i + q_offset), -r), r) + r
    logits[bb, hh, i, j] = q[bb, i, hh] @ (k[bb, j, hh] + tk[rel]) / math.sqrt(d)
  w = _loop_softmax_rows(logits, np.broadcast_to(visible, logits.shape))
  out = np.zeros((b, n, h, d))
  for bb, hh, i, j in np.ndindex(b, h, n, m):
    rel = min(max(j - (i + q_offset), -r), r) + r
    out[bb, i, hh] += w[bb, hh, i, j] * (v[bb, j, hh] + tv[rel])
  return out


def _t5_loop(q, k, v, table, q_offset, visible, bucket_kw, bucket_fn):
  b, n, h, d = q.shape
  m = k.shape[1]
  logits = np.zeros((b, h, n, m))
  for bb, hh, i, j in np.ndindex(b, h, n, m):
    bucket = bucket_fn(j - (i + q_offset), **bucket_kw)
    logits[bb, hh, i, j] = q[bb, i, hh] @ k[bb, j, hh] / math.sqrt(d) + table[bucket, hh]
  w = _loop_softmax_rows(logits, np.broadcast_to(visible, logits.shape))
  return np.einsum('bhnm,bmhd->bnhd', w, v)


def _central_differences(loss, tables, eps=1e-4):
  """d loss / d every entry of every table, (f(t + eps) - f(t - eps)) / 2 eps."""
  grads = {}
  for name, t in tables.items():
    grads[name] = np.zeros_like(t)
    for idx in np.ndindex(t.shape):
      hi, lo = {**tables, name: t.copy()}, {**tables, name: t.copy()}
      hi[name][idx] += eps
      lo[name][idx] -= eps
      grads[name][idx] = (loss(hi) - loss(lo)) / (2 * eps)
  return grads


@pytest.mark.parametrize('name', ['shaw', 't5_bias'])
def test_table_gradients_equal_central_differences_of_a_float64_loop(name, t5_ref_bucket):
  """n=6 queries at positions 2..7, m=9 keys, chunk 3: blocks wholly beyond
  shaw's clipping distance 2 on both sides, and in one t5 bucket; example 1
  has no key (the uniform rule's table terms)."""
  n, m, offset, chunk = 6, 9, 2, 3
  rng = np.random.default_rng(11)
  q, k, v, g = (rng.normal(size=(2, length, H, 3)) for length in (n, m, m, n))
  key_valid = np.ones((2, m), bool)
  key_valid[0, [1, 5]] = False
  key_valid[1] = False
  spec = masks.key_padding(jnp.asarray(key_valid))
  visible = key_valid[:, None, None, :]
  if name == 'shaw':
    r = 2
    tables = {'rel_key_table': rng.normal(size=(2 * r + 1, 3)),
              'rel_value_table': rng.normal(size=(2 * r + 1, 3))}
    kwargs = {'max_distance': r}

    def loop_loss(t):
      return np.sum(g * _shaw_loop(q, k, v, t['rel_key_table'], t['rel_value_table'], r,
                                   offset, visible))
  else:
    bucket_kw = dict(bidirectional=True, num_buckets=8, max_distance=4)
    tables = {'rel_embedding': rng.normal(size=(8, H))}
    kwargs = {'num_buckets': 8, 'bucket_max_distance': 4}

    def loop_loss(t):
      return np.sum(g * _t5_loop(q, k, v, t['rel_embedding'], offset, visible, bucket_kw,
                                  t5_ref_bucket))

  variant = registry.get(name)
  kwargs = registry.resolve_kwargs(name, kwargs)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

  def chunked_loss(t):
    out = variant.chunked(f32(q), f32(k), f32(v), mask=spec, q_offset=offset, chunk_size=chunk,
                          **t, **kwargs)
    return jnp.sum(out * f32(g))

  t32 = jax.tree.map(f32, tables)
  loss, got = _compile(jax.value_and_grad(chunked_loss), t32)(t32)
  want = _central_differences(loop_loss, tables)
  # the reference itself: its loss at the tables equals the chunked form's
  np.testing.assert_allclose(float(loss), loop_loss(tables), rtol=1e-5)
  for table in tables:
    assert np.abs(want[table]).max() > 0.1  # every table matters here
    _assert_close(got[table], want[table], f'd {table}', tol=2e-5)


@pytest.mark.parametrize('n,m', [(1, 5), (4, 4), (3, 7), (6, 2), (5, 1)])
def test_rel_shift_moves_each_offset_to_its_key(n, m):
  x = np.random.default_rng(0).normal(size=(2, 3, n, n + m - 1)).astype(np.float32)
  got = np.asarray(scheme.rel_shift(jnp.asarray(x)))
  assert got.shape == (2, 3, n, m)
  for i in range(n):
    for j in range(m):
      np.testing.assert_array_equal(got[..., i, j], x[..., i, j - i + n - 1])


@pytest.mark.parametrize('bq,bk', [(1, 5), (4, 4), (3, 7), (6, 2), (5, 1)])
def test_by_offset_spreads_each_diagonal_over_its_block(bq, bk):
  x = np.random.default_rng(1).normal(size=(2, 3, bq + bk - 1)).astype(np.float32)
  got = np.asarray(scheme.by_offset(jnp.asarray(x), bq, bk))
  assert got.shape == (2, 3, bq, bk)
  for i in range(bq):
    for j in range(bk):
      np.testing.assert_array_equal(got[..., i, j], x[..., j - i + bq - 1])


# ---- the Terms contracts -------------------------------------------------------

def test_a_values_term_needs_its_uniform():
  with pytest.raises(TypeError, match='needs uniform='):
    scheme.Terms(values=lambda p, v, params, q_pos, k_pos: product.dot_values(
        p, v, params, q_pos, k_pos))
  assert scheme.Terms().uniform is scheme.mean_values


@pytest.mark.parametrize('lead', [-12, -3, 0, 3, 7, 8, 9, 20])
def test_shaw_values_term_is_linear_in_the_weights(lead):
  """The backward's D = dO . O needs values(p) linear in p: checked on random
  weights at block positions that reach each of its parts (far left, corner,
  band, far right) with k = 3 and blocks of 8."""
  from flaxformer_lite.attention.schemes import shaw
  rng = np.random.default_rng(lead + 20)
  p1, p2 = (jnp.asarray(rng.normal(size=(2, H, 8, 8)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(2, 8, H, D)), jnp.float32)
  params = {'rel_value_table': jnp.asarray(rng.normal(size=(7, D)), jnp.float32)}
  q_pos, k_pos = 100 + lead + jnp.arange(8), 100 + jnp.arange(8)
  values = functools.partial(shaw._block_values, 3)
  mixed = values(2.0 * p1 - 0.5 * p2, v, params, q_pos, k_pos)
  np.testing.assert_allclose(
      np.asarray(mixed), np.asarray(2.0 * values(p1, v, params, q_pos, k_pos)
                                    - 0.5 * values(p2, v, params, q_pos, k_pos)), atol=1e-4)
