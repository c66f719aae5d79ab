"""Each scheme's registered dense path against the dense paths its terms give.

  ./launch.sh run benchmarks/dense_forms.py [--variants t5_bias shaw ...] [--length 512]

For every variant registered with terms (or those named): the attention
alone, forward+backward (gradients of q, k, v and the scheme's parameters
for a random cotangent), causal, float32, b=4, 8 heads of 64, timed
interleaved in one run:
  registered   the variant's `fn` (a hand-written form where it keeps one);
  block        kernels/reference.dense_attention with the scheme's
               block_score (where it has one; else its score);
  elementwise  the same with its elementwise score (the reference).
Prints median ms and XLA's compiled temp memory (MiB) of each and their
ratios to `registered`: a hand-written form that is not faster than `block`
has no reason to exist. --out FILE also writes the table as markdown
(benchmarks/KERNELS.md includes benchmarks/results/dense_forms.md).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from flaxformer_lite.attention import registry  # noqa: E402, scheme
from flaxformer_lite.attention.kernels import reference  # noqa: E402

FORMS = ('registered', 'block', 'elementwise')


def _builds(name, b, n, h, d):
  """{form: () -> (jitted gradient, args)} for `name` at this size."""
  variant = registry.get(name)
  options = registry.resolve_kwargs(name, {})
  params = scheme.random_params(variant.params(h, d, options) if variant.params else {}, 0)
  terms = variant.terms(h, **options)
  r = np.random.default_rng(0)
  q, k, v, g = (jnp.asarray(r.normal(size=(b, n, h, d)), jnp.float32) for _ in range(4))
  causal = jnp.tril(jnp.ones((n, n), bool))[None, None]

  def build(form):
    def loss(q, k, v, p):
      if form == 'registered':
        out = variant.fn(q, k, v, mask=causal, **p, **options)
      else:
        out = reference.dense_attention(q, k, v, terms, p, mask=causal,
                                        elementwise=form == 'elementwise')
      return jnp.sum(out * g)
    return lambda: (jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), (q, k, v, params))

  return {form: build(form) for form in FORMS}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--variants', nargs='+',
                      default=[n for n in registry.names() if registry.get(n).terms is not None])
  parser.add_argument('--length', type=int, default=512)
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--out', help='also write the table as markdown here')
  args = parser.parse_args(argv)
  markdown = ['| variant | ' + ' | '.join(f'{f} ms (MiB)' for f in FORMS)
              + ' | block / registered |', '| --- |' + ' ---: |' * (len(FORMS) + 1)]
  h, d = 8, 64
  print(f'# dense forms, fwd+bwd, causal float32, b={args.batch}, n={args.length}, {h} heads of '
        f'{d}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores')
  print(f'{"variant":14s}' + ''.join(f' {f + " ms":>14s} {"MiB":>6s}' for f in FORMS)
        + f' {"block/reg":>9s} {"elem/reg":>8s}')
  for name in args.variants:
    fns, temps, failed = timing.compile_all(_builds(name, args.batch, args.length, h, d))
    ms = {f: timing.median(t) for f, t in timing.interleaved_times(fns, args.repeats).items()}
    cells = ''.join(f' {timing.cell(ms.get(f), "14.2f")} {timing.cell(temps.get(f), "6.0f")}'
                    for f in FORMS)
    ratios = (f' {timing.cell(timing.ratio(ms.get("block"), ms.get("registered")), "9.2f")}'
              f' {timing.cell(timing.ratio(ms.get("elementwise"), ms.get("registered")), "8.2f")}')
    print(f'{name:14s}{cells}{ratios}', flush=True)
    markdown.append(f'| {name} | ' + ' | '.join(
        f'{ms[f]:.1f} ({temps[f]:.0f})' if f in ms else '-' for f in FORMS)
        + f' | {timing.cell(timing.ratio(ms.get("block"), ms.get("registered")), ".2f")} |')
    for form, why in failed.items():
      print(f'#   {name} {form}: {why}', flush=True)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(f'### dense forms\n\nfwd+bwd, causal float32, b={args.batch}, n={args.length}, {h} '
              f'heads of {d}; {jax.devices()[0].device_kind}, {os.cpu_count()} cores, '
              f'{datetime.date.today()}\n\n' + '\n'.join(markdown) + '\n')


if __name__ == '__main__':
  main()
