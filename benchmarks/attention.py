"""Our MultiHeadAttention vs flax.linen.MultiHeadDotProductAttention, side by side.

Self-attention, same sizes, same boolean [1, 1, n, n] mask, no dropout. For each
layer: forward time, forward+backward time (grad of sum(y**2) w.r.t. params and
input), and XLA's memory analysis of both compiled functions. Ratio = ours /
flax: <= 1.00 means ours is no slower / uses no more memory. A third column,
jax.nn, is our layer with implementation='xla' (jax.nn.dot_product_attention
in place of our dense path), and the last its ratio ours / jax.nn.

  .venv/bin/python benchmarks/attention.py          # b=4 n=256 f=512 h=8 f32 causal: ~1 min on 2 CPU cores
  .venv/bin/python benchmarks/attention.py --dtype bfloat16 --flax_fp32_softmax
"""
import argparse
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.layers import MultiHeadAttention
from timing import interleaved_times, memory


def build(which, a):
  dtype = jnp.dtype(a.dtype)
  if which == 'ours':
    return MultiHeadAttention(num_heads=a.heads, attention='dot_product', dtype=dtype)
  if which == 'jax.nn':
    return MultiHeadAttention(num_heads=a.heads, attention='dot_product', dtype=dtype,
                              attention_kwargs={'kernel': 'xla'})
  return nn.MultiHeadDotProductAttention(num_heads=a.heads, dtype=dtype,
                                         force_fp32_for_softmax=a.flax_fp32_softmax)


def make_fns(model):
  def forward(params, x, mask):  # x [b, n, f], mask [1, 1, n, n] -> [b, n, f]
    return model.apply(params, x, mask=mask, deterministic=True)

  def loss(params, x, mask):  # -> scalar
    return jnp.sum(forward(params, x, mask).astype(jnp.float32) ** 2)

  return {'fwd': jax.jit(forward), 'fwd+bwd': jax.jit(jax.grad(loss, argnums=(0, 1)))}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--length', type=int, default=256)
  p.add_argument('--d_model', type=int, default=512)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--repeats', type=int, default=100, help='timed calls per layer and pass')
  p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  p.add_argument('--causal', action=argparse.BooleanOptionalAction, default=True)
  p.add_argument('--flax_fp32_softmax', action='store_true',
                 help='flax softmax in float32 like ours (matters for bfloat16 only)')
  a = p.parse_args()

  x = jax.random.normal(jax.random.key(0), (a.batch, a.length, a.d_model), a.dtype)  # [b, n, f]
  ones = jnp.ones((1, a.length), bool)
  if a.causal:
    mask = nn.make_causal_mask(ones, dtype=jnp.bool_)  # [1, 1, n, n]
  else:
    mask = nn.make_attention_mask(ones, ones, dtype=jnp.bool_)  # [1, 1, n, n], all True

  names, passes = ('ours', 'flax', 'jax.nn'), ('fwd', 'fwd+bwd')
  fns, mem = {}, {}
  for name in names:
    model = build(name, a)
    args = (model.init(jax.random.key(1), x, mask=mask), x, mask)  # float32 params
    for pas, f in make_fns(model).items():
      fns[name, pas] = (f, args)
      mem[name, pas] = memory(f, args)
  times = interleaved_times(fns, a.repeats)

  rows = []
  for pas in passes:
    for stat in (statistics.median, min):
      rows.append((f'{pas} time, {stat.__name__} ms', *(stat(times[n, pas]) for n in names)))
  for pas in passes:
    for kind in mem['ours', pas]:
      rows.append((f'{pas} {kind} memory, MiB', *(mem[n, pas].get(kind) for n in names)))

  print(f'b={a.batch} n={a.length} d_model={a.d_model} heads={a.heads} dtype={a.dtype} '
        f'causal={a.causal} flax_fp32_softmax={a.flax_fp32_softmax} repeats={a.repeats} '
        f'backend={jax.default_backend()} jax={jax.__version__}')
  print(f'{"":<28}{"ours":>10}{"flax":>10}{"jax.nn":>10}{"ours/flax":>11}{"ours/jax.nn":>13}')
  for label, ours, flax_, jax_nn in rows:
    to_flax, to_jax_nn = (f'{ours / x:.2f}' if x else '-' for x in (flax_, jax_nn))
    print(f'{label:<28}{ours:>10.2f}{flax_:>10.2f}{jax_nn:>10.2f}{to_flax:>11}{to_jax_nn:>13}')


if __name__ == '__main__':
  main()
