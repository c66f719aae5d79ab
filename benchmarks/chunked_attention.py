"""The chunked attention kernel against each variant's dense form.

  .venv/bin/python benchmarks/chunked_attention.py [--variants dot_product shaw ...]
      [--lengths 512 2048 ...] [--batch_at 2048:4] [--causal/--no-causal]

For each variant and length: MultiHeadAttention (d_model 512, 8 heads,
float32 by default) forward+backward (the vjp of y = layer(x) with a given
random cotangent dy, w.r.t. the parameters and x, as FlashAttention's
benchmarks call out.backward(dout)) with attention_kwargs.implementation
'dense' and 'chunked', the two timed interleaved in one run. Prints per row: time (median ms) and
XLA's compiled temp memory (MiB) of each, chunked/dense for both, and the
chunked time over dot_product's chunked time at the same length (timed
interleaved with it, so that the ratio is side by side too). Dense is
skipped ('-') where its [b, h, n, n] float32 scores alone would pass
--dense_limit_mib.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from flaxformer_lite.attention import registry  # noqa: E402
from flaxformer_lite.attention.masks import MaskSpec  # noqa: E402
from flaxformer_lite.layers import MultiHeadAttention  # noqa: E402

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def _step(variant, implementation, args, x):
  layer = MultiHeadAttention(
      num_heads=args.heads, attention=variant, dtype=DTYPES[args.dtype],
      attention_kwargs={'implementation': implementation, 'chunk_size': args.chunk_size})
  spec = MaskSpec(causal=args.causal)
  params = layer.init(jax.random.key(0), x[:, :8], mask=MaskSpec(causal=args.causal))

  def loss(params, x, d_y):  # its gradient is the layer's vjp with cotangent d_y
    return jnp.sum(layer.apply(params, x, mask=spec).astype(jnp.float32) * d_y)

  d_y = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
  return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x, d_y)


def _ratio(a, b):
  """a / b, or None where either was not measured (no dense run, --memory_only)."""
  return None if a is None or b is None else a / b


def _cell(value, spec):
  """value in format spec ('9.0f'), or '-' right-aligned to the same width."""
  return format(value, spec) if value is not None else format('-', '>' + spec.split('.')[0])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--variants', nargs='+', default=registry.chunked_names())
  parser.add_argument('--lengths', nargs='+', type=int, default=[512, 1024, 2048, 4096])
  parser.add_argument('--batch_at', nargs='*', default=['512:4', '1024:4', '2048:4'],
                      help='length:batch pairs; other lengths use batch 1')
  parser.add_argument('--d_model', type=int, default=512)
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--chunk_size', type=int, default=512)
  parser.add_argument('--dtype', choices=sorted(DTYPES), default='float32')
  parser.add_argument('--causal', action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--dense_limit_mib', type=float, default=4096)
  parser.add_argument('--memory_only', action='store_true',
                      help='compile and report temp memory; no timing (long lengths)')
  args = parser.parse_args(argv)
  batch_at = {int(k): int(v) for k, v in (p.split(':') for p in args.batch_at)}
  print(f'# MultiHeadAttention fwd+bwd, d_model {args.d_model}, {args.heads} heads, '
        f'{args.dtype}, {"causal" if args.causal else "bidirectional"}, chunk '
        f'{args.chunk_size}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores')
  print(f'{"variant":14s} {"n":>6s} {"b":>2s} {"dense ms":>9s} {"chunk ms":>9s} '
        f'{"time c/d":>8s} {"dense MiB":>9s} {"chunk MiB":>9s} {"mem c/d":>7s} '
        f'{"c/dot_c":>7s}', flush=True)
  variants = list(dict.fromkeys(['dot_product'] + args.variants))
  for n in args.lengths:
    b = batch_at.get(n, 1)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(b, n, args.d_model)),
                    DTYPES[args.dtype])
    dot_chunked = _step('dot_product', 'chunked', args, x)
    for variant in variants:
      fns = {'chunked': _step(variant, 'chunked', args, x)}
      if b * args.heads * n * n * 4 / 2**20 <= args.dense_limit_mib:
        fns['dense'] = _step(variant, 'dense', args, x)
      mem = {k: timing.memory(fn, a)['temp'] for k, (fn, a) in fns.items()}
      if variant != 'dot_product':  # c/dot_c from times taken side by side, not rows apart
        fns['dot_chunked'] = dot_chunked
      times = ({} if args.memory_only else
               {k: timing.median(t) for k, t in
                timing.interleaved_times(fns, args.repeats).items()})
      times.setdefault('dot_chunked', times.get('chunked'))
      if variant in args.variants:
        row = [(times.get('dense'), '9.0f'), (times.get('chunked'), '9.0f'),
               (_ratio(times.get('chunked'), times.get('dense')), '8.2f'),
               (mem.get('dense'), '9.0f'), (mem['chunked'], '9.0f'),
               (_ratio(mem['chunked'], mem.get('dense')), '7.2f'),
               (_ratio(times.get('chunked'), times['dot_chunked']), '7.2f')]
        print(f'{variant:14s} {n:6d} {b:2d}', *(_cell(v, spec) for v, spec in row), flush=True)


if __name__ == '__main__':
  main()
