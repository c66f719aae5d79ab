"""The fused Pallas kernel's tiles, measured: for each head dim and length,
every candidate (block_q, block_k, Triton warps, pipeline stages) times the
plain kernel's forward+backward (causal, 8 heads, bfloat16 on a GPU) side by
side, cuDNN beside them on a GPU; the fastest per case is written to the
table select.py reads (flaxformer_lite/attention/pallas_tiles.json), which
`auto` then gives the kernel for that head dim and lengths up to the case's
(select.pallas_tiles). The file is rewritten after every case and keeps the
rows of earlier commands on the same device and jax, so a sweep may be split
over commands (--head_dims 64, then 128) and one stopped early keeps its rows.

  .venv/bin/python benchmarks/pallas_tiles.py    # on a GPU: head dims 64, 128 at 2048, 8192, 32768
  .venv/bin/python benchmarks/pallas_tiles.py --head_dims 64 --batch_at 2048:4 --warps 4 \\
      --out /tmp/t.json
  .venv/bin/python benchmarks/pallas_tiles.py --quick --out /tmp/t.json   # any machine

Off a GPU the kernel runs interpreted: the times say nothing of a GPU, and
--quick (tiny sizes, two candidates) only checks that the script runs.
"""
import argparse
import datetime
import functools
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp

import fused_attention
from flaxformer_lite.attention import select
from flaxformer_lite.attention.kernels import pallas_gpu
from timing import median

GPU_CASES = ((2048, 4), (8192, 1), (32768, 1))  # (n, b): the fused kernel's targets
QUICK_CASES = ((64, 1),)


def candidates(quick: bool, blocks=(64, 128), warps=(4, 8), stages=(2, 3)) -> list:
  """The pallas_gpu.Tiles tried: every query and key block of `blocks`,
  warps and stages (--quick: the default and blocks of 32), the default first."""
  if quick:
    return [pallas_gpu.Tiles(), pallas_gpu.Tiles(32, 32)]
  tried = [pallas_gpu.Tiles(*t) for t in itertools.product(blocks, blocks, warps, stages)]
  return [pallas_gpu.Tiles()] + [t for t in tried if t != pallas_gpu.Tiles()]


def case_steps(n: int, b: int, d: int, heads: int, tiles_list, on_gpu: bool) -> dict:
  """{name: () -> (jitted step, args)}: the plain causal kernel's forward and
  backward under each tiles (named by them), and cuDNN's on a GPU; q, k, v
  [b, n, heads, d] random (fused_attention's steps)."""
  q, k, v, g = fused_attention.inputs(n, b, heads, d, jnp.bfloat16 if on_gpu else jnp.float32)
  steps = {}
  for tiles in tiles_list:
    def attention(q, k, v, params, tiles=tiles):
      del params
      return pallas_gpu.flash_attention(q, k, v, causal=True, interpret=not on_gpu,
                                        **tiles._asdict())
    steps[name_of(tiles)] = functools.partial(fused_attention.grad_step, attention, q, k, v, g, {})
  if on_gpu:
    steps['cudnn'] = functools.partial(fused_attention.jax_nn_step, 'cudnn', q, k, v, g)
  return steps


def name_of(tiles: pallas_gpu.Tiles) -> str:
  return 'q{}k{}w{}s{}'.format(*tiles)


def measure(n: int, b: int, d: int, heads: int, tiles_list, repeats: int, on_gpu: bool) -> dict:
  """One case: every tile's and cuDNN's median ms, the fastest tile, and
  what failed (a tile Triton refuses, too much shared memory, is left out)."""
  measured = fused_attention.measure(case_steps(n, b, d, heads, tiles_list, on_gpu), repeats)
  ms = {name: median(t) for name, t in measured['rounds'].items()}
  tiles = [t for t in tiles_list if name_of(t) in ms]
  if not tiles:
    raise SystemExit(f'n={n} d={d}: no tile compiled: {measured["failed"]}')
  best = min(tiles, key=lambda t: ms[name_of(t)])
  return {'n': n, 'b': b, 'd': d, 'ms': ms, 'temp_mib': measured['temp'],
          'failed': measured['failed'], 'best': best, 'default': name_of(pallas_gpu.Tiles())}


def print_case(c: dict, heads: int):
  """The case's rows, fastest first: ms, x the default tile, x cuDNN, TFLOP/s
  (the causal half of 4 b h n^2 d forward, 3.5x with the backward)."""
  ms = c['ms']
  flops = fused_attention.flops(c['n'], c['b'], heads, c['d'])
  default, cudnn = ms.get(c['default']), ms.get('cudnn')
  print(f"n={c['n']} b={c['b']} d={c['d']}: fastest {name_of(c['best'])}")
  print(f'  {"tiles":<14}{"ms":>9}{"x default":>11}{"x cuDNN":>9}{"TFLOP/s":>9}{"temp MiB":>10}')
  for name in sorted(ms, key=ms.get):
    ratio = lambda ref: f'{ms[name] / ref:.2f}' if ref else '-'  # noqa: E731
    print(f'  {name:<14}{ms[name]:>9.3f}{ratio(default):>11}{ratio(cudnn):>9}'
          f'{flops / (ms[name] / 1e3) / 1e12:>9.1f}{c["temp_mib"][name]:>10.1f}')
  for name, why in c['failed'].items():
    print(f'  {name:<14}failed: {why}')


def machine() -> dict:
  """Where a table is measured: {'device': the device kind, 'jax': its version}."""
  device = jax.devices()[0]
  return {'device': getattr(device, 'device_kind', str(device)), 'jax': jax.__version__}


def table(cases: list[dict], command: str, kept=()) -> dict:
  """The file select.py reads: where and how it was measured, and a row per
  case (head_dim, max_length = the case's n, the fastest tiles, its ms and
  the default's and cuDNN's), after the rows `kept` of cases not measured here."""
  rows = [{'head_dim': c['d'], 'max_length': c['n'], **c['best']._asdict(),
           'ms': round(c['ms'][name_of(c['best'])], 4),
           'default_ms': round(c['ms'].get(c['default'], float('nan')), 4),
           'cudnn_ms': round(c['ms']['cudnn'], 4) if 'cudnn' in c['ms'] else None}
          for c in cases]
  measured = {(r['head_dim'], r['max_length']) for r in rows}
  rows = [r for r in kept if (r['head_dim'], r['max_length']) not in measured] + rows
  return {**machine(), 'date': datetime.date.today().isoformat(), 'command': command,
          'tiles': rows}


def kept_rows(path: str) -> list:
  """The rows of an existing table at `path` measured on this device with
  this jax (a sweep split over several commands adds to them); none else."""
  try:
    with open(path) as f:
      old = json.load(f)
  except (OSError, ValueError):
    return []
  same = all(old.get(key) == value for key, value in machine().items())
  return list(old.get('tiles', [])) if same else []


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--head_dims', type=int, nargs='+', default=None,
                 help='default: 64 128 on a GPU, 16 elsewhere')
  p.add_argument('--batch_at', nargs='+', default=None,
                 help='n:b cases; default: 2048:4 8192:1 32768:1 on a GPU, 64:1 elsewhere')
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--repeats', type=int, default=10)
  p.add_argument('--blocks', type=int, nargs='+', default=[64, 128],
                 help='query and key block sizes tried (powers of two)')
  p.add_argument('--warps', type=int, nargs='+', default=[4, 8])
  p.add_argument('--stages', type=int, nargs='+', default=[2, 3])
  p.add_argument('--quick', action='store_true', help='two candidates, tiny sizes')
  p.add_argument('--out', default=select.PALLAS_TILES_FILE)
  a = p.parse_args(argv)
  try:
    a.cases = [tuple(int(x) for x in item.split(':')) for item in a.batch_at or ()]
  except ValueError:
    p.error(f'--batch_at {a.batch_at}: each is n:b, two ints')
  if any(len(c) != 2 or min(c) < 1 for c in a.cases):
    p.error(f'--batch_at {a.batch_at}: each is n:b with n, b >= 1')
  if any(x < 1 or x & (x - 1) for x in a.blocks + a.warps):
    p.error(f'--blocks {a.blocks} --warps {a.warps}: each a power of two')
  if jax.default_backend() != 'gpu' and a.out == select.PALLAS_TILES_FILE:
    p.error(f'the JAX backend is {jax.default_backend()!r}: interpreted times are no GPU\'s, '
            f'so they do not go in {a.out}; give --out')
  return a


def main(argv=None):
  a = parse_args(argv)
  on_gpu = jax.default_backend() == 'gpu'
  quick = a.quick or not on_gpu
  cases = a.cases or (QUICK_CASES if quick else GPU_CASES)
  dims = a.head_dims or ([16] if quick else [64, 128])
  tiles_list = candidates(quick, a.blocks, a.warps, a.stages)
  print(f'the plain fused kernel, causal fwd+bwd, {a.heads} heads, '
        f'{"bfloat16" if on_gpu else "float32, interpreted"}, {len(tiles_list)} tiles, '
        f'repeats={a.repeats}, {jax.devices()[0]}, jax {jax.__version__}', flush=True)
  command = ' '.join(['benchmarks/pallas_tiles.py', *(argv if argv is not None else sys.argv[1:])])
  start, measured, kept = time.time(), [], kept_rows(a.out)
  for d, (n, b) in itertools.product(dims, cases):
    measured.append(measure(n, b, d, a.heads, tiles_list, a.repeats, on_gpu))
    print_case(measured[-1], a.heads)
    # Rewritten after every case: a run stopped at a lent machine's limit keeps what it measured.
    with open(a.out, 'w') as f:
      json.dump(table(measured, command, kept), f, indent=1)
      f.write('\n')
  print(f'wrote {a.out} ({time.time() - start:.0f} s)')


if __name__ == '__main__':
  main()
