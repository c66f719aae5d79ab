"""The scheme contract: what a position scheme changes in the scaled q.k
scores, FlexAttention's score_mod kept to JAX. It imports no kernel: every
kernel (kernels/) reads a scheme through `Terms` alone.

A scheme is a function terms(num_heads, **options) -> Terms. The kernels
compute the q.k product and the scaling themselves (kernels/product.py);
each field says what the scheme changes, and each is optional:
  prepare(params, q_pos int [nq, bq], k_pos int [nk, bk]) -> tables, what
      the scores read, made once per call from the scheme's parameters
      (Transformer-XL's projected distance rows); q_pos and k_pos hold the
      call's queries and keys as the kernel blocks them, a block a row,
      padding included. None: the tables are the parameters.
  transform_q(q [b, L, h, d], tables, q_pos [L], origin) -> [b, L, h, d],
  transform_k(k [b, L, g, d], tables, k_pos [L], origin) -> [b, L, g, d]:
      a map of each query and key by its position (rotary's rotation),
      before the product. origin (int32, [] or [L]) is the first key of the
      block each row meets: a map whose products depend on q_pos - k_pos
      only may measure positions from it (xPos, whose factors measured from
      0 leave float32's range). transform_k sees the keys' own g heads
      (grouped-query attention).
  score(s, b, h, q_pos, k_pos, tables) -> s: the scheme's elementwise change
      to scaled q.k scores (FlexAttention's score_mod), the one form every
      kernel can run, the Pallas kernel and the dense reference included:
      s float32, and int index arrays that broadcast against it: b the
      batch row ([B, 1, 1, 1] on a whole block; the program's row in a
      fused kernel), h the query head ([H, 1, 1]; the program's head), q_pos
      the queries' positions ([bq, 1], down) and k_pos the keys' ([1, bk],
      across). Tables are read as tables[name][h] or tables[name][h, index]
      (per head), tables[name][b, ...] (per batch row), or by position.
  additive: True where score(s, ...) = s + score(0, ...), a bias that does
      not depend on b (ALiBi, KERPLE): the kernels then make the bias once
      for the batch (b is 0) and add it as Block.add does
      (tests/attention/test_registry.py checks every registered scheme).
  block_score(s float32 [b, h, bq, bk], block) -> float32 [b, h, bq, bk]: the
      same change for a whole block at once, where that is faster (one
      lookup per diagonal: T5's buckets) or needs the block's q and k
      (Transformer-XL's and DeBERTa's position terms, Shaw's); block a
      product.Block (the block's mapped q and k, positions [bq] and [bk],
      tables). The blockwise kernel runs it in place of `score`; a scheme
      with both is tested equal. A bias that is the same for every row of
      the batch goes in by block.add(s, bias [h | 1, bq | 1, bk | 1]).
  values(p float32 [b, h, bq, bk], v [b, bk, h, dv], tables, q_pos, k_pos)
      -> float32 [b, h, bq, dv], what the block adds to the output, linear
      in p (checked for every registered scheme); None: the kernel's p.v;
  uniform(value [b, m, h, dv], tables, q_pos [n], k_pos [m]) -> [b, n, h, dv], the
      output of a query that sees no key (uniform weights, the dense path's
      rule); None: the mean value, which only the plain p.v gives;
  lookups: the block_score as tables indexed by a query or a key (Lookup),
      the form the fused kernel runs where a block_score reads the block's
      q and k (Shaw's q . a^K, DeBERTa's c2p and p2c): each Lookup's
      rows(q [b, n, h, d] scaled and mapped, k [b, m, g, d] mapped, tables)
      -> float32 [b, h, n, R] ('query') or [b, h, m, R] ('key'), made once
      per call (O(n R)), and index(q_pos [bq, 1], k_pos [1, bk]) -> int
      [bq, bk] in [0, R); the scores before `score` gain rows[b, h, i,
      index_ij] (or rows[b, h, j, index_ij]). With `score` or none, they
      must equal block_score (tests/attention/test_scores.py).
  value_lookup: the values term as a lookup (ValueLookup), the form the
      fused kernel runs: sum_j p_ij (v_j + tables[table][index_ij]), a table
      [R, dv] shared by the heads; it must equal `values`.
  mask: a masks.Mask the scheme adds to every call's mask (local's window),
      by index as the call's is; every kernel that reads Terms runs the two
      together (`call_mask`), so a block the scheme hides is skipped.
  product(q [b, bq, h, d], k [b, bk, h, d], tables) -> float32 [b, h, bq, bk]:
      for the alignment family only, a score of a query and a key that is
      not their product (Bahdanau's v . tanh(q + k)), in place of q.k.
The blockwise backward differentiates the scores and `values` one block at
a time (`jax.vjp`), so a scheme writes its forward math only. Gradients of
the tables are summed over the blocks in a fixed order (deterministic on
every backend) and reach the parameters through `prepare` by autodiff.

Besides the contract: the position helpers schemes share (rel_shift,
by_offset, the distance rows), `call_tables` (prepare once for a whole
call), `call_mask`, and the checks the registry-wide tests run on every scheme
(`check_terms`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def mean_values(value, tables, q_pos, k_pos):
  """Uniform weights over all m keys: the mean value, for every query -> [b, n, h, dv]."""
  del tables, k_pos
  mean = jnp.mean(value.astype(jnp.float32), axis=1, keepdims=True)  # [b, 1, h, dv]
  return jnp.broadcast_to(mean, (value.shape[0], q_pos.shape[0]) + value.shape[2:])


def _read_skewed(padded, n: int, length: int):
  """[..., n * (L + 1)] (n rows of L + 1, flat) -> [..., n, L], reading with
  stride L so that row i starts i places further left than row i - 1."""
  flat = jax.lax.slice_in_dim(padded, n - 1, n - 1 + n * length, axis=-1)
  return flat.reshape(padded.shape[:-1] + (n, length))


def rel_shift(x):
  """x [..., n, L] -> [..., n, L - n + 1], out[..., i, j] = x[..., i, j - i + n - 1].

  Column c of x holds the key-minus-query offset c - (n - 1); the output
  puts each at its key. Transformer-XL's relative shift (Dai et al. 2019,
  appendix B; the skew of Music Transformer's relative attention): one pad,
  one reshape, slices, never a gather, so its derivative is slices and pads
  too (deterministic table gradients).
  """
  n, length = x.shape[-2:]
  lead = x.shape[:-2]
  x = jnp.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, 1)])  # rows of length L + 1
  return _read_skewed(x.reshape(lead + (-1,)), n, length)[..., :length - n + 1]


def by_offset(x, bq: int, bk: int):
  """x [..., bq + bk - 1], indexed by j - i + bq - 1 -> [..., bq, bk] with
  out[..., i, j] = x[..., j - i + bq - 1]: a value per diagonal of a block,
  spread over the block.

  rel_shift of x tiled over the rows, with the one row padded before the
  tile: padding the tiled rows instead leaves XLA a block-sized buffer to
  fill (t5_bias's chunked temp memory, benchmarks/relative_attention.py).
  """
  length = bq + bk - 1
  lead = x.shape[:-1]
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 1)])  # [..., L + 1]
  tiled = jnp.broadcast_to(x[..., None, :], lead + (bq, length + 1)).reshape(lead + (-1,))
  return _read_skewed(tiled, bq, length)[..., :bk]


def query_key_positions(n: int, m: int, q_offset=0, positions=None):
  """(q_pos [n], k_pos [m]): queries at q_offset + 0..n-1 and keys at 0..m-1,
  or both at `positions` (int [n], n = m: self-attention with positions as
  data, such as randomized positions)."""
  if positions is None:
    return q_offset + jnp.arange(n), jnp.arange(m)
  positions = jnp.asarray(positions)
  return positions, positions


def distance_range(q_pos, k_pos):
  """Every query-minus-key distance of a call, largest first, for a scheme
  that looks up one row per distance in `prepare` and slices a block's rows
  with `distance_slice`: q_pos, k_pos the call's positions, ranges (as
  `prepare` gets them: any shape, in order) -> (top float32 [], distances
  int32 [n + m - 1]), distances[r] = top - r. `top` is a float so that it
  can travel with the tables (its gradient is 0); exact below 2**24."""
  q_pos, k_pos = q_pos.reshape(-1), k_pos.reshape(-1)
  top = q_pos[-1] - k_pos[0]
  return top.astype(jnp.float32), top - jnp.arange(q_pos.shape[0] + k_pos.shape[0] - 1)


def distance_slice(rows, top, q_pos, k_pos):
  """The bq + bk - 1 rows [L, ...] of one block's distances q_pos - k_pos,
  largest first, from rows laid out by `distance_range` (its `top`). A slice
  that would leave the table is moved inside it, which a table whose end
  rows repeat may rely on (jax's dynamic_slice would wrap a negative start)."""
  bq, bk = q_pos.shape[0], k_pos.shape[0]
  first = top.astype(jnp.int32) - (q_pos[0] + bq - 1 - k_pos[0])
  first = jnp.clip(first, 0, rows.shape[0] - (bq + bk - 1))
  return jax.lax.dynamic_slice_in_dim(rows, first, bq + bk - 1, axis=0)


class Lookup(NamedTuple):
  """A term of the scores read from a table with a row per query or per key
  (Terms.lookups, module docstring)."""
  side: str  # 'query': rows [b, h, n, R]; 'key': rows [b, h, m, R]
  rows: Callable[..., Any]  # (q, k, tables) -> float32 [b, h, n | m, R]
  index: Callable[..., Any]  # (q_pos [bq, 1], k_pos [1, bk]) -> int [bq, bk]


class ValueLookup(NamedTuple):
  """A values term sum_j p_ij (v_j + tables[table][index(q_pos, k_pos)_ij])
  (Terms.value_lookup)."""
  table: str  # a table [R, dv], shared by the heads
  index: Callable[..., Any]  # (q_pos [bq, 1], k_pos [1, bk]) -> int [bq, bk]


@dataclasses.dataclass(frozen=True)
class Terms:
  """What a scheme changes (module docstring); None: nothing. A `values`
  term adds to what a row's weights give, so it brings its own `uniform`
  (what a row that sees no key gets): with the mean value such rows would
  silently differ from the dense path's."""
  score: Callable[..., Any] | None = None  # elementwise (module docstring)
  additive: bool = False  # score(s) = s + score(0): a bias
  block_score: Callable[..., Any] | None = None  # a whole block at once
  prepare: Callable[..., Any] | None = None  # None: the tables are the parameters
  transform_q: Callable[..., Any] | None = None
  transform_k: Callable[..., Any] | None = None
  values: Callable[..., Any] | None = None  # None: the kernel's p.v
  uniform: Callable[..., Any] | None = None  # None: mean_values, for values=None only
  product: Callable[..., Any] | None = None  # None: the kernel's q.k
  lookups: tuple[Lookup, ...] = ()  # block_score as tables per query or key
  value_lookup: ValueLookup | None = None  # values as a lookup
  mask: Any = None  # a masks.Mask and-ed with every call's

  def __post_init__(self):
    if self.uniform is None:
      if self.values is not None:
        raise TypeError(f'Terms(values={self.values!r}) needs uniform=: the output of a '
                        'query that sees no key under that values term (the plain p.v: '
                        'mean_values)')
      object.__setattr__(self, 'uniform', mean_values)


class Tables(dict):
  """A call's tables by name; reading one the call lacks names those it has
  (a score that reads a table nobody passed)."""

  def __missing__(self, name):
    raise KeyError(f'the score reads table {name!r}, but this call has '
                   f'{sorted(self) or "none"}: pass it as params= (a registered scheme: '
                   'its parameters, AttentionVariant.params) or tables= (an inline score)')


def call_mask(terms: Terms, mask):
  """A call's mask (a masks.Mask, or None: every key) with the scheme's own
  (Terms.mask), both."""
  if terms.mask is None:
    return mask
  return terms.mask if mask is None else mask & terms.mask


def call_tables(terms: Terms, params, q_pos, k_pos):
  """terms.prepare's tables for queries q_pos [n] and keys k_pos [m] as one
  block (the parameters themselves without a prepare)."""
  return params if terms.prepare is None else terms.prepare(params, q_pos[None], k_pos[None])


def _run_now(fn: Callable, *args):
  """fn(*args) in one compilation, every input traced, compiled ahead of
  time: it runs now and returns arrays even when called while a model is
  traced (a jitted call would be staged into that trace)."""
  return jax.jit(fn).lower(*args).compile()(*args)


def check_terms(name: str, terms: Terms, params: Mapping[str, Any], num_heads: int,
                head_dim: int, seed: int = 0) -> None:
  """Raises TypeError unless a values term of the scheme's own is linear in
  the weights (_check_linear) and, with additive=True, its score adds a
  bias that does not depend on the batch row (_check_additive)."""
  r = np.random.default_rng(seed)
  if terms.values is not None:
    _check_linear(name, terms, params, num_heads, head_dim, r)
  if terms.additive:
    _check_additive(name, terms, params, num_heads, r)


def _check_linear(name, terms, params, num_heads, head_dim, r):
  """values(a p1 + c p2) = a values(p1) + c values(p2) on random inputs (a
  block of 3 queries at positions 5..7 against 4 keys at 0..3), computed at
  float32 matmul precision whatever the backend's default: the blockwise
  backward's delta_i = dO_i . O_i relies on it."""
  p1, p2 = (np.float32(r.uniform(size=(1, num_heads, 3, 4))) for _ in range(2))
  v = np.float32(r.normal(size=(1, 4, num_heads, head_dim)))
  q_pos, k_pos = np.arange(5, 8), np.arange(4)
  a, c = 0.7, -1.9

  def three(p1, p2, v, params, q_pos, k_pos):
    tables = call_tables(terms, params, q_pos, k_pos)
    values = lambda p: terms.values(p, v, tables, q_pos, k_pos)  # noqa: E731
    return values(a * p1 + c * p2), values(p1), values(p2)

  # A GPU's default (TF32) or a TPU's (bf16 passes) rounds a linear term by
  # more than the tolerance.
  with jax.default_matmul_precision('highest'):
    out = _run_now(three, p1, p2, v, params, q_pos, k_pos)
  got, v1, v2 = (np.asarray(x, np.float64) for x in out)
  want = a * v1 + c * v2
  scale = max(1.0, float(np.max(np.abs(want))))
  if not np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale):
    raise TypeError(
        f'attention scheme {name!r}: Terms.values is not linear in the weights p '
        f'(values(0.7 p1 - 1.9 p2) differs from 0.7 values(p1) - 1.9 values(p2) by up to '
        f'{float(np.max(np.abs(got - want))):.3g}); the blockwise backward needs '
        'sum_j p_ij dvalues/dp_ij = dO . O, which holds only for a linear term')


def _check_additive(name, terms, params, num_heads, r):
  """Raises TypeError unless score(s) = s + score(0) on random scores for
  two batch rows, the same bias in both (Terms(additive=True): the kernels
  add score(0) of row 0 as a bias for every row)."""
  s = np.float32(r.normal(size=(2, num_heads, 3, 4)) * 3)
  q_pos, k_pos = np.arange(5, 8), np.arange(4)
  b = np.arange(2)[:, None, None, None]
  heads = np.arange(num_heads)[:, None, None]

  def both(s, params):
    tables = Tables(call_tables(terms, params, q_pos, k_pos) or {})
    score = lambda x: terms.score(x, b, heads, q_pos[:, None], k_pos[None, :], tables)  # noqa: E731
    bias = score(jnp.zeros_like(s))
    return score(s), s + bias[:1]

  got, want = (np.asarray(x, np.float64) for x in _run_now(both, s, params))
  if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
    raise TypeError(f'attention scheme {name!r}: Terms(additive=True) but its score is not '
                    f's + score(0) with one bias for every batch row (off by up to '
                    f'{float(np.max(np.abs(got - want))):.3g}); drop additive=True')


def random_params(specs: Mapping[str, Any], seed: int = 0) -> dict:
  """{name: (shape, init, axes)} (AttentionVariant.params) -> arrays from
  each initializer."""
  def draw(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(specs))
    return {name: init(k, shape, jnp.float32)
            for k, (name, (shape, init, _)) in zip(keys, sorted(specs.items()))}

  if not specs:
    return {}
  return _run_now(draw, np.int32(seed))
