"""Attention masks as functions: one type, `Mask`, for every model, layer and kernel.

A Mask is FlexAttention's mask_mod kept to JAX: a function of (batch, head,
query index, key index) -> bool, True = may attend, evaluated on int arrays
that broadcast ([B,1,1,1], [1,H,1,1], [1,1,N,1], [1,1,1,M]). A query's index
counts from the sequence's first query (a decoding step's offset included),
a key's from the first key. Masks combine with &, | and ~.

The data a mask reads (padding, segments, prefix lengths) are its explicit
`arrays`, handed to its function after the indices, not closed over: a
kernel passes them as its own operands and calls the mask with them
replaced (`with_arrays`; a Pallas kernel passes refs, whose indexing by an
int array is a gather load). So a mask's function only indexes its arrays
(arr[b, k], arr[b]), with indices inside their shapes. A Mask is a pytree
whose leaves are its arrays, so it passes through jit, scan and remat.

Kernels read a mask two ways. The blocked ones classify each block of a call
once (`block_mask`: empty, full, partial, or partial below the diagonal)
and take their fast paths from that map: skip the empty blocks, run the
full ones without the select, the diagonal ones as a staircase. Kernels
that take rules, not functions (splash, Shaw's band), read `rules_of`: what
a mask made only of the constructors causal, sliding_window, key_padding,
query_padding and segments says, or None for any other mask.

A boolean array (True = may attend, broadcastable to [b, h, n, m]) converts
once at the entry (`as_mask`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL, DIAGONAL = 0, 1, 2, 3

# The arrays each rule reads, in order (Mask.rules).
_RULE_ARRAYS = {'causal': 0, 'window': 0, 'key_padding': 1, 'query_padding': 1, 'segments': 2}


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Mask:
  """fn(b, h, q, k, *arrays) -> bool (module docstring); `name` for
  messages; `arrays` the data fn reads; `rules` what it says as rules, one
  (kind, static values) per conjunct, where a constructor of _RULE_ARRAYS
  made each (rules_of), else None."""
  fn: Callable[..., Any]
  name: str = 'mask'
  arrays: tuple = ()
  rules: tuple | None = None

  def __post_init__(self):
    # Data as JAX arrays: a kernel indexes them by traced indices, which a
    # numpy array refuses (TracerArrayConversionError).
    object.__setattr__(self, 'arrays', tuple(
        jnp.asarray(x) if isinstance(x, (np.ndarray, list, tuple)) else x for x in self.arrays))

  def __call__(self, b, h, q, k):
    return self.fn(b, h, q, k, *self.arrays)

  def with_arrays(self, arrays) -> Mask:
    """The same rule reading `arrays` (one for each of self.arrays, in order)."""
    arrays = tuple(arrays)
    if len(arrays) != len(self.arrays):
      raise ValueError(f'{self.name} reads {len(self.arrays)} arrays, got {len(arrays)}')
    return dataclasses.replace(self, arrays=arrays)

  def __and__(self, other: Mask) -> Mask:
    rules = None if self.rules is None or other.rules is None else self.rules + other.rules
    return _combine(jnp.logical_and, self, other, f'({self.name} & {other.name})', rules)

  def __or__(self, other: Mask) -> Mask:
    return _combine(jnp.logical_or, self, other, f'({self.name} | {other.name})')

  def __invert__(self) -> Mask:
    fn = self.fn
    return Mask(lambda b, h, q, k, *arrays: jnp.logical_not(fn(b, h, q, k, *arrays)),
                f'~{self.name}', self.arrays)


jax.tree_util.register_pytree_node(
    Mask, lambda mask: (mask.arrays, (mask.fn, mask.name, mask.rules)),
    lambda aux, arrays: Mask(aux[0], aux[1], tuple(arrays), aux[2]))


def _combine(op, first: Mask, second: Mask, name: str, rules=None) -> Mask:
  """op of two masks; the arrays are first's then second's."""
  split, f, g = len(first.arrays), first.fn, second.fn

  def fn(b, h, q, k, *arrays):
    return op(f(b, h, q, k, *arrays[:split]), g(b, h, q, k, *arrays[split:]))
  return Mask(fn, name, first.arrays + second.arrays, rules)


def closes_over_arrays(mask: Mask) -> bool:
  """Whether `mask`'s function reads an array it closed over instead of its
  `arrays` (a fused kernel cannot take such a mask: its data must be inputs)."""
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  closed = jax.make_jaxpr(lambda *a: mask.fn(*a[:4], *a[4:]))(
      *[scalar] * 4, *[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                      for x in mask.arrays])
  return any(jnp.ndim(c) > 0 for c in closed.consts)


# ------------------------------------------------------------ constructors


def band(q_pos, k_pos, window: int, causal_: bool):
  """Whether the query at q_pos sees the key at k_pos inside a window
  (broadcasting int arrays): |j - p| < window, or p - window < j <= p."""
  rel = k_pos - q_pos
  if causal_:
    return (rel > -window) & (rel <= 0)
  return jnp.abs(rel) < window


def causal() -> Mask:
  """k <= q."""
  return Mask(lambda b, h, q, k: k <= q, 'causal', rules=(('causal', ()),))


def sliding_window(window: int, causal_: bool = False) -> Mask:
  """|k - q| < window; causal_: q - window < k <= q (local attention's band)."""
  return Mask(lambda b, h, q, k: band(q, k, window, causal_), f'window({window})',
              rules=(('window', (window, causal_)),))


def key_padding(key_valid) -> Mask:
  """key_valid bool [B, M]: False keys are seen by no query."""
  return Mask(lambda b, h, q, k, valid: valid[b, k], 'key_padding',
              (jnp.asarray(key_valid, bool),), (('key_padding', ()),))


def query_padding(query_valid) -> Mask:
  """query_valid bool [B, N]: False queries see no key."""
  return Mask(lambda b, h, q, k, valid: valid[b, q], 'query_padding',
              (jnp.asarray(query_valid, bool),), (('query_padding', ()),))


def padding(valid) -> Mask:
  """valid bool [B, L] for self-attention: padding neither sees nor is seen."""
  return key_padding(valid) & query_padding(valid)


def segments(query_segments, key_segments) -> Mask:
  """int [B, N] and [B, M]: a query sees the keys of its own segment
  (packed examples, documents)."""
  return Mask(lambda b, h, q, k, q_seg, k_seg: q_seg[b, q] == k_seg[b, k], 'segments',
              (jnp.asarray(query_segments), jnp.asarray(key_segments)), (('segments', ()),))


def prefix_lm(prefix_len) -> Mask:
  """int [B]: every query sees the first prefix_len[b] keys (the prompt,
  attended bidirectionally), and the keys before it causally."""
  return Mask(lambda b, h, q, k, prefix: (k <= q) | (k < prefix[b]), 'prefix_lm',
              (jnp.asarray(prefix_len),))


def chunked_causal(chunk: int) -> Mask:
  """Causal inside chunks of `chunk` positions, nothing across them."""
  return Mask(lambda b, h, q, k: (k <= q) & (k // chunk == q // chunk), f'chunked_causal({chunk})')


def everything() -> Mask:
  """Every query sees every key."""
  return Mask(lambda b, h, q, k: jnp.ones((), bool), 'everything', rules=())


def from_array(allowed, q_offset=0) -> Mask:
  """A boolean array broadcastable to [b, h, n, m] (True = may attend; its
  row i is query index q_offset + i, which may be traced) as a Mask."""
  allowed = jnp.asarray(allowed).astype(bool)
  allowed = allowed.reshape((1,) * (4 - allowed.ndim) + allowed.shape)

  def fn(b, h, q, k, arr, offset):
    # A broadcast axis is read at 0 and leaves the index's shape: the rows
    # and heads of a [1, 1, n, m] array are not gathered b * h times.
    at = lambda i, axis: i if arr.shape[axis] > 1 else 0  # noqa: E731
    return arr[at(b, 0), at(h, 1), at(q - offset[0], 2), at(k, 3)]
  return Mask(fn, 'array', (allowed, jnp.reshape(jnp.asarray(q_offset, jnp.int32), (1,))))


def as_mask(mask, q_offset=0) -> Mask | None:
  """None, a Mask, or a boolean array broadcastable to [b, h, n, m] whose row
  i is query q_offset + i -> None or a Mask: the one conversion, at the entry."""
  if mask is None or isinstance(mask, Mask):
    return mask
  if hasattr(mask, 'shape') or isinstance(mask, (list, tuple)):
    return from_array(mask, q_offset)
  raise TypeError(f'mask={type(mask).__name__}: give a masks.Mask, a boolean array '
                  'broadcastable to [b, h, n, m] (True = may attend) or None')


class Rules(NamedTuple):
  """A mask made of the rule constructors, as rules (rules_of): causal, a
  window (its width and whether it is causal), padding arrays and segments."""
  causal: bool = False
  window: int | None = None
  window_causal: bool = False
  key_valid: Any = None  # bool [b, m]
  query_valid: Any = None  # bool [b, n]
  segments: tuple | None = None  # (int [b, n], int [b, m])

  def has_more(self) -> bool:
    """Whether there is a rule beside causal: a window, padding or segments."""
    return self.window is not None or any(
        x is not None for x in (self.key_valid, self.query_valid, self.segments))


def rules_of(mask: Mask | None) -> Rules | None:
  """`mask`'s rules where it is an & of the rule constructors (None: Rules()),
  else None: a function only a kernel that evaluates masks can take."""
  if mask is None:
    return Rules()
  if mask.rules is None:
    return None
  out, arrays = Rules(), list(mask.arrays)
  for kind, static in mask.rules:
    taken = [arrays.pop(0) for _ in range(_RULE_ARRAYS[kind])]
    if kind == 'causal':
      out = out._replace(causal=True)
    elif kind == 'window':
      if out.window is not None:
        return None
      out = out._replace(window=static[0], window_causal=static[1])
    else:
      field = {'key_padding': 'key_valid', 'query_padding': 'query_valid'}.get(kind, kind)
      value = taken[0] if len(taken) == 1 else tuple(taken)
      if getattr(out, field) is not None:
        value = _and_rule(getattr(out, field), value, field)
        if value is None:
          return None
      out = out._replace(**{field: value})
  return out


def causal_alone(mask: Mask | None) -> bool:
  """Whether `mask` is the causal rule and nothing else (rules_of)."""
  rules = rules_of(mask)
  return rules is not None and rules.causal and not rules.has_more()


def hides_no_row(mask: Mask | None) -> bool:
  """Whether every query surely sees a key, read from the rules: no mask, or
  the causal rule alone (query index q >= 0 sees key 0). False is "may
  hide": a kernel then applies the no-key rule (softmax.where_no_key)."""
  rules = rules_of(mask)
  return rules is not None and not rules.has_more()


def _and_rule(old, new, field: str):
  """Two masks' arrays for one rule -> the rule both say, or None."""
  if field == 'segments':
    return None
  return jnp.logical_and(old, new)


# ------------------------------------------------------------ evaluation


def _indices(batch: int, heads: int, q, k):
  b = jnp.arange(batch)[:, None, None, None]
  h = jnp.arange(heads)[None, :, None, None]
  return b, h, q[None, None, :, None], k[None, None, None, :]


def at(mask: Mask, batch: int, heads: int, q, k):
  """The mask at query indices q int [n] and key indices k int [m], for
  every row and head -> bool broadcastable to [batch, heads, n, m]."""
  return jnp.asarray(mask(*_indices(batch, heads, q, k)), bool)


def evaluate(mask: Mask, batch: int, heads: int, n: int, m: int, q_offset=0):
  """The mask as a boolean array broadcastable to [batch, heads, n, m]
  (queries at indices q_offset .. q_offset + n - 1)."""
  return at(mask, batch, heads, q_offset + jnp.arange(n), jnp.arange(m))


def as_dense(mask, batch: int, heads: int, n: int, m: int, q_offset=0):
  """A Mask evaluated (evaluate); a boolean array or None (nothing masked)
  as it is: the dense kernels' form."""
  return evaluate(mask, batch, heads, n, m, q_offset) if isinstance(mask, Mask) else mask


def block_mask(mask: Mask, batch: int, heads: int, n: int, m: int, bq: int, bk: int,
               q_offset=0, diagonal: bool = False):
  """Each block's state, computed once per call -> int8 [batch | 1, heads | 1,
  ceil(n / bq), ceil(m / bk)]: EMPTY (no pair visible: skip it), FULL (every
  pair visible: no select needed) or PARTIAL; with `diagonal` (bq = bk),
  DIAGONAL for a partial block that hides every pair above its diagonal
  (key j > query i inside the block: a causal rule's diagonal block, which a
  kernel may run as a staircase). Keys past m are hidden, queries past n do
  not count. One query block at a time: the memory is a block row's, as
  broadcast as the mask's own arrays."""
  nq, nk = -(-n // bq), -(-m // bk)
  k = jnp.arange(nk * bk)
  k_real = (k < m)[None, None, None, :]
  above = (jnp.arange(bk)[None, :] > jnp.arange(bq)[:, None])[:, None, :]  # [bq, 1, bk]

  def row(qb):
    q = q_offset + qb * bq + jnp.arange(bq)
    q_real = (qb * bq + jnp.arange(bq) < n)[None, None, :, None]
    seen = jnp.logical_and(at(mask, batch, heads, q, k), k_real)  # [.., bq, nk * bk]
    shape = jnp.broadcast_shapes(seen.shape, (1, 1, bq, nk * bk))
    seen = jnp.broadcast_to(seen, shape).reshape(shape[:2] + (bq, nk, bk))
    real = q_real[..., None]
    any_ = jnp.any(seen & real, axis=(2, 4))
    all_ = jnp.all(seen | ~real, axis=(2, 4))
    partial = PARTIAL
    if diagonal:
      partial = jnp.where(jnp.any(seen & real & above, axis=(2, 4)), PARTIAL, DIAGONAL)
    return jnp.where(any_, jnp.where(all_, FULL, partial), EMPTY).astype(jnp.int8)

  # Indices past the arrays' ends (the last blocks' tails) read clamped
  # values; k_real and q_real leave those pairs out.
  rows = jax.lax.map(row, jnp.arange(nq))  # [nq, b | 1, h | 1, nk]
  return jnp.moveaxis(rows, 0, 2)


def pad_to(x, axis: int, size: int):
  """x padded with zeros along `axis` up to `size`."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


# ------------------------------------------------- masks a config can name


@dataclasses.dataclass(frozen=True)
class NamedMask:
  """A mask a config selects by name (`model.mask`, options in
  `model.mask_kwargs`): `make(**options) -> Mask`, a rule of positions
  alone (it is built once per model and evaluated at absolute positions,
  decoding steps included; a mask that reads the batch is given to
  MultiHeadAttention directly). It replaces the model's causal rule, so it
  says which earlier or later tokens a query sees; padding stays the
  model's. `options`: a frozen dataclass type whose fields are the options
  (defaults set) and whose __post_init__ raises ValueError naming a bad
  value, or None. `models`: the model types it applies to."""
  name: str
  make: Callable[..., Mask]
  options: type | None = None
  models: tuple[str, ...] = ('decoder_only',)
  doc: str = ''


NAMED: dict[str, NamedMask] = {}


def register(named: NamedMask) -> NamedMask:
  """Adds `named` to NAMED (a user's module does it; model.import_modules)."""
  if named.name in NAMED or named.name == 'none':
    raise ValueError(f'mask {named.name!r} is registered already (or reserved)')
  NAMED[named.name] = named
  return named


def named(name: str, given=None) -> Mask | None:
  """The registered mask `name` with options `given` (a mapping; None
  values are unset); None for 'none'. Raises ValueError naming an unknown
  mask or option and what is valid."""
  if name == 'none':
    return None
  if name not in NAMED:
    raise ValueError(f'mask={name!r}; valid: none, {", ".join(sorted(NAMED))}')
  entry = NAMED[name]
  fields = {f.name for f in dataclasses.fields(entry.options)} if entry.options else set()
  given = {k: v for k, v in dict(given or {}).items() if v is not None}
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ValueError(f'mask_kwargs {unknown} do not apply to mask={name!r}; its options: '
                     f'{", ".join(sorted(fields)) or "none"}')
  options = entry.options(**given) if entry.options else None
  values = {f: getattr(options, f) for f in fields}
  return entry.make(**values)


@dataclasses.dataclass(frozen=True)
class PrefixOptions:
  """prefix_len: the tokens at the start of every row that see each other
  (a prompt read both ways); the later ones see the tokens before them."""
  prefix_len: int = 16

  def __post_init__(self):
    if isinstance(self.prefix_len, bool) or not isinstance(self.prefix_len, int) \
        or self.prefix_len < 1:
      raise ValueError(f'mask_kwargs.prefix_len={self.prefix_len!r}; must be an int >= 1')


register(NamedMask(
    'prefix_lm', lambda prefix_len: Mask(lambda b, h, q, k: (k <= q) | (k < prefix_len),
                                         f'prefix_lm({prefix_len})'),
    PrefixOptions, doc='the first prefix_len tokens see each other, the rest causally '
    '(T5\'s prefix LM); a position that sees the token it predicts is not scored'))
