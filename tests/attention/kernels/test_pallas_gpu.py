"""The Pallas kernel (kernels/pallas_gpu.py) in interpret mode against
attention written out in float64 numpy loops: outputs, and the gradients of
q, k, v and of the score's tables by central differences of that reference,
with and without a score, under `causal` and under masks.Mask (key padding,
a causal sliding window, packed documents, prefix-LM at a decoding offset,
a combination, a per-head rule, a boolean array, rows that see no key),
with grouped-query heads and lengths that do not divide the blocks of 16.
Also: the blocks each kernel visits are exactly the non-empty ones (FULL
ones without the mask), and the kernels lower to Triton for a CUDA GPU."""
import collections
import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks
from flaxformer_lite.attention.kernels import pallas_gpu

H, D, BLOCK = 4, 16, 16
RNG = np.random.default_rng(9)
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
BUCKETS = RNG.normal(size=(H, 9)).astype(np.float32)  # [h, buckets]: the kernel pads rows to 16


def alibi(s, b, head, q_pos, k_pos, tables):
  return s - tables['slopes'][head] * jnp.abs(q_pos - k_pos).astype(jnp.float32)


def bucket_bias(s, b, head, q_pos, k_pos, tables):
  """A table lookup, T5's kind: this head's bias by clipped signed distance."""
  return s + tables['bias'][head, jnp.clip(k_pos - q_pos, -4, 4) + 4]


def one_hot_bias(s, b, head, q_pos, k_pos, tables):
  """bucket_bias with the head's row read whole."""
  bucket = jnp.clip(k_pos - q_pos, -4, 4) + 4
  row = tables['bias'][head]
  return s + jnp.sum(jnp.where(bucket[..., None] == jnp.arange(row.shape[-1]), row, 0), -1)


def both(s, b, head, q_pos, k_pos, tables):
  return bucket_bias(alibi(s, b, head, q_pos, k_pos, tables), b, head, q_pos, k_pos, tables)


def query_index(q_pos, k_pos):
  """A per-query lookup's entry: Shaw's clipped key-minus-query distance, 7 entries."""
  return (k_pos - q_pos).clip(-3, 3) + 3


def key_index(q_pos, k_pos):
  """A per-key lookup's entry: query-minus-key distance clipped to 5 entries."""
  return (q_pos - k_pos).clip(-2, 2) + 2


def value_index(q_pos, k_pos):
  """The value lookup's entry: key-minus-query distance clipped to 5 entries."""
  return (k_pos - q_pos).clip(-2, 2) + 2


# Lookup tables as the kernel takes them ((side, index, name); the rows are
# drawn per case) and the value lookup's table [5, D].
LOOKUPS = (('query', query_index, 'q_rows'), ('key', key_index, 'k_rows'))
TABLE_V = RNG.normal(size=(5, D)).astype(np.float32)

SCORES = {'alibi': (alibi, {'slopes': SLOPES}), 'buckets': (bucket_bias, {'bias': BUCKETS}),
          'both': (both, {'slopes': SLOPES, 'bias': BUCKETS}),
          'one-hot': (one_hot_bias, {'bias': BUCKETS})}


def _reference(q, k, v, visible, q_pos, k_pos, slopes=None, bias=None, q_rows=None,
               k_rows=None, table_v=None):
  """float64 numpy, a query at a time: softmax over the visible keys of q.k / sqrt(d) +
  the score's terms + the lookups' entries, times v (+ the value table's
  entries); visible bool [b, h, n, m]; 0 for a query that sees no key."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h, d = q.shape
  m, g = k.shape[1], k.shape[2]
  out = np.zeros((b, n, h, v.shape[3]))
  for bi, hi, i in itertools.product(range(b), range(h), range(n)):
    kh = hi // (h // g)
    seen = np.flatnonzero(visible[bi, hi, i])
    if not seen.size:
      continue
    s = k[bi, seen, kh] @ q[bi, i, hi] / np.sqrt(d)
    rel = np.asarray(k_pos)[seen] - q_pos[i]
    if q_rows is not None:
      s = s + np.asarray(q_rows, np.float64)[bi, hi, i, np.clip(rel, -3, 3) + 3]
      s = s + np.asarray(k_rows, np.float64)[bi, hi, seen, np.clip(-rel, -2, 2) + 2]
    if slopes is not None:
      s = s - slopes[hi] * np.abs(rel)
    if bias is not None:
      s = s + bias[hi][np.clip(rel, -4, 4) + 4]
    p = np.exp(s - s.max())
    values = v[bi, seen, kh]
    if table_v is not None:
      values = values + np.asarray(table_v, np.float64)[np.clip(rel, -2, 2) + 2]
    out[bi, i, hi] = (p / p.sum()) @ values
  return out


def _rule_array(rule, b, h, n, m, q_offset):
  """bool [b, h, n, m]: rule(b, h, i, j) with i = q_offset + row."""
  out = np.zeros((b, h, n, m), bool)
  for bi, hi, i, j in itertools.product(range(b), range(h), range(n), range(m)):
    out[bi, hi, i, j] = rule(bi, hi, q_offset + i, j)
  return out


KEY_VALID = RNG.random((2, 40)) > 0.3
# n = m = 37: row 0 packs documents of 16 and 21 tokens; row 1 is one
# document with positions 16..31 padding (queries and keys).
DOCUMENTS = np.array([[0] * 16 + [1] * 21, [0] * 37])
GAP = np.ones((2, 37), bool)
GAP[1, 16:32] = False
PREFIX = np.array([25, 3])
NO_KEY = np.ones((2, 40), bool)
NO_KEY[1, :20] = False  # under causal, row 1's queries 0..19 see no key
DENSE = RNG.random((1, H, 40, 40)) > 0.4

# name: (Mask, its rule written out (b, h, i, j) -> bool), the mask's own.
MASKS = {
    'key padding': (masks.key_padding(KEY_VALID), lambda b, h, i, j: KEY_VALID[b, j]),
    'causal window': (masks.sliding_window(5, True), lambda b, h, i, j: i - 5 < j <= i),
    'documents': (masks.segments(DOCUMENTS, DOCUMENTS) & masks.query_padding(GAP)
                  & masks.key_padding(GAP),
                  lambda b, h, i, j: (DOCUMENTS[b, i] == DOCUMENTS[b, j]) & GAP[b, i] & GAP[b, j]),
    'prefix-LM': (masks.prefix_lm(PREFIX), lambda b, h, i, j: j <= i or j < PREFIX[b]),
    'combination': ((masks.causal() & masks.key_padding(KEY_VALID))
                    | (masks.prefix_lm(PREFIX) & ~masks.causal()),
                    lambda b, h, i, j: (j <= i and KEY_VALID[b, j]) or (i < j < PREFIX[b])),
    'per head': (masks.Mask(lambda b, h, q, k: (k + h) % 3 != 0, 'heads'),
                 lambda b, h, i, j: (j + h) % 3 != 0),
    'dense spec': (masks.as_mask(DENSE), lambda b, h, i, j: DENSE[0, h, i, j]),
    'no key': (masks.key_padding(NO_KEY), lambda b, h, i, j: NO_KEY[b, j]),
}

CASES = {
    'plain': dict(),
    'alibi, causal': dict(score='alibi', causal=True),
    'alibi, causal, decoding offset, GQA': dict(score='alibi', causal=True, q_offset=5, g=2, n=7,
                                                m=12),
    'alibi, randomized positions': dict(score='alibi', positions=True, m=13),
    'bucket table, causal, one kv head': dict(score='buckets', causal=True, g=1),
    'bucket table, causal, decoding offset, blocks wholly seen': dict(
        score='buckets', causal=True, q_offset=9, g=2, n=40, m=49),
    'bucket table read whole, decoding offset': dict(score='one-hot', q_offset=3, n=9),
    'key padding, bucket table': dict(score='buckets', mask='key padding'),
    'causal sliding window, alibi': dict(score='alibi', mask='causal window', n=29, m=29),
    'packed documents with padding, causal, GQA': dict(score='buckets', mask='documents',
                                                       causal=True, g=2, n=37, m=37),
    'prefix-LM, decoding offset': dict(score='alibi', mask='prefix-LM', q_offset=10, n=9, m=30),
    'combination, both tables': dict(score='both', mask='combination', n=21, m=33),
    'per-head mask, GQA': dict(mask='per head', g=2, n=18, m=20),
    'boolean array': dict(score='alibi', mask='dense spec', n=17, m=17),
    'rows that see no key': dict(score='alibi', mask='no key', causal=True, n=24, m=24),
    'lookups per query and per key, value table, causal, decoding offset, GQA': dict(
        lookups=True, causal=True, q_offset=5, g=2, n=21, m=26),
    'lookups and value table, alibi, packed documents with padding': dict(
        lookups=True, score='alibi', mask='documents', g=1, n=37, m=37),
}


def _case(name):
  """(q, k, v, the kernel's keyword arguments, the reference's, the arrays
  by name: the score's tables, and the lookups' rows and value table)."""
  case = CASES[name]
  n, m, g = case.get('n', 13), case.get('m', 15), case.get('g', 4)
  q_offset = case.get('q_offset', 0)
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, n, H, D)).astype(np.float32)
  k, v = (rng.normal(size=(2, m, g, D)).astype(np.float32) for _ in range(2))
  q_pos, k_pos = q_offset + np.arange(n), np.arange(m)
  if case.get('positions'):
    q_pos = k_pos = np.sort(np.random.default_rng(1).choice(100, n, replace=False))
  mask, rule = MASKS[case['mask']] if 'mask' in case else (None, lambda *a: True)
  causal = case.get('causal', False)
  visible = _rule_array(lambda b, h, i, j: rule(b, h, i, j) and (j <= i or not causal),
                        2, H, n, m, q_offset)
  score, tables = SCORES[case['score']] if 'score' in case else (None, {})
  if case.get('lookups'):
    tables = dict(tables, q_rows=rng.normal(size=(2, H, n, 7)).astype(np.float32),
                  k_rows=rng.normal(size=(2, H, m, 5)).astype(np.float32), table_v=TABLE_V)
  kwargs = dict(score=score, mask=mask, causal=causal, q_offset=q_offset, block_q=BLOCK,
                block_k=BLOCK, interpret=True, q_positions=q_pos if case.get('positions') else None,
                k_positions=k_pos if case.get('positions') else None)
  return q, k, v, kwargs, dict(visible=visible, q_pos=q_pos, k_pos=k_pos), tables


def _flash(q, k, v, arrays, **kwargs):
  """flash_attention with `arrays` by name: the lookups' rows and value table
  (LOOKUPS, 'table_v') where present, the rest the score's tables."""
  lookups = tuple((side, index, arrays[name]) for side, index, name in LOOKUPS if name in arrays)
  values = (value_index, arrays['table_v']) if 'table_v' in arrays else None
  own = {'table_v'} | {name for _, _, name in LOOKUPS}
  tables = {name: x for name, x in arrays.items() if name not in own}
  return pallas_gpu.flash_attention(q, k, v, tables=tables, lookups=lookups, values=values,
                                    **kwargs)


def _directional(loss, x, direction, eps=1e-3):
  """d/dt loss(x + t direction) at 0, by central differences (float64)."""
  x = np.asarray(x, np.float64)
  return (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps)


@pytest.mark.parametrize('name', list(CASES))
def test_output_and_gradients_equal_the_written_out_attention(name):
  q, k, v, kwargs, ref, tables = _case(name)
  names = sorted(tables)

  def kernel(q, k, v, *table_values):
    return _flash(q, k, v, dict(zip(names, table_values)), **kwargs)

  def reference(q, k, v, *table_values):
    return _reference(q, k, v, **ref, **dict(zip(names, table_values)))

  args = [q, k, v] + [tables[t] for t in names]
  out = kernel(*args)
  want = reference(*args)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)

  cot = np.random.default_rng(2).normal(size=want.shape)
  grads = jax.grad(lambda *a: jnp.sum(kernel(*a) * cot), argnums=tuple(range(len(args))))(*args)
  for i, (x, grad) in enumerate(zip(args, grads)):
    assert grad.shape == np.shape(x) and np.isfinite(grad).all()

    def loss(xi, i=i):
      return np.sum(reference(*args[:i], xi, *args[i + 1:]) * cot)
    # q, k, v and the lookups' arrays along a random direction; a score's table entry by entry.
    directions = ([np.random.default_rng(3 + i).normal(size=np.shape(x))]
                  if i < 3 or np.size(x) > 64 else
                  list(np.eye(np.size(x)).reshape((-1,) + np.shape(x))))
    for direction in directions:
      np.testing.assert_allclose(np.sum(np.asarray(grad, np.float64) * direction),
                                 _directional(loss, x, direction), rtol=1e-3, atol=1e-3,
                                 err_msg=f'argument {i}')


def test_rows_that_see_no_key_give_zero_and_zero_gradients():
  q, k, v, kwargs, ref, tables = _case('rows that see no key')
  out = pallas_gpu.flash_attention(q, k, v, tables=tables, **kwargs)
  np.testing.assert_array_equal(np.asarray(out)[1, :20], 0.0)
  dq = jax.grad(lambda q: pallas_gpu.flash_attention(q, k, v, tables=tables, **kwargs).sum())(q)
  np.testing.assert_array_equal(np.asarray(dq)[1, :20], 0.0)


def test_the_log_sum_exp_and_its_gradient_equal_logsumexp_of_the_scores():
  """return_lse: each row's log-sum-exp of its visible scores (ALiBi, key
  padding with rows that see no key: -inf there), and the gradient of a
  loss on it and on the output equals jax.nn.logsumexp's on whole arrays."""
  q, k, v, kwargs, ref, tables = _case('rows that see no key')
  visible = ref['visible']  # [b, h, n, m], the causal rule included
  w = jnp.asarray(RNG.normal(size=(q.shape[0], H, q.shape[1])), jnp.float32)

  def dense(q):
    kk = jnp.repeat(jnp.asarray(k), H // k.shape[2], axis=2)
    s = jnp.einsum('bnhd,bmhd->bhnm', q, kk) / np.sqrt(q.shape[3])
    s = kwargs['score'](s, None, jnp.arange(H)[:, None, None], jnp.arange(q.shape[1])[:, None],
                        jnp.arange(k.shape[1])[None, :], tables)
    return jax.nn.logsumexp(jnp.where(visible, s, -jnp.inf), axis=-1)

  def fused(q):
    return pallas_gpu.flash_attention(q, k, v, tables=tables, return_lse=True, **kwargs)[1]

  want, got = dense(jnp.asarray(q)), fused(jnp.asarray(q))
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  seen = np.isfinite(np.asarray(want))
  np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], rtol=1e-5, atol=1e-5)
  loss = lambda fn: lambda q: jnp.sum(jnp.where(seen, fn(q), 0.0) * w)  # noqa: E731
  np.testing.assert_allclose(jax.grad(loss(fused))(jnp.asarray(q)),
                             jax.grad(loss(dense))(jnp.asarray(q)), rtol=1e-4, atol=1e-5)


def _dense(q, k, v, score, tables, visible, q_pos, k_pos):
  """The same attention in plain JAX on whole arrays, with the scores'
  contract there: b = arange(b)[:, None, None, None], head = arange(h)[:,
  None, None], s [b, h, n, m], q_pos [n, 1], k_pos [1, m], tables whole.
  Every query must see a key."""
  h, g = q.shape[2], k.shape[2]
  k, v = (jnp.repeat(jnp.asarray(x), h // g, axis=2) for x in (k, v))
  s = jnp.einsum('bnhd,bmhd->bhnm', q, k) / np.sqrt(q.shape[3])
  s = score(s, jnp.arange(s.shape[0])[:, None, None, None], jnp.arange(h)[:, None, None],
            jnp.asarray(q_pos)[:, None], jnp.asarray(k_pos)[None, :], tables)
  s = jnp.where(visible, s, -jnp.inf)
  return jnp.einsum('bhnm,bmhd->bnhd', jax.nn.softmax(s, axis=-1), v)


def test_a_score_reads_whole_arrays_the_same_way():
  q, k, v, kwargs, ref, tables = _case('combination, both tables')
  out = _dense(q, k, v, both, {n: jnp.asarray(t) for n, t in tables.items()}, **ref)
  np.testing.assert_allclose(out, _reference(q, k, v, **ref, **tables), rtol=2e-5, atol=2e-5)


def shifted(s, b, head, q_pos, k_pos, tables):
  """ALiBi from a per-head integer shift of the query positions."""
  return alibi(s, b, head, q_pos + tables['shift'][head], k_pos, tables)


def test_an_integer_table_is_read_and_gets_no_gradient():
  """Against jax.grad of _dense: q's and the slopes' gradients equal, the
  integer table's float0."""
  q, k, v, kwargs, ref, _ = _case('alibi, causal')
  tables = {'slopes': jnp.asarray(SLOPES), 'shift': jnp.asarray([0, 3, -2, 7], jnp.int32)}
  cot = np.random.default_rng(2).normal(size=q.shape).astype(np.float32)
  kernel = lambda q, t: jnp.sum(pallas_gpu.flash_attention(
      q, k, v, tables=t, **dict(kwargs, score=shifted)) * cot)
  dense = lambda q, t: jnp.sum(_dense(q, k, v, shifted, t, **ref) * cot)
  np.testing.assert_allclose(kernel(q, tables), dense(q, tables), rtol=1e-4)
  got, want = (jax.grad(f, argnums=(0, 1), allow_int=True)(q, tables) for f in (kernel, dense))
  assert got[1]['shift'].dtype == jax.dtypes.float0
  np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[1]['slopes'], want[1]['slopes'], rtol=1e-4, atol=1e-5)


def _states_by_hand(visible, bq, bk):
  """Each block's state from the boolean mask [b, h, n, m] -> int [b, h, nq, nk]."""
  b, h, n, m = visible.shape
  nq, nk = -(-n // bq), -(-m // bk)
  out = np.zeros((b, h, nq, nk), int)
  for bi, hi, qb, kb in itertools.product(range(b), range(h), range(nq), range(nk)):
    cells = visible[bi, hi, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
    whole = cells.shape[1] == bk
    out[bi, hi, qb, kb] = (masks.EMPTY if not cells.any() else
                           masks.FULL if whole and cells.all() else masks.PARTIAL)
  return out


def test_each_kernel_visits_the_non_empty_blocks_once(monkeypatch):
  q, k, v, kwargs, ref, tables = _case('packed documents with padding, causal, GQA')
  visits = collections.Counter()
  monkeypatch.setattr(pallas_gpu, 'VISIT_HOOK', lambda kernel, masked, b, h, blk, i: visits.update(
      [(kernel, int(b), int(h), int(blk), int(i), masked)]))
  jax.grad(lambda q, k, v: pallas_gpu.flash_attention(q, k, v, tables=tables, **kwargs).sum(),
           argnums=(0, 1, 2))(q, k, v)
  jax.effects_barrier()
  states = _states_by_hand(ref['visible'], BLOCK, BLOCK)
  # 3 x 3 blocks (DOCUMENTS, GAP), causal; row 1 has an empty block between
  # two non-empty ones both in the query block 2 and in the key block 0.
  np.testing.assert_array_equal(states[:, 0], [
      [[1, 0, 0], [0, 1, 0], [0, 2, 1]],
      [[1, 0, 0], [0, 0, 0], [2, 0, 1]]])
  want = collections.Counter()
  for (b, h, qb, kb), state in np.ndenumerate(states):
    if state != masks.EMPTY:
      masked = bool(state == masks.PARTIAL)
      want.update([('forward', b, h, qb, kb, masked), ('dq', b, h, qb, kb, masked),
                   ('dkdv', b, h, kb, qb, masked)])
  assert visits == want



@pytest.mark.parametrize('causal,n,m,q_offset', [(True, 48, 69, 21), (False, 32, 37, 0)])
def test_without_a_mask_the_blocks_wholly_seen_run_without_the_select(causal, n, m, q_offset,
                                                                      monkeypatch):
  """Causal (at a decoding offset) or plain, keys past the blocks: each
  kernel visits the blocks some pair of which is seen, once each, and the
  ones whose every pair is seen unmasked, by the block states written out
  from the pairs here."""
  rng = np.random.default_rng(3)
  q = rng.normal(size=(1, n, 1, D)).astype(np.float32)
  k, v = (rng.normal(size=(1, m, 1, D)).astype(np.float32) for _ in range(2))
  visits = collections.Counter()
  monkeypatch.setattr(pallas_gpu, 'VISIT_HOOK', lambda kernel, masked, b, h, blk, i: visits.update(
      [(kernel, int(blk), int(i), masked)]))
  jax.grad(lambda q, k, v: pallas_gpu.flash_attention(
      q, k, v, causal=causal, q_offset=q_offset, block_q=BLOCK, block_k=BLOCK,
      interpret=True).sum(), argnums=(0, 1, 2))(q, k, v)
  jax.effects_barrier()
  visible = _rule_array(lambda b, h, i, j: j <= i or not causal, 1, 1, n, m, q_offset)
  states = _states_by_hand(visible, BLOCK, BLOCK)[0, 0]
  assert (states == masks.FULL).any() and (states == masks.PARTIAL).any()
  want = collections.Counter()
  for (qb, kb), state in np.ndenumerate(states):
    if state != masks.EMPTY:
      masked = bool(state == masks.PARTIAL)
      want.update([('forward', qb, kb, masked), ('dq', qb, kb, masked), ('dkdv', kb, qb, masked)])
  assert visits == want

@pytest.mark.parametrize('dtype,head_dim', [('bfloat16', 64), ('float16', 128)])
@pytest.mark.parametrize('score', ['alibi', 'buckets', 'lookups', 'wide lookups'])
def test_forward_and_backward_lower_to_triton_for_a_cuda_gpu(dtype, head_dim, score):
  """Lowered for the CUDA platform on this machine (no GPU needed): the
  forward is one Triton call, its gradient (q, k, v and the tables) two more
  (dk and dv with the per-key lookups'; dq with the table's and the
  per-query lookups'), and no [n, m] array anywhere; with causal, then with
  a Mask whose arrays are kernel operands, over causal. 'lookups': a
  per-query and a per-key lookup table and a value lookup; 'wide lookups':
  tables wider than the kernel carries (their gradients gathered in its
  output)."""
  q = jnp.zeros((2, 128, 4, head_dim), dtype)
  k = v = jnp.zeros((2, 128, 2, head_dim), dtype)
  if score == 'lookups':
    score_fn, names = None, ('q_rows', 'k_rows', 'table_v')
    arrays = (jnp.zeros((2, 4, 128, 7)), jnp.zeros((2, 4, 128, 5)), jnp.zeros((5, head_dim)))
  elif score == 'wide lookups':
    score_fn, names = None, ('q_rows', 'k_rows')
    arrays = (jnp.zeros((2, 4, 128, 200)), jnp.zeros((2, 4, 128, 141)))
  else:
    score_fn, tables = SCORES[score]
    names, arrays = tuple(tables), tuple(jnp.asarray(t) for t in tables.values())
  documents = jnp.asarray(np.repeat([[0, 1]], 2, axis=0).repeat(64, axis=1))
  mask = masks.key_padding(jnp.ones((2, 128), bool)) & masks.segments(documents, documents)

  for mask in (None, mask):
    def out(q, k, v, arrays, mask=mask):
      return _flash(q, k, v, dict(zip(names, arrays)), causal=True, score=score_fn, mask=mask,
                    block_q=64, block_k=64)

    def loss(*args):
      return out(*args).astype(jnp.float32).sum()

    for fn, calls in ((out, 1), (jax.grad(loss, argnums=(0, 1, 2, 3)), 3)):
      text = jax.jit(fn).trace(q, k, v, arrays).lower(lowering_platforms=('cuda',)).as_text()
      assert text.count('custom_call @__gpu$xla.gpu.triton') == calls, text[:2000]
      assert '128x128' not in text, 'an [n, m] array'


def wide_query_index(q_pos, k_pos):
  """A per-query lookup of 200 entries (more than the kernel carries)."""
  return (k_pos - q_pos).clip(-100, 99) + 100


def wide_key_index(q_pos, k_pos):
  """A per-key lookup of 141 entries."""
  return (q_pos - k_pos).clip(-70, 70) + 70


def _wide_lookups_against_whole_arrays(pos, monkeypatch, seed=11):
  """Tables of 200 and 141 entries (CARRIED_ENTRIES fewer), per query and per
  key, at positions pos [n]: output and gradients of q, k, v and both tables
  against attention on whole arrays with gathers in JAX. -> the backward's
  window reads and writes (kind, first entry, width), from WINDOW_HOOK."""
  assert 141 > pallas_gpu.CARRIED_ENTRIES
  n, rng = len(pos), np.random.default_rng(seed)
  q, k, v = (rng.normal(size=(1, n, 2, D)).astype(np.float32) for _ in range(3))
  q_rows = rng.normal(size=(1, 2, n, 200)).astype(np.float32)
  k_rows = rng.normal(size=(1, 2, n, 141)).astype(np.float32)
  qi = wide_query_index(pos[:, None], pos[None, :])
  ki = wide_key_index(pos[:, None], pos[None, :])

  def kernel(q, k, v, q_rows, k_rows):
    return pallas_gpu.flash_attention(
        q, k, v, lookups=(('query', wide_query_index, q_rows), ('key', wide_key_index, k_rows)),
        q_positions=pos, k_positions=pos, block_q=BLOCK, block_k=BLOCK, interpret=True)

  def whole(q, k, v, q_rows, k_rows):
    s = jnp.einsum('bnhd,bmhd->bhnm', q, k) / np.sqrt(D)
    rows = np.arange(n)
    s = s + q_rows[:, :, rows[:, None], qi] + k_rows[:, :, rows[None, :], ki]
    return jnp.einsum('bhnm,bmhd->bnhd', jax.nn.softmax(s, axis=-1), v)

  args = (q, k, v, q_rows, k_rows)
  np.testing.assert_allclose(kernel(*args), whole(*args), rtol=2e-5, atol=2e-5)
  cot = rng.normal(size=q.shape).astype(np.float32)
  windows = []
  monkeypatch.setattr(pallas_gpu, 'WINDOW_HOOK',
                      lambda kind, base, size: windows.append((kind, int(base), int(size))))
  got = jax.grad(lambda *a: jnp.sum(kernel(*a) * cot), argnums=tuple(range(5)))(*args)
  monkeypatch.setattr(pallas_gpu, 'WINDOW_HOOK', None)
  want = jax.grad(lambda *a: jnp.sum(whole(*a) * cot), argnums=tuple(range(5)))(*args)
  for name, a, b in zip(('dq', 'dk', 'dv', 'd q_rows', 'd k_rows'), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
  return windows


def test_lookup_tables_wider_than_the_carry_gather_their_gradients_in_the_output(monkeypatch):
  """Randomized positions spread over 400, so that blocks of 16 read one
  entry (past the clip), a few or more than a window of them: output and
  every gradient equal attention on whole arrays. Every read and write of
  the gradients in the kernel's output is a whole window at a multiple of
  CARRIED_ENTRIES (on a GPU, an entry is then always held by one thread)."""
  pos = np.sort(np.random.default_rng(11).choice(400, 48, replace=False))
  spans = [np.ptp(idx[a:a + BLOCK, c:c + BLOCK])
           for idx in (wide_query_index(pos[:, None], pos[None, :]),
                       wide_key_index(pos[:, None], pos[None, :]))
           for a in range(0, len(pos), BLOCK) for c in range(0, len(pos), BLOCK)]
  assert min(spans) == 0 and max(spans) >= pallas_gpu.CARRIED_ENTRIES
  windows = _wide_lookups_against_whole_arrays(pos, monkeypatch)
  assert {size for _, _, size in windows} == {256}  # both padded to a power of two
  assert {base for _, base, _ in windows} == {0, 64, 128, 192}


def test_blocks_past_the_clip_add_to_registers_not_to_the_output(monkeypatch):
  """Six blocks of 16 positions, 1000 apart: every block off the diagonal is
  past both clips and reads one entry (0 or the last), so its sums stay in
  registers and reach the output once per run of equal entries. Hand count
  of the backward's window reads: the dq kernel (per-query table, a block's
  distances -15..15 at entries 85..115: one window) reads its diagonal block's
  window once per program and flushes once per far side, 1 + 2 + 2 + 2 + 2 +
  1 = 10 for the six query blocks, so 6 + 10 per head; the dk/dv kernel
  (entries 55..85: two windows) 12 + 10; with 2 heads, 2 x (16 + 22) = 76.
  A read per far block would make it 156."""
  pos = (1000 * np.arange(6)[:, None] + np.arange(BLOCK)).reshape(-1)
  windows = _wide_lookups_against_whole_arrays(pos, monkeypatch, seed=3)
  assert sum(kind == 'read' for kind, _, _ in windows) == 76
