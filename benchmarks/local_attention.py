"""Sliding-window attention: the blocked form against the masked full form, side by side.

Forward+backward time and XLA temp memory of attention.local_attention as
it chooses by shape (the blocked form, [b, h, n/w, w, 3w] logits, cost ~
n * window, where n >= 6 * window) and in its plain form ([b, h, n, n] logits under a band mask, what decoding with a
cache uses; forced here by a traced q_offset), with full dot_product
attention as the baseline; bidirectional window, float32. Ratios are to
dot_product in the same run.

  .venv/bin/python benchmarks/local_attention.py                      # CPU: ~2 min
  .venv/bin/python benchmarks/local_attention.py --lengths 1024 4096 --window 128
"""
import argparse

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import dot_product_attention, entry
from flaxformer_lite.attention.schemes import local
from timing import interleaved_times, median, memory


def grad_fn(attention):
  def loss(q, k, v):
    return jnp.sum(attention(q, k, v) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--lengths', type=int, nargs='+', default=[256, 1024, 2048])
  p.add_argument('--window', type=int, default=64)
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--repeats', type=int, default=5)
  a = p.parse_args()
  w = a.window
  print(f'b={a.batch} h={a.heads} d={a.head_dim} window={w} bidirectional float32 fwd+bwd, '
        f'repeats={a.repeats}, backend={jax.default_backend()}, jax={jax.__version__}')
  print(f'{"n":>5} {"variant":<14}{"ms":>10}{"x dot":>8}{"temp MiB":>11}{"x dot":>8}')
  variants = {
      'dot_product': lambda q, k, v: dot_product_attention(q, k, v),
      # The blocked kernel, and local's dense form (what a decoding cache runs).
      'local': lambda q, k, v: entry.attend(q, k, v, scheme='local', kernel='local_blocked',
                                            options={'window': w}),
      'local/plain': lambda q, k, v: local.local_attention(q, k, v, window=w),
  }
  for n in a.lengths:
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (a.batch, n, a.heads, a.head_dim)) for x in keys)
    fns = {name: (grad_fn(f), (q, k, v)) for name, f in variants.items()}
    mem = {name: memory(*fn)['temp'] for name, fn in fns.items()}
    times = {name: median(t) for name, t in interleaved_times(fns, a.repeats).items()}
    for name in fns:
      print(f'{n:>5} {name:<14}{times[name]:>10.1f}{times[name] / times["dot_product"]:>8.2f}'
            f'{mem[name]:>11.1f}{mem[name] / mem["dot_product"]:>8.2f}')


if __name__ == '__main__':
  main()
