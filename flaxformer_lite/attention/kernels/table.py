"""Every kernel as a value in one table: a name, what it takes and how it
runs. select.py chooses among them (the only place that does); entry.py
describes the call (`Call`) and runs the chosen one.

A Kernel's `takes(variant)` says from the registry entry alone whether the
kernel can run that scheme at all: None, or the reason it cannot (the
scheme x kernel table of `--list_attention`). Its `supports(call)` says the
same for one call (shapes, dtype, mask, dropout, platform), `takes`
included. Its `run(call, query, key, value)` computes the call: query [b, n,
h, d], key and value [b, m, g, d] -> [b, n, h, dv], or (that, weights [b,
h, n, m]) where the call asks for weights (the dense kernel only).

A new kernel is a module of kernels/ and one Kernel in TABLE; 'auto' takes
it where select.py's preference list for the platform names it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax.numpy as jnp

from flaxformer_lite.attention import masks, softmax
from flaxformer_lite.attention.kernels import pallas_gpu, product, splash
from flaxformer_lite.attention.kernels.specialised import (causal_band, local_blocked,
                                                           relative_banded)
from flaxformer_lite.attention.scheme import (Terms, call_mask, call_tables,
                                               query_key_positions)


@dataclasses.dataclass(frozen=True)
class Call:
  """One attention call as the kernels see it (entry.attend builds it)."""
  variant: Any  # the registry.AttentionVariant
  terms: Terms | None  # its terms for this call's heads; None: a variant of another kind
  kwargs: Mapping[str, Any]  # its options
  params: Mapping[str, Any]  # its parameters (or an inline score's tables)
  query_shape: tuple[int, ...]  # [b, n, h, d]
  key_shape: tuple[int, ...]  # [b, m, g, d]
  dtype: Any  # the computation's
  mask: masks.Mask | None  # None: every key visible
  mask_kind: str | None  # select.mask_kind: 'causal', 'full' or None
  q_offset: Any
  positions: Any  # int [n] where the variant reads positions as data, else None
  bias: Any
  dropout_rate: float  # 0.0 unless dropout is on
  dropout_rng: Any  # None unless dropout is on
  rng: Any
  prev_alignment: Any
  decoding: bool
  return_weights: bool
  chunk_size: int  # the blockwise kernel's block
  platform: str  # 'cpu', 'gpu', 'tpu' (select.platform)
  tiles: Any = None  # the fused kernel's pallas_gpu.Tiles (select.pallas_tiles); None: its own

  @property
  def dropout(self) -> bool:
    return self.dropout_rng is not None


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One row of TABLE (module docstring)."""
  name: str
  takes: Callable[[Any], str | None]
  supports: Callable[[Call], str | None]
  run: Callable[..., Any]
  doc: str


def _always(_) -> None:
  return None


# ----------------------------------------------------------------- dense


def _run_dense(call: Call, query, key, value, *, implementation=None):
  """The variant's dense function `fn`, given what its registry entry says
  it reads (positions, a PRNG key, the earlier alignment); `implementation`
  'xla' or 'cudnn' for jax.nn.dot_product_attention (dot_product, rotary)."""
  variant = call.variant
  b, n, h, _ = call.query_shape
  m = call.key_shape[1]
  if not variant.grouped_kv:
    key, value = _every_head(call, key, value)
  extra = {}
  if variant.uses_positions:
    extra['q_offset'] = call.q_offset
    if call.positions is not None:
      extra['positions'] = call.positions
  if implementation is not None:
    extra['implementation'] = implementation
  if variant.stochastic:
    extra['rng'] = call.rng
  if variant.uses_alignment:
    extra['prev_alignment'] = (jnp.zeros((b, h, n, m), jnp.float32)
                               if call.prev_alignment is None else call.prev_alignment)
  return variant.fn(query, key, value, mask=masks.as_dense(call.mask, b, h, n, m, call.q_offset),
                    bias=call.bias, dropout_rate=call.dropout_rate,
                    dropout_rng=call.dropout_rng, deterministic=not call.dropout,
                    dtype=call.dtype, return_weights=call.return_weights, **call.params,
                    **call.kwargs, **extra)


def _every_head(call: Call, key, value):
  """key, value [b, m, g, d] -> [b, m, h, d] for h query heads: contiguous
  groups, heads [0, h/g) read key/value head 0, and so on."""
  h, g = call.query_shape[2], call.key_shape[2]
  return (key, value) if g == h else (jnp.repeat(x, h // g, axis=2) for x in (key, value))


DENSE = Kernel('dense', _always, _always, _run_dense,
               'the [b, h, n, m] scores: the reference, and the one kernel that returns weights')


# ------------------------------------------------------------- blockwise


def _blockwise_takes(variant) -> str | None:
  if variant.chunked is None:
    return 'its scores need the whole [n, m] array'
  return None


def _blockwise_supports(call: Call) -> str | None:
  if call.bias is not None:
    return 'it takes no explicit bias'
  return _blockwise_takes(call.variant)


def _run_blockwise(call: Call, query, key, value):
  return call.variant.chunked(query, key, value, mask=call.mask, q_offset=call.q_offset,
                              chunk_size=call.chunk_size, dtype=call.dtype,
                              dropout_rate=call.dropout_rate, dropout_rng=call.dropout_rng,
                              **call.params, **call.kwargs)


BLOCKWISE = Kernel('chunked', _blockwise_takes, _blockwise_supports, _run_blockwise,
                   'blocks of queries and keys, an online softmax: O(n) memory '
                   '(kernels/blockwise.py)')


# ---------------------------------------------------------------- pallas


def pallas_runs(terms: Terms | None) -> bool:
  """Whether the fused Pallas kernel runs a scheme given as `terms` (None: a
  variant of another kind): an elementwise `score` or none, and lookups
  (Terms.lookups) for a `block_score` (a term that reads the block's q and
  k), a value lookup for a values term, the plain q.k product."""
  if terms is None or terms.product is not None:
    return False
  if terms.values is not None and terms.value_lookup is None:
    return False
  return terms.score is not None or terms.block_score is None or bool(terms.lookups)


def _pallas_takes(variant) -> str | None:
  if variant.terms is None:
    return 'it is a dense function, not block terms (scheme.Terms)'
  if not pallas_runs(variant.terms(2, **dict(variant.kwargs))):
    return ("it has a term the fused kernel does not run: one that reads the block's q and k "
            "with no lookup per query or key (Transformer-XL's unclipped rows would be "
            "[n, n + m] per head), a values term with no lookup form, or a score that is not "
            "q.k's")
  return None


def _pallas_supports(call: Call) -> str | None:
  if call.bias is not None or call.dropout:
    return 'it takes no explicit bias and no attention dropout'
  if call.mask is not None and masks.closes_over_arrays(call.mask):
    return (f'mask {call.mask.name!r} reads an array its function closed over; the fused '
            'kernel takes a mask\'s data as inputs: give them as masks.Mask(fn, name, '
            'arrays=(...)), fn(b, h, q, k, *arrays)')
  if not pallas_runs(call.terms):
    return _pallas_takes(call.variant)
  if call.terms.prepare is None and call.terms.score is not None:  # the call's arrays
    return pallas_gpu.table_problem(call.params, call.query_shape[2])
  return None


def _run_pallas(call: Call, query, key, value):
  """A scheme's terms on the fused Pallas kernel (kernels/pallas_gpu.py;
  interpreted off a GPU): its tables made once, its q and k maps applied
  before the kernel, its lookup tables made from the mapped q and k, its
  elementwise score inside it. A row that sees no key gets the uniform
  weights of the other kernels (softmax.where_no_key)."""
  terms, dtype = call.terms, call.dtype
  h, d = call.query_shape[2:]
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  query, key, tables, q_pos, k_pos = _mapped(call, query, key)
  scaled = query / jnp.sqrt(d).astype(query.dtype)  # as the kernel scales q.k
  lookups = tuple((t.side, t.index, t.rows(scaled, key, tables)) for t in terms.lookups)
  values = terms.value_lookup and (terms.value_lookup.index, tables[terms.value_lookup.table])
  mask = call_mask(terms, call.mask)
  # A causal rule alone runs as the kernel's own causal bounds, no mask evaluated.
  causal = masks.causal_alone(mask)
  rule = None if causal else mask
  out, lse = pallas_gpu.flash_attention(
      query, key, value, score=terms.score, tables=tables if terms.score else {},
      lookups=lookups, values=values, mask=rule, causal=causal, q_positions=q_pos,
      k_positions=k_pos, q_offset=call.q_offset, interpret=call.platform != 'gpu',
      return_lse=True, **(call.tiles or pallas_gpu.Tiles())._asdict())
  uniform = None if masks.hides_no_row(mask) else lambda: product.repeat_heads(
      terms.uniform(value, tables, q_pos, k_pos), h)  # [b, n, h, dv]
  return softmax.where_no_key(out, lse, uniform).astype(out.dtype)


def _mapped(call: Call, query, key):
  """(query, key) through the scheme's maps (rotary's rotation), positions
  measured from the call's first key as the dense reference measures them
  (one block for the call), with the tables and positions they read:
  (query, key, tables, q_pos [n], k_pos [m])."""
  terms = call.terms
  q_pos, k_pos = query_key_positions(call.query_shape[1], call.key_shape[1], call.q_offset,
                                     call.positions)
  tables = call_tables(terms, call.params, q_pos, k_pos) or {}
  if terms.transform_q is not None:
    query = terms.transform_q(query, tables, q_pos, k_pos[0])
  if terms.transform_k is not None:
    key = terms.transform_k(key, tables, k_pos, k_pos[0])
  return query, key, tables, q_pos, k_pos


PALLAS = Kernel('pallas', _pallas_takes, _pallas_supports, _run_pallas,
                "FlashAttention-2 in Pallas carrying the scheme's score, its lookup tables per "
                'query or key (Shaw, DeBERTa), its value lookup and the mask (Triton on a GPU, '
                'interpreted elsewhere)')


# ------------------------------------------- jax.nn's kernels: cuDNN, XLA

# cuDNN's fused attention: compute dtypes and the largest head size it runs
# on every GPU generation (head sizes a multiple of 8).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def _plain_takes(variant) -> str | None:
  """jax.nn's and splash's kernels run plain q.k (after a map of q and k):
  the variants whose dense function takes them (dot_product, rotary)."""
  if not variant.plain_product:
    return 'it changes the scores; this kernel runs plain q.k (dot_product, rotary)'
  return None


def _xla_supports(call: Call) -> str | None:
  if call.dropout:
    return 'it has no attention dropout'
  return _plain_takes(call.variant)


def cudnn_fits(call: Call) -> str | None:
  """None where cuDNN's kernel runs `call`: a GPU, 16-bit compute, head size
  a multiple of 8 up to CUDNN_MAX_HEAD_DIM, no dropout, no weights, and n, m
  even and above 1 (not a cached decoding step; cuDNN's backward with a mask
  needs even lengths); else why not."""
  (n, d), m = call.query_shape[1::2], call.key_shape[1]
  if call.platform != 'gpu':
    return f'it needs an NVIDIA GPU, and the JAX backend is {call.platform!r}'
  if jnp.dtype(call.dtype) not in CUDNN_DTYPES:
    return f'it computes in {"/".join(jnp.dtype(t).name for t in CUDNN_DTYPES)}'
  if d % 8 or d > CUDNN_MAX_HEAD_DIM:
    return f'head size {d}: it takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM}'
  if call.dropout or call.return_weights:
    return 'it has no attention dropout and returns no weights'
  if n < 2 or m < 2 or n % 2 or m % 2:
    return f'lengths {n} and {m}: it needs even lengths above 1'
  return _plain_takes(call.variant)


XLA = Kernel('xla', _plain_takes, _xla_supports,
             lambda call, q, k, v: _run_dense(call, q, k, v, implementation='xla'),
             "jax.nn.dot_product_attention's XLA path")
CUDNN = Kernel('cudnn', _plain_takes, cudnn_fits,
               lambda call, q, k, v: _run_dense(call, q, k, v, implementation='cudnn'),
               "cuDNN's fused attention (jax.nn.dot_product_attention)")


# ---------------------------------------------------------------- splash

# Splash's kernel: its default block (rows and columns; the lengths must be
# multiples of it), compute dtypes, and head sizes: multiples of the TPU's 128
# lanes.
SPLASH_BLOCK = 128
SPLASH_DTYPES = (jnp.bfloat16, jnp.float32)
SPLASH_HEAD_DIM = 128


def splash_fits(call: Call) -> str | None:
  """None where JAX's Pallas splash kernel runs `call`: a TPU (or explicit
  interpretation elsewhere), a compute dtype of SPLASH_DTYPES, head size a
  multiple of SPLASH_HEAD_DIM, no dropout, no weights, no bias, lengths
  multiples of SPLASH_BLOCK (never a decoding step), and a causal or full
  mask with padding (select.mask_kind); else why not."""
  (n, d), m = call.query_shape[1::2], call.key_shape[1]
  if call.platform != 'tpu':
    return f'it runs on a TPU, and the JAX backend is {call.platform!r}'
  if not splash.available():
    return 'this JAX ships no splash kernel'
  if call.mask_kind is None:
    return 'its mask must be causal or full, with padding at most'
  if jnp.dtype(call.dtype) not in SPLASH_DTYPES:
    return f'it computes in {"/".join(jnp.dtype(t).name for t in SPLASH_DTYPES)}'
  if d % SPLASH_HEAD_DIM:
    return f'head size {d}: it takes multiples of {SPLASH_HEAD_DIM}'
  if call.dropout or call.return_weights or call.bias is not None:
    return 'it has no attention dropout or bias and returns no weights'
  if n % SPLASH_BLOCK or m % SPLASH_BLOCK:
    return f'lengths {n} and {m}: it needs multiples of {SPLASH_BLOCK}'
  return _plain_takes(call.variant)


def _run_splash(call: Call, query, key, value):
  """The scheme's maps of q and k (rotary's rotation), then splash on the
  mask's causal rule and padding."""
  dtype = call.dtype
  query, key, _, _, _ = _mapped(call, query, key)
  rules = masks.rules_of(call.mask)
  return splash.splash_attention(
      query.astype(dtype), key.astype(dtype), value.astype(dtype),
      causal=call.mask_kind == 'causal', query_valid=rules.query_valid, key_valid=rules.key_valid)


SPLASH = Kernel('splash', _plain_takes, splash_fits, _run_splash,
                "JAX's Pallas splash kernel (TPU): causal or full masks with padding")


# ------------------------------------------------ written for one scheme


def _only(name: str):
  """takes(variant) of a kernel written for the scheme `name` alone."""
  def takes(variant) -> str | None:
    return None if variant.name == name else f'it is written for {name} alone'
  return takes


def _shaw_banded_supports(call: Call) -> str | None:
  if call.positions is not None:
    return 'it reads positions as ranges, not as data'
  return _only('shaw')(call.variant)


def _run_shaw_banded(call: Call, query, key, value):
  """Shaw's attention without [n, m, d] tables (relative_banded.py)."""
  (b, n, h, d), m, dtype = call.query_shape, call.key_shape[1], call.dtype
  key, value = _every_head(call, key.astype(dtype), value.astype(dtype))
  out, weights = relative_banded.banded_attention(
      query.astype(dtype) / jnp.sqrt(d).astype(dtype), key, value,
      call.params.get('rel_key_table'), call.params.get('rel_value_table'),
      mask=masks.as_dense(call.mask, b, h, n, m, call.q_offset), bias=call.bias,
      q_offset=call.q_offset, dropout_rate=call.dropout_rate, dropout_rng=call.dropout_rng,
      deterministic=not call.dropout, dtype=dtype)
  return (out, weights) if call.return_weights else out


def _shaw_by_lag_supports(call: Call) -> str | None:
  if call.bias is not None or call.return_weights or call.positions is not None:
    return 'it takes no bias or positions as data and returns no weights'
  return _only('shaw')(call.variant) or causal_band.fits(
      call.mask, call.q_offset, call.query_shape[1], call.key_shape[1], call.params)


def _run_shaw_by_lag(call: Call, query, key, value):
  return causal_band.by_lag(query, key, value, dict(call.params), mask=call.mask,
                            uniform=call.terms.uniform, chunk_size=call.chunk_size,
                            dtype=call.dtype, dropout_rate=call.dropout_rate,
                            dropout_rng=call.dropout_rng)


def _local_blocked_supports(call: Call) -> str | None:
  if call.return_weights:
    return 'it returns no [n, m] weights'
  return _only('local')(call.variant) or local_blocked.fits(
      call.query_shape[1], call.key_shape[1], call.kwargs['window'], call.q_offset)


def _run_local_blocked(call: Call, query, key, value):
  (b, n, h, _), m = call.query_shape, call.key_shape[1]
  key, value = _every_head(call, key, value)
  return local_blocked.blocked_attention(
      query, key, value, window=call.kwargs['window'], causal=call.kwargs['causal'],
      mask=masks.as_dense(call.mask, b, h, n, m, call.q_offset), bias=call.bias, dtype=call.dtype,
      dropout_rate=call.dropout_rate, dropout_rng=call.dropout_rng,
      deterministic=not call.dropout)


SHAW_BANDED = Kernel('shaw_banded', _only('shaw'), _shaw_banded_supports, _run_shaw_banded,
                     "Shaw's attention with no [n, m, d] table: the 2k+1 rows met once, "
                     'spread by distance (kernels/specialised/relative_banded.py)')
SHAW_BY_LAG = Kernel('shaw_by_lag', _only('shaw'), _shaw_by_lag_supports, _run_shaw_by_lag,
                     "Shaw's causal self-attention split by lag: an O(n k) band and blockwise "
                     'plain attention (kernels/specialised/causal_band.py)')
LOCAL_BLOCKED = Kernel('local_blocked', _only('local'), _local_blocked_supports,
                       _run_local_blocked,
                       'local attention in blocks of its window: O(n * window) '
                       '(kernels/specialised/local_blocked.py)')


TABLE: dict[str, Kernel] = {k.name: k for k in (DENSE, BLOCKWISE, PALLAS, CUDNN, SPLASH, XLA,
                                                SHAW_BANDED, SHAW_BY_LAG, LOCAL_BLOCKED)}
