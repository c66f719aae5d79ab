"""The `auto` kernel policy: which kernel (kernels/table.py) runs one
attention call, per platform. The only place that chooses.

`choose(call, requested)` returns the kernel for a call (entry.attend's
kernels.table.Call) and why: the requested one where it supports the call,
or, for 'auto', the platform's first preference that supports it under the
thresholds here. Every threshold is in POLICIES, and `describe` says them in
words (`--list_attention`). The platform is jax.default_backend(), or
`target_platform`'s inside one (to lower for CUDA or TPU on a CPU machine, as
the tests do).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import textwrap

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks
from flaxformer_lite.attention.kernels import pallas_gpu
from flaxformer_lite.attention.kernels import table as kernels


@dataclasses.dataclass(frozen=True)
class Policy:
  """What 'auto' runs on one platform.

  cudnn: dot_product and rotary (grouped-query included) on cuDNN's fused
    kernel where it supports the call (kernels/table.py cudnn_fits).
  splash: the same on JAX's Pallas splash kernel (kernels/table.py
    splash_fits).
  memory_share: dense while one call's scores (b * h * n * m in the compute
    dtype) take at most this share of the device's memory (its allocator's
    bytes_limit); None: dense_max_mib always.
  dense_max_mib: the scores' limit in MiB where memory_share is None or the
    device reports no bytes_limit (lowering for a platform this process
    does not run on).
  chunk_size: the chunked kernel's block, rows and columns.
  pallas: every scheme whose terms the fused Pallas kernel runs on that
    kernel (kernels/pallas_gpu.py) where `_pallas_fits`; dot_product and
    rotary keep cuDNN where that fits.
  table_bias_max: the most query-key pairs (n * m) a head's dense scores
    take a bias looked up per pair from a learned per-head table (T5's
    buckets: parameters with logical axes ('relative', 'heads')) before the
    chunked kernel runs it; None: no such limit.
  """
  cudnn: bool
  memory_share: float | None
  dense_max_mib: int
  chunk_size: int
  table_bias_max: int | None = None
  splash: bool = False
  pallas: bool = False


POLICIES = {
    # Fused, then dense, both beat the blocks wherever they fit in memory;
    # larger blocks keep a GPU's cores busier. The fallback is 1/8 of 16 GiB.
    # The dense backward of a per-pair table lookup adds n * m gradients into
    # a few rows, atomically; the blocks' backward sums them per block first.
    'gpu': Policy(cudnn=True, memory_share=1 / 8, dense_max_mib=2048, chunk_size=1024,
                  table_bias_max=1024 * 1024, pallas=True),
    # Splash is the TPU's fused path: O(n) memory, so it runs at any size.
    'tpu': Policy(cudnn=False, memory_share=1 / 8, dense_max_mib=2048, chunk_size=512,
                  splash=True),
    # On CPU the blocks win from about 100 MiB of scores on, in time and in
    # memory (benchmarks/KERNELS.md, chunked_attention.py: 0.91x the time at
    # 128 MiB, 1.45x at 72 MiB).
    'cpu': Policy(cudnn=False, memory_share=None, dense_max_mib=96, chunk_size=512),
}
# A backend JAX names otherwise (a plugin) gets the TPU's rule: no fused
# kernel, dense while it fits the device.
OTHER = 'tpu'
# The fused Pallas kernel (Triton): the compute dtypes and head sizes 'auto'
# gives it (powers of two for Triton's tiles; the sizes it is built for).
PALLAS_DTYPES = (jnp.bfloat16, jnp.float16)
PALLAS_HEAD_DIMS = (64, 128)
# Where 'auto' runs a scheme densely, the kernels written for it instead:
# Shaw's banded kernel once gathered [n, m, d] tables would hold this many
# elements (n = m = 64 at d = 64: below it the paper's trick on them is the
# faster; benchmarks/relative_attention.py --lengths 32 64 128), and local's
# blocked kernel where m is at least this many times a block's context (2 or
# 3 windows: with fewer keys it saves too little of the [n, m] work to pay
# for the blocking; benchmarks/local_attention.py).
SHAW_BANDED_MIN_ELEMENTS = 2**18
LOCAL_BLOCKED_MIN_RATIO = 2
# The fused kernel's tiles per head dim and length, measured on a GPU by
# benchmarks/pallas_tiles.py, which writes this file (pallas_tiles).
PALLAS_TILES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pallas_tiles.json')

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar('target', default=None)


@contextlib.contextmanager
def target_platform(name: str):
  """Inside it, 'auto' chooses for platform `name` ('gpu', 'tpu', 'cpu'), not
  for jax.default_backend(): to lower for another platform
  (`.lower(lowering_platforms=('cuda',))`)."""
  if name not in POLICIES:
    raise ValueError(f'target_platform({name!r}); valid: {", ".join(POLICIES)}')
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)


def platform() -> str:
  """The platform 'auto' chooses for: target_platform's, else JAX's backend."""
  return _TARGET.get() or jax.default_backend()


def policy(name: str | None = None) -> Policy:
  """POLICIES' entry for `name` (default: `platform()`)."""
  return POLICIES.get(name or platform(), POLICIES[OTHER])


def device_memory(name: str) -> int | None:
  """bytes_limit of this process's first device, where it runs on platform
  `name` and the device reports one; else None."""
  if jax.default_backend() != name:
    return None
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get('bytes_limit')


def dense_max_bytes(dense_max_mib: int | None = None) -> int:
  """The most bytes of scores 'auto' runs densely: attention_kwargs'
  dense_max_mib where set, else the platform's rule (Policy)."""
  if dense_max_mib is not None:
    return dense_max_mib * 2**20
  name = platform()
  rule = policy(name)
  memory = device_memory(name) if rule.memory_share else None
  return int(rule.memory_share * memory) if memory else rule.dense_max_mib * 2**20


def chunk_size(given: int | None = None) -> int:
  """The chunked kernel's block: attention_kwargs' chunk_size where set,
  else the platform's."""
  return given if given is not None else policy().chunk_size


def pallas_tiles(head_dim: int, length: int, terms=None) -> pallas_gpu.Tiles | None:
  """The fused kernel's tiles on a GPU (platform()) for head dim `head_dim`
  and `length` (the longer of n and m), from PALLAS_TILES_FILE: the row of
  that head dim with the least max_length >= length, else its longest.
  None (the kernel's defaults, pallas_gpu.Tiles()) off a GPU, where the
  kernel is interpreted, for a head dim the file does not have, and for
  `terms` (scheme.Terms) with lookups or a value lookup: the table times
  the plain kernel, and a lookup's rows and per-entry sums take more of a
  program's memory, so larger tiles may not compile for them."""
  if platform() != 'gpu' or (terms is not None and (terms.lookups or terms.value_lookup)):
    return None
  row = _tile_row(head_dim, length)
  return None if row is None else pallas_gpu.Tiles(*(row[f] for f in pallas_gpu.Tiles._fields))


def _tile_row(head_dim: int, length: int) -> dict | None:
  """PALLAS_TILES_FILE's row for head dim `head_dim` with the least
  max_length >= length, else its longest; None where it has none."""
  rows = sorted((row for row in _tile_rows(PALLAS_TILES_FILE) if row['head_dim'] == head_dim),
                key=lambda row: row['max_length'])
  if not rows:
    return None
  return next((row for row in rows if row['max_length'] >= length), rows[-1])


def _pallas_measured_faster(call: kernels.Call) -> bool:
  """Whether the tiles table measured the plain fused kernel faster than
  cuDNN at the call's head dim and length (its row's ms and cudnn_ms)."""
  row = _tile_row(call.query_shape[3], max(call.query_shape[1], call.key_shape[1]))
  return bool(row and row.get('cudnn_ms') and row['ms'] < row['cudnn_ms'])


TILE_FIELDS = ('head_dim', 'max_length') + pallas_gpu.Tiles._fields


@functools.lru_cache(maxsize=8)
def _tile_rows(path: str) -> tuple[dict, ...]:
  """The rows of a tiles file (benchmarks/pallas_tiles.py's 'tiles'),
  checked: every field of TILE_FIELDS a positive int, the blocks and warps
  powers of two (Triton's), ms and cudnn_ms (where given) numbers. () where
  there is no file."""
  if not os.path.exists(path):
    return ()
  try:
    with open(path) as f:
      rows = tuple(json.load(f)['tiles'])
    for row in rows:
      values = [row[field] for field in TILE_FIELDS]
      if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f'row {row}: {", ".join(TILE_FIELDS)} must be positive ints')
      if any(row[f] & (row[f] - 1) for f in ('block_q', 'block_k', 'num_warps')):
        raise ValueError(f'row {row}: block_q, block_k and num_warps must be powers of two')
      if not all(isinstance(row.get(f, 0.0) or 0.0, (int, float)) for f in ('ms', 'cudnn_ms')):
        raise ValueError(f'row {row}: ms and cudnn_ms must be numbers')
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{path} is not a table of tiles as benchmarks/pallas_tiles.py writes it '
                     f'({type(e).__name__}: {e}); write it again or delete it') from None
  return rows


def mask_kind(mask, q_offset=0) -> str | None:
  """'causal' or 'full' where `mask` (None or a masks.Mask) is that rule with
  query i at position i, plus padding (masks.key_padding, query_padding) at
  most; None for anything else (windows, segments, any other function, a
  causal rule offset by q_offset: a decoding step)."""
  rules = masks.rules_of(mask)
  if rules is None or rules.window is not None or rules.segments is not None:
    return None
  if not rules.causal:
    return 'full'
  return 'causal' if isinstance(q_offset, int) and q_offset == 0 else None


class Choice(NamedTuple):
  """The kernel that runs a call, and why (a few words for the log)."""
  kernel: kernels.Kernel
  why: str


def _pallas_fits(call: kernels.Call) -> bool:
  """Whether 'auto' gives `call` to the fused Pallas kernel: a platform whose
  policy has it, a dtype of PALLAS_DTYPES, a head size of PALLAS_HEAD_DIMS,
  more than one query (a decoding step is a matrix-vector product: the
  blockwise kernel reads the cache in place), and the kernel supporting it."""
  b, n, h, d = call.query_shape
  return (policy(call.platform).pallas and jnp.dtype(call.dtype) in PALLAS_DTYPES
          and d in PALLAS_HEAD_DIMS and n > 1 and not call.return_weights
          and kernels.PALLAS.supports(call) is None)


def choose(call: kernels.Call, requested: str, dense_max_mib: int | None = None) -> Choice:
  """The kernel that runs `call` (kernels.Call), and why.

  `requested` is a kernel's name (kernels.TABLE) or 'auto'. A requested
  kernel runs where it supports the call (else ValueError naming why), except
  that the weights (plots) and positions given as data (randomized
  positions: a block_score may read a block's positions as a range) come
  from the dense kernel where the blockwise one was asked for, and the
  weights too where the Pallas one was.
  'auto' takes, in order (dense and blockwise replaced by a kernel written
  for the scheme where `_written_for` says): dense where the weights are
  asked for or the variant has no blockwise form; the platform's fused kernel for plain q.k
  (cuDNN on a GPU, splash on a TPU) where it supports the call; the fused
  Pallas kernel where `_pallas_fits`; dense for positions given as data; the
  blockwise kernel when `decoding` against a cache of over two blocks (its
  causal bounds stop at the cache index where the dense kernel reads all of
  it) or for a learned per-pair bias table past table_bias_max pairs; else
  dense while the scores, b * h * n * m in the compute dtype, fit
  `dense_max_bytes`.
  """
  if requested != 'auto':
    kernel = kernels.TABLE[requested]
    if call.return_weights and kernel in (kernels.BLOCKWISE, kernels.PALLAS):
      return Choice(kernels.DENSE, 'weights asked for: only dense has them')
    if call.positions is not None and kernel is kernels.BLOCKWISE:
      return Choice(kernels.DENSE, 'positions given as data')
    reason = kernel.supports(call)
    if reason is not None:
      raise ValueError(f'attention={call.variant.name!r} on kernel={requested!r}: {reason}')
    return Choice(kernel, 'asked for')
  return _auto(call, dense_max_mib)


def _auto(call: kernels.Call, dense_max_mib: int | None) -> Choice:
  """choose(call, 'auto') (its docstring)."""
  variant, rule = call.variant, policy(call.platform)
  b, n, h, d = call.query_shape
  m = call.key_shape[1]
  dtype = jnp.dtype(call.dtype).name
  if call.return_weights:
    return Choice(kernels.DENSE, 'weights asked for: only dense has them')
  if variant.chunked is None:
    return Choice(kernels.DENSE, 'the scheme has no blockwise form')
  fused = _pallas_fits(call)
  faster = fused and _pallas_measured_faster(call)
  for kernel, on in ((kernels.CUDNN, rule.cudnn and not faster), (kernels.SPLASH, rule.splash)):
    if on and kernel.supports(call) is None:
      return Choice(kernel, f'auto: {call.platform}, {dtype}, head dim {d}')
  if fused:
    return Choice(kernels.PALLAS, f'auto: {call.platform}, {dtype}, head dim {d}' + (
        f'; measured faster than cuDNN ({os.path.basename(PALLAS_TILES_FILE)})' if faster else ''))
  if call.positions is not None:
    return Choice(kernels.DENSE, 'positions given as data')
  if call.decoding and m > 2 * call.chunk_size:
    return Choice(kernels.BLOCKWISE, f'auto: decoding against a cache of {m} keys')
  if (rule.table_bias_max is not None and n * m > rule.table_bias_max and dense_max_mib is None
      and _pair_table(variant, h, d)):
    return Choice(kernels.BLOCKWISE, f'auto: a per-pair bias table over {n}x{m} pairs')
  score_bytes = b * h * n * m * jnp.dtype(call.dtype).itemsize
  limit = dense_max_bytes(dense_max_mib)
  sizes = f'{call.platform}, scores {score_bytes / 2**20:.3g} MiB'
  if score_bytes <= limit:
    return _written_for(call, Choice(kernels.DENSE, f'auto: {sizes} <= {limit / 2**20:.3g}'))
  return _written_for(call, Choice(kernels.BLOCKWISE, f'auto: {sizes} > {limit / 2**20:.3g}'))


def _written_for(call: kernels.Call, choice: Choice) -> Choice:
  """`choice` (dense or blockwise), or the kernel written for the scheme in
  its place where it supports the call and pays: Shaw's banded kernel for
  its dense form past SHAW_BANDED_MIN_ELEMENTS, local's blocked kernel past
  LOCAL_BLOCKED_MIN_RATIO, Shaw's split by lag for the blockwise kernel."""
  (b, n, h, d), m = call.query_shape, call.key_shape[1]
  if choice.kernel is kernels.DENSE:
    options = [(kernels.SHAW_BANDED, n * m * d >= SHAW_BANDED_MIN_ELEMENTS,
                f'its [n, m, d] tables {n}x{m}x{d} >= {SHAW_BANDED_MIN_ELEMENTS}')]
    if call.variant.name == 'local':
      context = (2 if call.kwargs['causal'] else 3) * call.kwargs['window']
      options.append((kernels.LOCAL_BLOCKED, LOCAL_BLOCKED_MIN_RATIO * context <= m,
                      f'{m} keys >= {LOCAL_BLOCKED_MIN_RATIO} x its context of {context}'))
  else:
    options = [(kernels.SHAW_BY_LAG, True, 'causal self-attention')]
  for kernel, pays, why in options:
    if pays and kernel.supports(call) is None:
      return Choice(kernel, f'{choice.why}; {why}')
  return choice


def _pair_table(variant, heads: int, head_dim: int) -> bool:
  """Whether `variant` learns a per-head bias looked up per query-key pair
  (a parameter with logical axes ('relative', 'heads'))."""
  if variant.params is None:
    return False
  declared = variant.params(heads, head_dim, dict(variant.kwargs))
  return any(tuple(axes) == ('relative', 'heads') for _, _, axes in declared.values())


def describe(name: str) -> str:
  """What 'auto' runs on platform `name`, in one paragraph."""
  rule = policy(name)
  dtypes = '/'.join(jnp.dtype(t).name for t in kernels.CUDNN_DTYPES)
  fused = (f'dot_product and rotary (grouped-query too) in {dtypes} on cuDNN (head dim a multiple '
           f'of 8, <= {kernels.CUDNN_MAX_HEAD_DIM}; even lengths > 1; no dropout or weights) '
           'unless the fused kernel measured faster there, else ' if rule.cudnn else '')
  limit = (f'1/{round(1 / rule.memory_share)} of device memory ({rule.dense_max_mib} MiB '
           'where it reports none)' if rule.memory_share else f'{rule.dense_max_mib} MiB')
  if rule.splash:
    dtypes = '/'.join(jnp.dtype(t).name for t in kernels.SPLASH_DTYPES)
    fused = (f'dot_product and rotary (grouped-query too) in {dtypes} on Pallas splash for a '
             f'causal or full mask with padding (lengths multiples of {kernels.SPLASH_BLOCK}, head dim '
             f'a multiple of {kernels.SPLASH_HEAD_DIM}; no dropout or weights), else ')
  if rule.pallas:
    dtypes = '/'.join(jnp.dtype(t).name for t in PALLAS_DTYPES)
    dims = ' or '.join(map(str, PALLAS_HEAD_DIMS))
    fused += (f'every other scheme the fused Pallas kernel runs in {dtypes} on it (head dim '
              f'{dims}; no dropout or weights; more than one query; its tiles from '
              f'{os.path.basename(PALLAS_TILES_FILE)} where benchmarks/pallas_tiles.py measured '
              'them), else ')
  table = (f' A bias looked up per pair from a learned table (T5\'s buckets) goes chunked '
           f'past n*m = {math.isqrt(rule.table_bias_max)}^2.' if rule.table_bias_max else '')
  return (f'{name}: {fused}dense while scores (b*h*n*m*itemsize) <= {limit}, else chunked '
          f'in blocks of {rule.chunk_size}.{table}')


def table(width: int = 100) -> str:
  """`describe` for every platform, then the rules they share, wrapped to
  `width`; starts no JAX backend."""
  shared = ('all: dense where weights are asked for or positions given as arrays; '
            'chunked when decoding against a cache of over two blocks; '
            "a scheme's own kernel in place of dense or chunked where it takes the call: "
            f'shaw_banded past [n, m, d] = {SHAW_BANDED_MIN_ELEMENTS} elements of gathered '
            f'tables, local_blocked where m >= {LOCAL_BLOCKED_MIN_RATIO}x its context, '
            'shaw_by_lag for causal self-attention in place of chunked; '
            "attention_kwargs.dense_max_mib and chunk_size, where set, replace the "
            "platform's.")
  paragraphs = ["kernel 'auto', by platform (jax.default_backend()):",
                *map(describe, POLICIES), shared]
  return '\n'.join(line for text in paragraphs
                   for line in textwrap.wrap(text, width, subsequent_indent='  '))
