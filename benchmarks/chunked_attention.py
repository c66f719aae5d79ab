"""The chunked attention kernel against each variant's dense form.

  .venv/bin/python benchmarks/chunked_attention.py [--variants dot_product shaw ...]
      [--lengths 512 2048 ...] [--batch_at 2048:4] [--causal/--no-causal]
      [--chunk_sizes 128 256 512] [--dropout 0.1]

For each variant and length: MultiHeadAttention (d_model 512, 8 heads,
float32 by default) forward+backward (the vjp of y = layer(x) with a given
random cotangent dy, w.r.t. the parameters and x, as FlashAttention's
benchmarks call out.backward(dout)) with attention_kwargs.kernel
'dense' and 'chunked' (Shaw's causal calls: 'shaw_by_lag') at each of
--chunk_sizes, all timed interleaved in one
run. Prints a row per chunk size: time (median ms) and XLA's compiled temp
memory (MiB) of each, chunked/dense for both, and the chunked time over
dot_product's chunked time at the same length and chunk size (timed
interleaved with it, so that the ratio is side by side too). Dense is
skipped ('-') where its [b, h, n, n] float32 scores alone would pass
--dense_limit_mib.

--forward_only times the layer's forward pass alone (deterministic), as
evaluation and a prompt's prefill run it.

--cudnn adds dot_product's layer on implementation='cudnn' (jax.nn's fused
cuDNN attention; an NVIDIA GPU and --dtype bfloat16), timed interleaved, and
the chunked time over it (c/cudnn) in dot_product's rows.

--pallas adds the layer on kernel='pallas' (the fused Pallas kernel,
kernels/pallas_gpu.py: Triton on an NVIDIA GPU; elsewhere interpreted, so
only its memory means anything there) for the variants it runs, timed
interleaved, and the chunked time over it (c/pallas).

--masked_blocks adds the chunked kernel masking every block (its blocks
below the causal diagonal too: blockwise.UNMASKED_MIN_SCORES out of reach),
timed interleaved, and the chunked time over it (c/mask).

--no_staircase adds the chunked kernel computing the blocks on the causal
diagonal whole (blockwise.STAIRCASE_ROWS out of reach), timed interleaved, and
the chunked time over it (c/flat).

--padding adds the chunked kernel under a model's padding mask (key_valid
and query_valid, every token valid, as a language model's training windows
are: models.padding_mask passes one to every layer), timed interleaved, and
its time over the chunked time without it (pad/c).

--dropout RATE runs the layer with attention dropout (dropout_rate, not
deterministic, a fixed 'dropout' key) in both kernels, and adds the chunked
time and memory over the chunked kernel's without dropout (c/c0). A
configuration that a kernel refuses prints '-' and, under the row, why.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from flaxformer_lite.attention import masks, registry  # noqa: E402
from flaxformer_lite.attention.kernels import blockwise  # noqa: E402
from flaxformer_lite.layers import MultiHeadAttention  # noqa: E402

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def _step(variant, implementation, chunk_size, dropout, args, x, padding=False):
  """(jitted fwd+bwd of MultiHeadAttention on x [b, n, d_model], its arguments;
  with --forward_only, the jitted forward pass).

  dropout: the layer's attention dropout rate (0: deterministic).
  padding: the mask has a model's padding arrays (every token valid).
  """
  layer = MultiHeadAttention(
      num_heads=args.heads, attention=variant, dtype=DTYPES[args.dtype], dropout_rate=dropout,
      attention_kwargs={'kernel': implementation, 'chunk_size': chunk_size})
  spec = masks.causal() if args.causal else None
  # The parameters from the dense kernel on 8 tokens (a kernel written for a
  # scheme may refuse so short a call; every kernel takes the same parameters).
  params = layer.clone(attention_kwargs={'kernel': 'dense'}).init(jax.random.key(0), x[:, :8],
                                                                  mask=spec)
  if padding:  # after init, which sees 8 tokens: the padding arrays are n long
    valid = masks.padding(jnp.ones(x.shape[:2], bool))
    spec = valid if spec is None else spec & valid

  def loss(params, x, d_y, rng):  # its gradient is the layer's vjp with cotangent d_y
    y = layer.apply(params, x, mask=spec, deterministic=not dropout, rngs={'dropout': rng})
    return jnp.sum(y.astype(jnp.float32) * d_y)

  d_y = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
  if args.forward_only:
    return jax.jit(lambda params, x: layer.apply(params, x, mask=spec)), (params, x)
  return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x, d_y, jax.random.key(2))


class _TracedWith:
  """A jitted step traced with a module constant of kernels/blockwise.py set to
  another value (--masked_blocks, --no_staircase)."""

  def __init__(self, fn, name, value):
    self.fn, self.name, self.value = fn, name, value

  def _traced(self, method, *args):
    saved = getattr(blockwise, self.name)
    setattr(blockwise, self.name, self.value)
    try:
      return method(*args)
    finally:
      setattr(blockwise, self.name, saved)

  def __call__(self, *args):
    return self._traced(self.fn, *args)

  def lower(self, *args):
    return self._traced(self.fn.lower, *args)


def _traced_with(build, name, value):
  def traced_build():
    fn, fn_args = build()
    return _TracedWith(fn, name, value), fn_args
  return traced_build


# The O(n) kernel a scheme runs in place of 'chunked' on a causal call
# (select._written_for): Shaw's split by lag.
OWN_BLOCKWISE = {'shaw': 'shaw_by_lag'}


def _blockwise(variant, args) -> str:
  """The kernel the chunked columns run: 'chunked', or the scheme's own."""
  return OWN_BLOCKWISE.get(variant, 'chunked') if args.causal else 'chunked'


def _chunked(variant, dropout, args, x):
  """{'chunked C': build of its step, for C in --chunk_sizes} (timing.compile_all)."""
  kernel = _blockwise(variant, args)
  return {f'chunked {c}': functools.partial(_step, variant, kernel, c, dropout, args, x)
          for c in args.chunk_sizes}


def _measure(variant, n, b, args, x, dot):
  """({step: temp MiB}, {step: median ms}, {step: why it failed}) of one row group.

  dot: timing.compile_all of dot_product's chunked steps at this length, the
  c/dot_c baseline, timed interleaved with the variant's steps.
  """
  builds = {} if variant == 'dot_product' else _chunked(variant, args.dropout, args, x)
  kernel = _blockwise(variant, args)
  if b * args.heads * n * n * 4 / 2**20 <= args.dense_limit_mib:
    builds['dense'] = functools.partial(_step, variant, 'dense', args.chunk_sizes[0],
                                        args.dropout, args, x)
  if args.dropout:
    builds.update({f'no dropout {c}': functools.partial(_step, variant, kernel, c, 0.0,
                                                        args, x) for c in args.chunk_sizes})
  if args.cudnn and variant == 'dot_product':
    builds['cudnn'] = functools.partial(_step, variant, 'cudnn', args.chunk_sizes[0], 0.0, args, x)
  if args.pallas and registry.pallas_runs(registry.get(variant)):
    builds['pallas'] = functools.partial(_step, variant, 'pallas', args.chunk_sizes[0],
                                         args.dropout, args, x)
  if args.masked_blocks:
    builds.update({f'masked {c}': _traced_with(functools.partial(
        _step, variant, kernel, c, args.dropout, args, x), 'UNMASKED_MIN_SCORES', math.inf)
                   for c in args.chunk_sizes})
  if args.padding:
    builds.update({f'padded {c}': functools.partial(_step, variant, kernel, c, args.dropout,
                                                    args, x, padding=True)
                   for c in args.chunk_sizes})
  if args.no_staircase:
    builds.update({f'flat {c}': _traced_with(functools.partial(
        _step, variant, kernel, c, args.dropout, args, x), 'STAIRCASE_ROWS', math.inf)
                   for c in args.chunk_sizes})
  fns, temps, failed = timing.compile_all(builds)
  dot_fns, dot_temps, dot_failed = dot
  if variant == 'dot_product':
    fns, temps, failed = {**fns, **dot_fns}, {**temps, **dot_temps}, {**failed, **dot_failed}
  else:  # c/dot_c from times taken side by side, not rows apart
    fns.update({f'dot_product {k}': v for k, v in dot_fns.items()})
  times = ({} if args.memory_only else
           {k: timing.median(t) for k, t in timing.interleaved_times(fns, args.repeats).items()})
  return temps, times, failed


def _rows(variant, n, b, args, x, dot):
  """Prints one variant's rows at one length (one per chunk size), then what failed."""
  temps, times, failed = _measure(variant, n, b, args, x, dot)
  for c in args.chunk_sizes:
    chunked, dot_name = f'chunked {c}', f'dot_product chunked {c}'
    t, m = times.get(chunked), temps.get(chunked)
    row = [(times.get('dense'), '9.2f'), (t, '9.2f'), (timing.ratio(t, times.get('dense')), '8.2f'),
           (temps.get('dense'), '9.0f'), (m, '9.0f'), (timing.ratio(m, temps.get('dense')), '7.2f'),
           (timing.ratio(t, times.get(dot_name, times.get(chunked))), '7.2f')]
    if args.dropout:
      row += [(timing.ratio(t, times.get(f'no dropout {c}')), '9.2f'),
              (timing.ratio(m, temps.get(f'no dropout {c}')), '8.2f')]
    if args.masked_blocks:
      row += [(timing.ratio(t, times.get(f'masked {c}')), '6.2f')]
    if args.no_staircase:
      row += [(timing.ratio(t, times.get(f'flat {c}')), '6.2f')]
    if args.padding:
      row += [(timing.ratio(times.get(f'padded {c}'), t), '6.2f')]
    if args.cudnn:
      row += [(times.get('cudnn'), '9.2f'), (timing.ratio(t, times.get('cudnn')), '7.2f')]
    if args.pallas:
      row += [(times.get('pallas'), '9.2f'), (temps.get('pallas'), '10.0f'),
              (timing.ratio(t, times.get('pallas')), '8.2f')]
    print(f'{variant:14s} {n:6d} {b:2d} {c:5d}', *(timing.cell(v, spec) for v, spec in row),
          flush=True)
  for name, why in failed.items():
    print(f'#   {variant} n={n}, {name}: {why}', flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--variants', nargs='+', default=registry.chunked_names())
  parser.add_argument('--lengths', nargs='+', type=int, default=[512, 1024, 2048, 4096])
  parser.add_argument('--batch_at', nargs='*', default=['512:4', '1024:4', '2048:4'],
                      help='length:batch pairs; other lengths use batch 1')
  parser.add_argument('--d_model', type=int, default=512)
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--chunk_sizes', '--chunk_size', nargs='+', type=int, default=[512])
  parser.add_argument('--forward_only', action='store_true',
                      help='time the forward pass alone (evaluation, prefill)')
  parser.add_argument('--dropout', type=float, default=0.0,
                      help='attention dropout rate in both kernels (0: none)')
  parser.add_argument('--cudnn', action='store_true',
                      help="add dot_product on implementation='cudnn' (NVIDIA GPU, bfloat16)")
  parser.add_argument('--pallas', action='store_true',
                      help="add kernel='pallas' (the fused kernel; a GPU's timing)")
  parser.add_argument('--masked_blocks', action='store_true',
                      help='also time the chunked kernel masking every block (c/mask)')
  parser.add_argument('--no_staircase', action='store_true',
                      help='also time the chunked kernel with whole diagonal blocks (c/flat)')
  parser.add_argument('--padding', action='store_true',
                      help="also time the chunked kernel under a model's padding mask (pad/c)")
  parser.add_argument('--dtype', choices=sorted(DTYPES), default='float32')
  parser.add_argument('--causal', action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--dense_limit_mib', type=float, default=4096)
  parser.add_argument('--memory_only', action='store_true',
                      help='compile and report temp memory; no timing (long lengths)')
  args = parser.parse_args(argv)
  batch_at = {int(k): int(v) for k, v in (p.split(':') for p in args.batch_at)}
  print(f'# MultiHeadAttention {"forward" if args.forward_only else "fwd+bwd"}, '
        f'd_model {args.d_model}, {args.heads} heads, '
        f'{args.dtype}, {"causal" if args.causal else "bidirectional"}, attention dropout '
        f'{args.dropout}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores')
  print(f'{"variant":14s} {"n":>6s} {"b":>2s} {"chunk":>5s} {"dense ms":>9s} {"chunk ms":>9s} '
        f'{"time c/d":>8s} {"dense MiB":>9s} {"chunk MiB":>9s} {"mem c/d":>7s} {"c/dot_c":>7s}'
        + (f' {"time c/c0":>9s} {"mem c/c0":>8s}' if args.dropout else '')
        + (f' {"c/mask":>6s}' if args.masked_blocks else '')
        + (f' {"c/flat":>6s}' if args.no_staircase else '')
        + (f' {"pad/c":>6s}' if args.padding else '')
        + (f' {"cudnn ms":>9s} {"c/cudnn":>7s}' if args.cudnn else '')
        + (f' {"pallas ms":>9s} {"pallas MiB":>10s} {"c/pallas":>8s}' if args.pallas else ''),
        flush=True)
  for n in args.lengths:
    b = batch_at.get(n, 1)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(b, n, args.d_model)),
                    DTYPES[args.dtype])
    dot = timing.compile_all(_chunked('dot_product', args.dropout, args, x))
    for variant in args.variants:
      _rows(variant, n, b, args, x, dot)


if __name__ == '__main__':
  main()
