"""Our MultiHeadAttention vs flax.linen.MultiHeadDotProductAttention, side by side.

Self-attention, same sizes, same boolean [1, 1, n, n] mask, no dropout. For each
layer: forward time, forward+backward time (grad of sum(y**2) w.r.t. params and
input), and XLA's memory analysis of the compiled forward+backward. Ratio =
ours / flax: <= 1.00 means ours is no slower / uses no more memory.

  .venv/bin/python benchmarks/attention.py                  # b=4 n=256 f=512 h=8, ~1 min on 2 CPU cores
  .venv/bin/python benchmarks/attention.py --length 1024 --repeats 10 --no-causal
"""
import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.layers import MultiHeadAttention


def build(which, heads, dtype):
  if which == 'ours':
    return MultiHeadAttention(num_heads=heads, attention='dot_product', dtype=dtype)
  return nn.MultiHeadDotProductAttention(num_heads=heads, dtype=dtype)


def make_fns(model):
  def forward(params, x, mask):  # x [b, n, f], mask [1, 1, n, n] -> [b, n, f]
    return model.apply(params, x, mask=mask, deterministic=True)

  def loss(params, x, mask):  # -> scalar
    return jnp.sum(forward(params, x, mask).astype(jnp.float32) ** 2)

  return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1)))


def memory(fn, args):
  """Bytes XLA reserves for temporaries, arguments and outputs of fn(*args)."""
  m = fn.lower(*args).compile().memory_analysis()
  if m is None:  # some backends give no analysis
    return {}
  return {k: getattr(m, f'{k}_size_in_bytes', None) for k in ('temp', 'argument', 'output')}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--length', type=int, default=256)
  p.add_argument('--d_model', type=int, default=512)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--repeats', type=int, default=30, help='timed rounds per layer and pass')
  p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  p.add_argument('--causal', action=argparse.BooleanOptionalAction, default=True)
  a = p.parse_args()

  dtype = jnp.dtype(a.dtype)
  x = jax.random.normal(jax.random.key(0), (a.batch, a.length, a.d_model), dtype)  # [b, n, f]
  ones = jnp.ones((1, a.length), bool)
  if a.causal:
    mask = nn.make_causal_mask(ones, dtype=jnp.bool_)  # [1, 1, n, n]
  else:
    mask = nn.make_attention_mask(ones, ones, dtype=jnp.bool_)  # [1, 1, n, n], all True

  names = ('ours', 'flax')
  fns, args, mems = {}, {}, {}
  for name in names:
    model = build(name, a.heads, dtype)
    params = model.init(jax.random.key(1), x, mask=mask)  # float32 params (param_dtype)
    args[name] = (params, x, mask)
    fwd, fwdbwd = make_fns(model)
    fns[name] = {'fwd': fwd, 'fwd+bwd': fwdbwd}
    mems[name] = {'fwd': memory(fwd, args[name]), 'fwd+bwd': memory(fwdbwd, args[name])}
    for f in fns[name].values():  # compile + warm up
      for _ in range(2):
        jax.block_until_ready(f(*args[name]))

  # Interleave the layers round by round (and alternate who goes first) so
  # that drift in the machine's load hits both alike; report medians.
  times = {(name, pas): [] for name in names for pas in ('fwd', 'fwd+bwd')}
  for r in range(a.repeats):
    for name in (names if r % 2 == 0 else names[::-1]):
      for pas, f in fns[name].items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args[name]))
        times[name, pas].append(1e3 * (time.perf_counter() - t0))

  print(f'b={a.batch} n={a.length} d_model={a.d_model} heads={a.heads} dtype={a.dtype} '
        f'causal={a.causal} repeats={a.repeats} backend={jax.default_backend()} '
        f'devices={jax.device_count()} jax={jax.__version__}')
  rows = []
  for pas in ('fwd', 'fwd+bwd'):
    ours, flax_ = (statistics.median(times[n, pas]) for n in names)
    rows.append((f'{pas} time, median ms', ours, flax_))
  for pas in ('fwd', 'fwd+bwd'):
    for kind in ('temp', 'argument', 'output'):
      ours, flax_ = (mems[n][pas].get(kind) for n in names)
      if ours is not None and flax_ is not None:
        rows.append((f'{pas} {kind} memory, MiB', ours / 2**20, flax_ / 2**20))
  print(f'{"":<28}{"ours":>10}{"flax":>10}{"ours/flax":>11}')
  for label, ours, flax_ in rows:
    ratio = f'{ours / flax_:.2f}' if flax_ else '-'
    print(f'{label:<28}{ours:>10.2f}{flax_:>10.2f}{ratio:>11}')


if __name__ == '__main__':
  main()
