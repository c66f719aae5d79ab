"""Every scheme the fused Pallas kernel runs, timed beside the plain kernel,
cuDNN and XLA's dense attention.

For each (n, b, head dim): attention alone, forward and backward (the grad of
sum(out * g), g a random cotangent [b, n, h, d], w.r.t. q, k, v and the
scheme's parameters), causal, 8 heads: the fused kernel plain
(attend(scheme='dot_product', kernel='pallas'): 'pallas'), cuDNN and XLA
through jax.nn.dot_product_attention ('cudnn' on an NVIDIA GPU only, 'xla'),
and each scheme the kernel runs in the live registry (registry.pallas_runs)
through attend(kernel='pallas') with its default options and random
parameters ('pallas NAME'); Shaw twice, with its values table (its default)
and keys only ('pallas shaw/keys'). All are timed interleaved in one process
(timing.interleaved_times), and each ratio of times is the median over rounds
of that round's ratio.

Columns: median ms; x the plain kernel; x XLA; TFLOP/s (the causal half of
4 b h n^2 d forward, 3.5x that with the backward, FlashAttention's
convention: the same count for every row; FlashAttention-3's published
figure is printed under the table); XLA's compiled temp MiB; the
O(n R) lookup tables a scheme makes per call, with their gradients (Shaw's
q . a^K rows, DeBERTa's c2p and p2c: 2 x b h n R float32); the temp beyond
those tables over the plain kernel's temp; and the GPU targets (TARGETS) that
hold at the row's length, judged pass or FAIL on a GPU only (elsewhere the
kernel runs interpreted, and only its memory means anything). XLA is skipped
where its float32 scores would pass --dense_limit_mib; a kernel that fails to
build or compile is listed under the table with why.

  python3 benchmarks/fused_attention.py            # GPU: n=2048 b=4, 8192 and 32768 b=1; d 64, 128
  .venv/bin/python benchmarks/fused_attention.py   # CPU: n=64 b=1 d=16, float32: ~25 s
  .venv/bin/python benchmarks/fused_attention.py --schemes t5_bias shaw/keys \\
      --lengths 8192 --head_dims 64
"""
from __future__ import annotations

import argparse
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

import timing
from flaxformer_lite.attention import masks, registry, scheme
from flaxformer_lite.attention.entry import attend

PLAIN = 'pallas'
KEYS_ONLY = 'shaw/keys'
# The defaults: the targets' grid on a GPU (bfloat16), a tiny interpreted case elsewhere.
GPU_GRID = {'lengths': [2048, 8192, 32768], 'batch_at': ['2048:4'], 'head_dims': [64, 128],
            'dtype': 'bfloat16', 'repeats': 10}
CPU_GRID = {'lengths': [64], 'batch_at': [], 'head_dims': [16], 'dtype': 'float32',
            'repeats': 3}
# The fused kernel's GPU targets: (rows, quantity, at most, lengths (from, to) it holds at).
HELD = ('pallas t5_bias', f'pallas {KEYS_ONLY}', 'pallas deberta')
TARGETS = (
    ((PLAIN,), 'x cuDNN', 1.1, (0, 8192)),
    ((PLAIN,), 'x cuDNN', 1.3, (8193, math.inf)),
    (HELD, 'x plain', 1.3, (0, math.inf)),
    (('pallas shaw',), 'x plain', 1.5, (0, math.inf)),
    (HELD + ('pallas shaw',), 'x XLA', 0.3, (8192, 8192)),
    (HELD + ('pallas shaw',), 'temp beyond tables x plain', 1.2, (32768, math.inf)),
)
# Printed under the table for its TFLOP/s column (the cuDNN row is measured beside it).
PUBLISHED = ('FlashAttention-3, published (Shah et al. 2024, arXiv:2407.08608; H100 SXM5, '
             '16-bit): up to 740 TFLOP/s forward, 75% of the chip\'s peak; its figures give '
             'causal forward and backward per head dim and length')


def cases() -> dict[str, tuple[str, dict]]:
  """{label: (registry name, options)} of every scheme the fused kernel runs,
  read from the live registry; Shaw twice, 'shaw' (keys and values, its
  default) and 'shaw/keys'."""
  out = {}
  for name in registry.names():
    if registry.pallas_runs(registry.get(name)):
      out[name] = (name, {})
      if name == 'shaw':
        out[KEYS_ONLY] = (name, {'relative_values': False})
  return out


def inputs(n: int, b: int, h: int, d: int, dtype, seed: int = 0):
  """(q, k, v, g), each [b, n, h, d] in dtype: random queries, keys, values
  and the cotangent of the output."""
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(b, n, h, d)), dtype) for _ in range(4))


def grad_step(attention, q, k, v, g, params):
  """(jitted grad of sum(attention(q, k, v, params) * g) w.r.t. q, k, v and
  params, its arguments); q, k, v, g [b, n, h, d], out [b, n, h, d]."""
  def loss(q, k, v, params):
    out = attention(q, k, v, params)  # [b, n, h, d]
    return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), (q, k, v, params)


def _param_specs(name: str, options: dict, h: int, d: int) -> dict:
  """The scheme's {parameter: (shape, initializer, axes)} under options."""
  variant = registry.get(name)
  return variant.params(h, d, registry.resolve_kwargs(name, options)) if variant.params else {}


def scheme_step(name: str, options: dict, q, k, v, g):
  """grad_step of scheme `name` on the fused kernel, causal, with random parameters."""
  def attention(q, k, v, params):
    return attend(q, k, v, scheme=name, kernel='pallas', mask=masks.causal(), params=params,
                  options=options)
  params = scheme.random_params(_param_specs(name, options, q.shape[2], q.shape[3]))
  return grad_step(attention, q, k, v, g, params)


def jax_nn_step(implementation: str, q, k, v, g):
  """grad_step of jax.nn.dot_product_attention on `implementation`, causal."""
  def attention(q, k, v, params):
    del params
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  return grad_step(attention, q, k, v, g, {})


def builds(q, k, v, g, labels, *, on_gpu: bool, dense_limit_mib: float = math.inf):
  """({name: () -> (jitted step, args)}, {name: why it is not run}) for one
  case (q, k, v, g [b, n, h, d]): the plain kernel, XLA (unless its float32
  scores pass dense_limit_mib), cuDNN on a GPU, and the schemes `labels` of
  cases() (None: all)."""
  b, n, h, _ = q.shape
  out = {PLAIN: functools.partial(scheme_step, 'dot_product', {}, q, k, v, g)}
  skipped = {}
  scores_mib = b * h * n * n * 4 / 2**20
  if scores_mib <= dense_limit_mib:
    out['xla'] = functools.partial(jax_nn_step, 'xla', q, k, v, g)
  else:
    skipped['xla'] = f'its scores, {scores_mib:.0f} MiB, pass --dense_limit_mib'
  if on_gpu:
    out['cudnn'] = functools.partial(jax_nn_step, 'cudnn', q, k, v, g)
  for label, (name, options) in cases().items():
    if name != 'dot_product' and (labels is None or label in labels):
      out[f'pallas {label}'] = functools.partial(scheme_step, name, options, q, k, v, g)
  return out, skipped


def tables_mib(label: str, h: int, d: int, q) -> float:
  """MiB of the lookup tables scheme `label` makes per call and their
  gradients (2 x the Terms.lookups rows, [b, h, n, R] each) for q [b, n, h, d]."""
  if label not in cases():
    return 0.0
  name, options = cases()[label]
  variant = registry.get(name)
  if variant.terms is None:
    return 0.0
  terms = variant.terms(h, **registry.resolve_kwargs(name, options))
  params = {p: jax.ShapeDtypeStruct(shape, jnp.float32)
            for p, (shape, _, _) in _param_specs(name, options, h, d).items()}

  def rows(q, params):
    q_pos, k_pos = scheme.query_key_positions(q.shape[1], q.shape[1])
    tables = scheme.call_tables(terms, params, q_pos, k_pos)
    return [lookup.rows(q, q, tables) for lookup in terms.lookups]

  shapes = jax.eval_shape(rows, jax.ShapeDtypeStruct(q.shape, q.dtype), params)
  return 2 * sum(math.prod(s.shape) * s.dtype.itemsize for s in shapes) / 2**20


def measure(steps, repeats: int) -> dict:
  """Compiles and times `steps` ({name: build}) interleaved: {'rounds': {name:
  [ms]}, 'temp': {name: MiB}, 'failed': {name: why}}. A failure to build,
  compile or run once is reported, not raised: these kernels may meet a GPU
  for the first time, and one must not cost the others' rows."""
  fns, temps, failed = timing.compile_all(steps, errors=Exception)
  for name, (fn, args) in list(fns.items()):
    try:
      jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001  (out of memory, a kernel's launch)
      failed[name] = timing.why(e)
      del fns[name], temps[name]
  rounds = timing.interleaved_times(fns, repeats) if fns else {}
  return {'rounds': rounds, 'temp': temps, 'failed': failed}


def flops(n: int, b: int, h: int, d: int) -> float:
  """Forward and backward FLOPs of causal attention: the causal half of
  4 b h n^2 d forward, 3.5x that with the backward (FlashAttention's count)."""
  return 3.5 * 4 * b * h * n * n * d / 2


def _paired(rounds, name: str, base: str) -> float | None:
  """Median over rounds of name's time / base's in the same round."""
  if name not in rounds or base not in rounds:
    return None
  return timing.median([t / u for t, u in zip(rounds[name], rounds[base])])


def summary(measured: dict, n: int, b: int, h: int, d: int, tables: dict) -> dict:
  """{name: {'ms', 'x plain', 'x XLA', 'x cuDNN', 'TFLOP/s', 'temp MiB',
  'tables MiB', 'temp beyond tables x plain'}} from measure's result;
  tables: {name: tables_mib}. A quantity not measured is None."""
  rounds, temps = measured['rounds'], measured['temp']
  out = {}
  for name in rounds:
    ms = timing.median(rounds[name])
    beyond = timing.ratio(temps[name] - tables.get(name, 0.0), temps.get(PLAIN))
    out[name] = {'ms': ms, 'x plain': _paired(rounds, name, PLAIN),
                 'x XLA': _paired(rounds, name, 'xla'),
                 'x cuDNN': _paired(rounds, name, 'cudnn'),
                 'TFLOP/s': flops(n, b, h, d) / (ms / 1e3) / 1e12, 'temp MiB': temps[name],
                 'tables MiB': tables.get(name, 0.0), 'temp beyond tables x plain': beyond}
  return out


def targets(name: str, n: int, values: dict, judged: bool) -> str:
  """The GPU targets (TARGETS) for row `name` at length n, each with its
  value and, where judged, pass or FAIL; '' where none holds."""
  said = []
  for rows, quantity, limit, (low, high) in TARGETS:
    if name in rows and low <= n <= high:
      value = values.get(quantity)
      if value is None:
        said.append(f'{quantity} <= {limit}: not measured')
      else:
        verdict = (': pass' if value <= limit else ': FAIL') if judged else ''
        said.append(f'{quantity} {value:.2f} <= {limit}{verdict}')
  return '; '.join(said)


COLUMNS = (('ms', '.3f'), ('x plain', '.2f'), ('x XLA', '.2f'), ('TFLOP/s', '.3g'),
           ('temp MiB', '.2f'), ('tables MiB', '.2f'), ('temp beyond tables x plain', '.2f'))


def table_lines(case: tuple, values: dict) -> list[str]:
  """The markdown rows of one case (n, b, d): one per kernel measure_case measured."""
  n, b, d = case
  lines = []
  for name, v in values.items():
    cells = [timing.cell(v[column], spec) for column, spec in COLUMNS]
    lines.append(f'| {n} | {b} | {d} | {name} | ' + ' | '.join(cells) + f' | {v["target"]} |')
  return lines


def measure_case(n: int, b: int, h: int, d: int, dtype: str, labels, repeats: int, *,
                 dense_limit_mib: float = math.inf, others=None) -> tuple[dict, dict]:
  """One case, every kernel timed side by side: ({name: summary's values and
  its 'target'}, {name: why it failed or was skipped}).

  labels: the schemes of cases() to time (None: all); others: {name:
  attention(q, k, v, params) -> out [b, n, h, d]} timed beside them (a
  library's kernel). Targets are judged on a GPU only.
  """
  on_gpu = jax.default_backend() == 'gpu'
  q, k, v, g = inputs(n, b, h, d, jnp.dtype(dtype))
  steps, skipped = builds(q, k, v, g, labels, on_gpu=on_gpu, dense_limit_mib=dense_limit_mib)
  for name, attention in (others or {}).items():
    steps[name] = functools.partial(grad_step, attention, q, k, v, g, {})
  measured = measure(steps, repeats)
  tables = {name: tables_mib(name.removeprefix('pallas '), h, d, q) for name in steps}
  values = summary(measured, n, b, h, d, tables)
  for name, row in values.items():
    row['target'] = targets(name, n, row, judged=on_gpu)
  return values, {**skipped, **measured['failed']}


def parse(argv=None):
  """The command line, its defaults the platform's grid; an unknown --schemes
  name exits 2 naming the valid ones."""
  grid = GPU_GRID if jax.default_backend() == 'gpu' else CPU_GRID
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--lengths', type=int, nargs='+', default=grid['lengths'])
  p.add_argument('--batch_at', nargs='*', default=grid['batch_at'],
                 help='length:batch pairs; other lengths use batch 1')
  p.add_argument('--head_dims', type=int, nargs='+', default=grid['head_dims'])
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--dtype', choices=['bfloat16', 'float32'], default=grid['dtype'])
  p.add_argument('--repeats', type=int, default=grid['repeats'])
  p.add_argument('--schemes', nargs='+', default=None,
                 help='a subset of the schemes the kernel runs (default: every one)')
  p.add_argument('--dense_limit_mib', type=float, default=16384,
                 help="skip XLA where its float32 scores b*h*n*n would pass this")
  args = p.parse_args(argv)
  unknown = sorted(set(args.schemes or ()) - set(cases()))
  if unknown:
    p.error(f'--schemes {" ".join(unknown)}: valid: {" ".join(cases())}')
  if not all(re.fullmatch(r'[1-9]\d*:[1-9]\d*', pair) for pair in args.batch_at):
    p.error(f'--batch_at {" ".join(args.batch_at)}: each is length:batch, two positive ints')
  return args


def main(argv=None) -> list[str]:
  """Prints the table case by case, then what failed; returns its rows."""
  args = parse(argv)
  judged = jax.default_backend() == 'gpu'
  batch_at = {int(n): int(b) for n, b in (pair.split(':') for pair in args.batch_at)}
  print(f'# attention alone fwd+bwd, causal, {args.heads} heads, {args.dtype}, '
        f'{jax.devices()[0].device_kind}, jax {jax.__version__}, repeats {args.repeats}; '
        + ('targets judged' if judged else 'GPU targets shown, not judged: the kernel runs interpreted'))
  print('| n | b | d | kernel | ' + ' | '.join(c for c, _ in COLUMNS) + ' | target |')
  print('|' + ' --- |' * (len(COLUMNS) + 5))
  rows, failed = [], []
  for n in args.lengths:
    for d in args.head_dims:
      b = batch_at.get(n, 1)
      values, why = measure_case(n, b, args.heads, d, args.dtype, args.schemes, args.repeats,
                                 dense_limit_mib=args.dense_limit_mib)
      lines = table_lines((n, b, d), values)
      print('\n'.join(lines), flush=True)
      rows += lines
      failed += [f'n={n} d={d} {name}: {reason}' for name, reason in why.items()]
  print(f'- for comparison: {PUBLISHED}')
  for line in failed:
    print(f'- failed: {line}')
  return rows


if __name__ == '__main__':
  main()
