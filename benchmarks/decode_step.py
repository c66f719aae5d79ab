"""One cached decode step of MultiHeadAttention, kernel against kernel.

  .venv/bin/python benchmarks/decode_step.py [--batch 4] [--d_model 512] [--heads 8]
      [--cache 16384] [--indices 600 16000] [--window 8] [--kv_heads 1]
      [--chunk_size 512] [--dtype float32] [--repeats 10]

One token through MultiHeadAttention(decode=True) whose cache holds --cache
positions of random keys and values, with cache_index set to each of
--indices: `apply(..., mutable=['cache'])` jitted with the cache and the
index as arguments (one compilation serves every index). The cache is
donated, as decoding's while_loop updates its carry in place: without that
every step would also copy the whole cache. Each row is a pair of steps,
all timed interleaved in one run:

  chunked / dense       dot_product, attention_kwargs.kernel 'chunked' vs 'dense'
  local / dot_product   local (causal, window --window) vs dot_product, both chunked
  GQA / MHA             num_kv_heads=--kv_heads vs --heads, on each kernel

Per row: median ms and XLA's compiled temp memory (MiB) of each side, and
a/b of both. A step whose kernel refuses the configuration prints '-', and
why under the table.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import timing  # noqa: E402
from flaxformer_lite.layers import MultiHeadAttention  # noqa: E402


def _pairs(args):
  """[(label, step a, step b)]; a step is (attention, implementation, num_kv_heads)."""
  mha, gqa = args.heads, args.kv_heads
  return [('chunked / dense', ('dot_product', 'chunked', mha), ('dot_product', 'dense', mha)),
          (f'local w{args.window} / dot_product', ('local', 'chunked', mha),
           ('dot_product', 'chunked', mha)),
          (f'GQA g{gqa} / MHA, dense', ('dot_product', 'dense', gqa),
           ('dot_product', 'dense', mha)),
          (f'GQA g{gqa} / MHA, chunked', ('dot_product', 'chunked', gqa),
           ('dot_product', 'chunked', mha))]


def _set_index(cache, index):
  """The 'cache' collection with every cache_index set to `index`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.full_like(x, index) if path[-1].key == 'cache_index' else x, cache)


def _random_cache(shapes, key):
  """Random keys and values, index 0, for the cache collection's `shapes` (ShapeDtypeStructs)."""
  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [
      jax.random.normal(k, s.shape, s.dtype) if jnp.issubdtype(s.dtype, jnp.floating)
      else jnp.zeros(s.shape, s.dtype) for k, s in zip(keys, leaves)])


def _step(args, attention, implementation, num_kv_heads):
  """(jitted decode step, its arguments (params, cache, token [b, 1, d_model], index)).

  The step maps them to (output [b, 1, d_model], the updated cache).
  """
  options = {'window': args.window, 'causal': True} if attention == 'local' else {}
  layer = MultiHeadAttention(
      num_heads=args.heads, num_kv_heads=num_kv_heads, attention=attention,
      dtype=jnp.dtype(args.dtype), decode=True,
      attention_kwargs={'kernel': implementation, 'chunk_size': args.chunk_size,
                        **options})
  token = jax.random.normal(jax.random.key(1), (args.batch, 1, args.d_model), args.dtype)
  # A full-length input sizes the cache; run, init would attend over all of it.
  full = jax.ShapeDtypeStruct((args.batch, args.cache, args.d_model), jnp.dtype(args.dtype))
  cache = _random_cache(jax.eval_shape(layer.init, jax.random.key(0), full)['cache'],
                        jax.random.key(2))
  params = layer.init(jax.random.key(0), token)['params']  # the same at any length

  def step(params, cache, token, index):
    y, state = layer.apply({'params': params, 'cache': _set_index(cache, index)}, token,
                           mutable=['cache'])
    return y, state['cache']

  return jax.jit(step, donate_argnums=1), (params, cache, token, jnp.int32(0))


class _Decoder:
  """Calls a compiled step at a given index, keeping the cache it donates and gets back."""

  def __init__(self, step, args):
    self.step, (self.params, self.cache, self.token, _) = step, args

  def __call__(self, index):
    y, self.cache = self.step(self.params, self.cache, self.token, index)
    return y, self.cache


def _measure(args):
  """({step: temp MiB}, {(step, index): median ms}, {step: why it failed})."""
  steps = list(dict.fromkeys(s for _, a, b in _pairs(args) for s in (a, b)))
  fns, temps, failed = timing.compile_all(
      {s: (lambda s=s: _step(args, *s)) for s in steps})
  timed = {}
  for s, (fn, fn_args) in fns.items():
    decoder = _Decoder(fn, fn_args)
    timed.update({(s, i): (decoder, (jnp.int32(i),)) for i in args.indices})
  times = {k: timing.median(t) for k, t in timing.interleaved_times(timed, args.repeats).items()}
  return temps, times, failed


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--d_model', type=int, default=512)
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--kv_heads', type=int, default=1, help='GQA key/value heads')
  parser.add_argument('--cache', type=int, default=16384, help='cache length (max_len)')
  parser.add_argument('--indices', type=int, nargs='+', default=[600, 16000])
  parser.add_argument('--window', type=int, default=8, help="local's window")
  parser.add_argument('--chunk_size', type=int, default=512)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--repeats', type=int, default=10)
  args = parser.parse_args(argv)
  if not all(0 <= i < args.cache for i in args.indices):
    parser.error(f'--indices {args.indices}: each must lie in [0, --cache={args.cache})')
  temps, times, failed = _measure(args)
  print(f'# decode step of MultiHeadAttention: b {args.batch}, d_model {args.d_model}, '
        f'{args.heads} heads, cache {args.cache}, {args.dtype}, chunk {args.chunk_size}, '
        f'{jax.devices()[0].device_kind}, {os.cpu_count()} cores, repeats {args.repeats}')
  print(f'{"a / b":28s} {"index":>6s} {"a ms":>8s} {"b ms":>8s} {"time a/b":>8s} '
        f'{"a MiB":>8s} {"b MiB":>8s} {"mem a/b":>7s}')
  for label, a, b in _pairs(args):
    for i in args.indices:
      ta, tb, ma, mb = times.get((a, i)), times.get((b, i)), temps.get(a), temps.get(b)
      row = [(ta, '8.2f'), (tb, '8.2f'), (timing.ratio(ta, tb), '8.2f'), (ma, '8.1f'),
             (mb, '8.1f'), (timing.ratio(ma, mb), '7.2f')]
      print(f'{label:28s} {i:6d}', *(timing.cell(v, spec) for v, spec in row), flush=True)
  for (attention, implementation, g), why in failed.items():
    print(f'#   {attention} {implementation} num_kv_heads={g}: {why}')


if __name__ == '__main__':
  main()
