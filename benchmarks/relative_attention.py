"""Relative-position attention inside MultiHeadAttention, side by side.

For each length n: forward+backward time (grad of sum(y**2) w.r.t. params and
input) and XLA temp memory of MultiHeadAttention(d_model, heads) with
dot_product, shaw in each form (naive gather + einsum, the paper's
reshape-and-matmul, banded without [n, m, d] tables) and t5_bias (if
registered); causal self-attention, float32. Ratios are to dot_product: for
time, the median over rounds of the per-round ratio. --variants times a subset
(beside dot_product): the slow naive/matmul forms disturb the others' timings.
'faults' is minor page faults per call: a temp buffer above glibc's mmap
threshold is faulted in afresh every call unless the malloc settings of
./launch.sh apply (./launch.sh run benchmarks/relative_attention.py ...).

  .venv/bin/python benchmarks/relative_attention.py                  # CPU: ~3 min
  .venv/bin/python benchmarks/relative_attention.py --lengths 128 256 512 1024 2048
"""
import argparse
import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.layers import MultiHeadAttention
from timing import interleaved_times, median, memory, page_faults


def variants(k):
  out = {'dot_product': ('dot_product', {})}
  for kernel in ('dense', 'shaw_banded'):
    out[f'shaw/{kernel}'] = ('shaw', {'max_distance': k, 'kernel': kernel})
  if 't5_bias' in registry.names():
    out['t5_bias'] = ('t5_bias', {})
  return out


def grad_fn(layer, mask):
  def loss(params, x):  # x [b, n, f] -> scalar
    return jnp.sum(layer.apply(params, x, mask=mask) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--lengths', type=int, nargs='+', default=[128, 256, 512, 1024])
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--max_distance', type=int, default=16)
  p.add_argument('--repeats', type=int, default=10)
  p.add_argument('--variants', nargs='+', default=None,
                 help='subset of: dot_product shaw/dense shaw/shaw_banded t5_bias')
  p.add_argument('--trials', type=int, default=1,
                 help='run the measurement in this many fresh processes and print the '
                      'median ratio and its range: on a shared CPU a whole process can '
                      'run 10-15%% slower or faster than the next')
  p.add_argument('--json', action='store_true', help=argparse.SUPPRESS)
  a = p.parse_args()
  unknown = sorted(set(a.variants or ()) - set(variants(a.max_distance)))
  if unknown:
    p.error(f'--variants {" ".join(unknown)}: valid: {" ".join(variants(a.max_distance))}')
  if a.trials > 1:
    return trials(a)
  d_model = a.heads * a.head_dim
  if not a.json:
    print(f'b={a.batch} h={a.heads} d={a.head_dim} (d_model={d_model}) k={a.max_distance} '
          f'causal float32 fwd+bwd, repeats={a.repeats}, backend={jax.default_backend()}, '
          f'jax={jax.__version__}')
    print(f'{"n":>5} {"variant":<17}{"ms":>10}{"x dot":>8}{"temp MiB":>11}{"x dot":>8}'
          f'{"faults":>9}')
  for n in a.lengths:
    x = jax.random.normal(jax.random.key(0), (a.batch, n, d_model))  # [b, n, f]
    mask = nn.make_causal_mask(jnp.ones((1, n)), dtype=jnp.bool_)  # [1, 1, n, n]
    fns, mem = {}, {}
    chosen = {k: v for k, v in variants(a.max_distance).items()
              if a.variants is None or k in a.variants or k == 'dot_product'}
    for name, (attention, kwargs) in chosen.items():
      layer = MultiHeadAttention(num_heads=a.heads, attention=attention, attention_kwargs=kwargs)
      params = layer.init(jax.random.key(1), x[:1, :8])
      fns[name] = (grad_fn(layer, mask), (params, x))
      mem[name] = memory(*fns[name])['temp']
    rounds = interleaved_times(fns, a.repeats)
    faults = {name: page_faults(*fns[name]) for name in fns}
    for name in fns:
      # the ratio is the median over rounds of this round's time / dot_product's
      # (each round times every variant once, back to back): steadier than a
      # ratio of medians when the machine's speed drifts.
      ratio = median([t / d for t, d in zip(rounds[name], rounds['dot_product'])])
      if a.json:
        print(json.dumps({'n': n, 'variant': name, 'ms': median(rounds[name]), 'ratio': ratio,
                          'temp': mem[name], 'temp_ratio': mem[name] / mem['dot_product'],
                          'faults': faults[name]}))
      else:
        print(f'{n:>5} {name:<17}{median(rounds[name]):>10.1f}{ratio:>8.2f}'
              f'{mem[name]:>11.1f}{mem[name] / mem["dot_product"]:>8.2f}'
              f'{_faults(faults[name]):>9}')


def _faults(x):
  return '-' if x is None else f'{x:.0f}'


def trials(a):
  """Reruns this script a.trials times, one process each; prints medians."""
  argv = [x for x in sys.argv[1:] if not x.startswith('--trials')]
  if '--trials' in sys.argv:  # '--trials N' as two words
    i = sys.argv.index('--trials')
    argv = sys.argv[1:i] + sys.argv[i + 2:]
  rows = {}
  for _ in range(a.trials):
    out = subprocess.run([sys.executable, __file__, *argv, '--json'], check=True,
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
      if line.startswith('{'):
        r = json.loads(line)
        rows.setdefault((r['n'], r['variant']), []).append(r)
  print(f'b={a.batch} h={a.heads} d={a.head_dim} k={a.max_distance} causal float32 fwd+bwd, '
        f'{a.trials} processes x {a.repeats} rounds, backend={jax.default_backend()}, '
        f'jax={jax.__version__}')
  print(f'{"n":>5} {"variant":<17}{"ms":>10}{"x dot":>8}{"range":>13}{"temp MiB":>11}{"x dot":>8}'
        f'{"faults":>9}')
  for (n, name), rs in rows.items():
    ratios = sorted(r['ratio'] for r in rs)
    print(f'{n:>5} {name:<17}{median([r["ms"] for r in rs]):>10.1f}{median(ratios):>8.2f}'
          f'{ratios[0]:>7.2f}-{ratios[-1]:<5.2f}{rs[0]["temp"]:>11.1f}{rs[0]["temp_ratio"]:>8.2f}'
          f'{_faults(median([r["faults"] for r in rs]) if rs[0]["faults"] is not None else None):>9}')


if __name__ == '__main__':
  main()
