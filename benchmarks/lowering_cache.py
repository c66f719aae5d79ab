"""Time to trace and lower a small jitted function, as the lowerings held in
JAX's caches accumulate, with and without jax.clear_caches() every --every.

Each lowering is of the same 3-op function at a new shape (so none hits a
cache), as a test file's first eager ops and jits are. Why tests/conftest.py
empties the caches between test files: without it a long-lived pytest
worker lowers more slowly the more it has lowered.

  ./launch.sh run benchmarks/lowering_cache.py              # CPU: ~4 min
  ./launch.sh run benchmarks/lowering_cache.py --lowerings 2000 --every 500
"""
import argparse
import time

import jax
import jax.numpy as jnp


def _f(x):
  return jnp.tanh(x) * 2 + 1


def per_lowering_ms(lowerings: int, every: int, clear: bool, first_shape: int) -> list[float]:
  """Mean milliseconds per lowering in each run of `every` lowerings."""
  means, start = [], time.perf_counter()
  for i in range(1, lowerings + 1):
    jax.jit(_f).lower(jax.ShapeDtypeStruct((first_shape + i,), jnp.float32))
    if i % every == 0:
      now = time.perf_counter()
      means.append(1000 * (now - start) / every)
      if clear:
        jax.clear_caches()
      start = time.perf_counter()
  return means


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--lowerings', type=int, default=6000)
  parser.add_argument('--every', type=int, default=1000)
  args = parser.parse_args()
  jax.clear_caches()
  kept = per_lowering_ms(args.lowerings, args.every, clear=False, first_shape=0)
  jax.clear_caches()
  cleared = per_lowering_ms(args.lowerings, args.every, clear=True, first_shape=args.lowerings)
  print(f'{"lowerings so far":>17} | {"ms, caches kept":>15} | {"ms, cleared":>11} | ratio')
  print(f'{"-" * 17} | {"-" * 15} | {"-" * 11} | -----')
  for i, (a, b) in enumerate(zip(kept, cleared)):
    print(f'{(i + 1) * args.every:>17} | {a:>15.1f} | {b:>11.1f} | {a / b:.2f}')


if __name__ == '__main__':
  main()
