"""The `auto` kernel policy: which kernel runs one attention call, per platform.

`choose_kernel` answers 'dense' or 'chunked' for a layer's call (registry.py
re-exports it); `cudnn_fits` and `splash_fits` say where dot_product's dense
path is cuDNN's fused kernel (GPU) or JAX's Pallas splash kernel (TPU, for a
mask `mask_kind` reads); `chunk_size` is the chunked kernel's block. Every
threshold is in POLICIES, and `describe` says them in words
(`--list_attention`). The platform is jax.default_backend(), or
`target_platform`'s inside one (to lower for CUDA or TPU on a CPU machine, as
the tests do).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import textwrap

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import masks
from flaxformer_lite.attention.kernels import splash


@dataclasses.dataclass(frozen=True)
class Policy:
  """What 'auto' runs on one platform.

  cudnn: dot_product (grouped-query included) on cuDNN's fused kernel
    where `cudnn_fits`.
  splash: dot_product (grouped-query included) on JAX's Pallas splash
    kernel where `splash_fits`.
  memory_share: dense while one call's scores (b * h * n * m in the compute
    dtype) take at most this share of the device's memory (its allocator's
    bytes_limit); None: dense_max_mib always.
  dense_max_mib: the scores' limit in MiB where memory_share is None or the
    device reports no bytes_limit (lowering for a platform this process
    does not run on).
  chunk_size: the chunked kernel's block, rows and columns.
  pallas: every scheme whose terms the fused Pallas kernel runs
    (`pallas_runs`) on that kernel (kernels/pallas_gpu.py) where
    `pallas_fits`; dot_product keeps cuDNN where that fits.
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
    # On CPU the blocks win only once the scores outgrow the caches by far.
    'cpu': Policy(cudnn=False, memory_share=None, dense_max_mib=256, chunk_size=512),
}
# A backend JAX names otherwise (a plugin) gets the TPU's rule: no fused
# kernel, dense while it fits the device.
OTHER = 'tpu'
# cuDNN's fused attention: compute dtypes and the largest head size it runs
# on every GPU generation (head sizes a multiple of 8).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128
# Splash's kernel: its default block (rows and columns; the lengths must be
# multiples of it), compute dtypes, and head sizes: multiples of the TPU's 128
# lanes (smaller heads stay dense until tried on a TPU).
SPLASH_BLOCK = 128
SPLASH_DTYPES = (jnp.bfloat16, jnp.float32)
SPLASH_HEAD_DIM = 128
# The fused Pallas kernel (Triton): the compute dtypes and head sizes 'auto'
# gives it (powers of two for Triton's tiles; the sizes it is built for).
PALLAS_DTYPES = (jnp.bfloat16, jnp.float16)
PALLAS_HEAD_DIMS = (64, 128)
# The masks a fused kernel reads as structure (`mask_kind`): causal or full,
# each with query and key padding.
MASK_KINDS = ('causal', 'full')

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


def cudnn_fits(query, key, *, dtype=None, dropout=False, return_weights=False) -> bool:
  """Whether dot_product's 'auto' runs query [b, n, h, d], key [b, m, g, d]
  on cuDNN's kernel: a platform that has it, 16-bit compute, d a multiple of
  8 up to CUDNN_MAX_HEAD_DIM, no attention dropout, no weights asked for,
  and n, m even and above 1 (not a cached decoding step; cuDNN's backward
  with a mask needs even lengths)."""
  (n, d), m = query.shape[1::2], key.shape[1]
  return (policy().cudnn and jnp.dtype(dtype or query.dtype) in CUDNN_DTYPES
          and d % 8 == 0 and d <= CUDNN_MAX_HEAD_DIM and not dropout and not return_weights
          and n > 1 and m > 1 and n % 2 == 0 and m % 2 == 0)


def mask_kind(mask, q_offset=0) -> str | None:
  """'causal' or 'full' where `mask` (None, a masks.MaskSpec, a masks.Mask or
  a boolean array) is that rule with query i at position i, plus padding
  (key_valid, query_valid) at most; None for anything else (windows,
  segments, an explicit array, a Mask: a function no fused kernel reads, a
  causal rule offset by q_offset: a decoding step)."""
  if mask is None:
    return 'full'
  if not isinstance(mask, masks.MaskSpec) or mask.window is not None or any(
      x is not None for x in (mask.query_segments, mask.key_segments, mask.dense)):
    return None
  if not mask.causal:
    return 'full'
  return 'causal' if isinstance(q_offset, int) and q_offset == 0 else None


def splash_fits(query, key, *, dtype=None, dropout=False, return_weights=False,
                mask_kind=None) -> bool:
  """Whether dot_product's 'auto' runs query [b, n, h, d], key [b, m, g, d]
  on JAX's Pallas splash kernel: a platform that has it, a compute dtype of
  SPLASH_DTYPES, d a multiple of SPLASH_HEAD_DIM, no attention dropout, no
  weights asked for, n and m multiples of SPLASH_BLOCK (so never a decoding
  step), and a mask of MASK_KINDS (`mask_kind`; None: not expressible)."""
  (n, d), m = query.shape[1::2], key.shape[1]
  return (policy().splash and splash.available() and mask_kind in MASK_KINDS
          and jnp.dtype(dtype or query.dtype) in SPLASH_DTYPES and d % SPLASH_HEAD_DIM == 0
          and not dropout and not return_weights and n % SPLASH_BLOCK == 0
          and m % SPLASH_BLOCK == 0)


def fused_fits(query, key, *, dtype=None, dropout=False, return_weights=False,
               mask_kind=None) -> bool:
  """Whether dot_product's 'auto' runs a fused kernel: `cudnn_fits` or
  `splash_fits`."""
  return (cudnn_fits(query, key, dtype=dtype, dropout=dropout, return_weights=return_weights)
          or splash_fits(query, key, dtype=dtype, dropout=dropout,
                         return_weights=return_weights, mask_kind=mask_kind))


def pallas_runs(terms) -> bool:
  """Whether the fused Pallas kernel runs a scheme given as `terms`
  (scheme.Terms, or None for a variant of another kind): an
  elementwise `score` or none, no `block_score` without one (a term that
  reads the block's q and k), the plain values and q.k product."""
  if terms is None or terms.product is not None or terms.values is not None:
    return False
  return terms.score is not None or terms.block_score is None


def pallas_fits(terms, query, key, *, dtype=None, dropout=False, return_weights=False,
                mask=None) -> bool:
  """Whether 'auto' runs query [b, n, h, d], key [b, m, g, d] on the fused
  Pallas kernel: a platform whose policy has it, a scheme it runs
  (`pallas_runs`), a dtype of PALLAS_DTYPES, d of PALLAS_HEAD_DIMS, no
  dropout, no weights asked for, more than one query (a decoding step is a
  matrix-vector product: the blocks' kernel reads the cache in place), and
  no masks.Mask that closes over its data (masks.closes_over_arrays)."""
  (n, d) = query.shape[1::2]
  return (policy().pallas and pallas_runs(terms)
          and jnp.dtype(dtype or query.dtype) in PALLAS_DTYPES and d in PALLAS_HEAD_DIMS
          and not dropout and not return_weights and n > 1
          and not (isinstance(mask, masks.Mask) and masks.closes_over_arrays(mask)))


def choose_kernel(variant, kernel, query, key, *, return_weights: bool, dtype=None,
                  decoding: bool = False, positions: bool = False,
                  dropout: bool = False, mask_kind: str | None = None, terms=None,
                  mask=None) -> str:
  """'dense', 'chunked' or 'pallas' for query [b, n, h, d] and key [b, m, g, d].

  `variant` is a registry.AttentionVariant, `kernel` its registry.Kernel,
  `terms` its scheme.Terms for this call's heads (None: not a scheme),
  `mask` the call's mask (pallas_fits reads it).
  'auto' keeps the dense path where the weights are asked for (only it has
  them), the variant has no chunked form, or its fused kernel fits
  (`variant.fused_fits`: dot_product's cuDNN, or splash for a mask of
  `mask_kind`); it runs the fused Pallas kernel where `pallas_fits`; when
  `decoding` (queries against a cache) it takes the chunked form where the
  cache spans more than two blocks, whose causal bounds stop at the cache
  index where the dense kernel reads all of it; else dense while the scores,
  b * h * n * m in the compute dtype, fit `dense_max_bytes`. An explicit
  'chunked' with return_weights (plots) runs the dense path too, and so does
  any call given `positions` as data (randomized positions) but the Pallas
  kernel's: a block_score may read a block's positions as a range.
  """
  if kernel.implementation == 'pallas':
    return 'dense' if return_weights else 'pallas'
  fused = pallas_fits(terms, query, key, dtype=dtype, dropout=dropout,
                      return_weights=return_weights, mask=mask)
  if positions and not (kernel.implementation == 'auto' and fused):
    return 'dense'
  if kernel.implementation == 'chunked':
    return 'dense' if return_weights else 'chunked'
  if kernel.implementation != 'auto' or variant.chunked is None or return_weights:
    return 'dense'
  if variant.fused_fits is not None and variant.fused_fits(query, key, dtype=dtype,
                                                            dropout=dropout,
                                                            mask_kind=mask_kind):
    return 'dense'
  if fused:
    return 'pallas'
  (b, n, h, d), m = query.shape, key.shape[1]
  if decoding and m > 2 * chunk_size(kernel.chunk_size):
    return 'chunked'
  limit = policy().table_bias_max
  if limit is not None and n * m > limit and kernel.dense_max_mib is None and (
      _pair_table(variant, h, d)):
    return 'chunked'
  score_bytes = b * h * n * m * jnp.dtype(dtype or query.dtype).itemsize
  return 'dense' if score_bytes <= dense_max_bytes(kernel.dense_max_mib) else 'chunked'


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
  dtypes = '/'.join(jnp.dtype(t).name for t in CUDNN_DTYPES)
  fused = (f'dot_product and rotary (grouped-query too) in {dtypes} on cuDNN (head dim a multiple '
           f'of 8, <= {CUDNN_MAX_HEAD_DIM}; even lengths > 1; no dropout or weights), else '
           if rule.cudnn else '')
  limit = (f'1/{round(1 / rule.memory_share)} of device memory ({rule.dense_max_mib} MiB '
           'where it reports none)' if rule.memory_share else f'{rule.dense_max_mib} MiB')
  if rule.splash:
    dtypes = '/'.join(jnp.dtype(t).name for t in SPLASH_DTYPES)
    fused = (f'dot_product and rotary (grouped-query too) in {dtypes} on Pallas splash for a '
             f'causal or full mask with padding (lengths multiples of {SPLASH_BLOCK}, head dim '
             f'a multiple of {SPLASH_HEAD_DIM}; no dropout or weights), else ')
  if rule.pallas:
    dtypes = '/'.join(jnp.dtype(t).name for t in PALLAS_DTYPES)
    dims = ' or '.join(map(str, PALLAS_HEAD_DIMS))
    fused += (f'every other scheme the fused Pallas kernel runs in {dtypes} on it (head dim '
              f'{dims}; no dropout or weights; more than one query), else ')
  table = (f' A bias looked up per pair from a learned table (T5\'s buckets) goes chunked '
           f'past n*m = {math.isqrt(rule.table_bias_max)}^2.' if rule.table_bias_max else '')
  return (f'{name}: {fused}dense while scores (b*h*n*m*itemsize) <= {limit}, else chunked '
          f'in blocks of {rule.chunk_size}.{table}')


def table(width: int = 100) -> str:
  """`describe` for every platform, then the rules they share, wrapped to
  `width`; starts no JAX backend."""
  shared = ('all: dense where weights are asked for or positions given as arrays; '
            'chunked when decoding against a cache of over two blocks; '
            "attention_kwargs.dense_max_mib and chunk_size, where set, replace the "
            "platform's.")
  paragraphs = ["implementation='auto', by platform (jax.default_backend()):",
                *map(describe, POLICIES), shared]
  return '\n'.join(line for text in paragraphs
                   for line in textwrap.wrap(text, width, subsequent_indent='  '))
