"""One prepared accelerator check: what a GPU user meets, as one table.
  benchmarks/gpu_check.sh [--quick] [--skip SECTION ...] [--only SECTION ...]
      [--budget SECONDS] [--out DIR]
Sections, in this order, each in processes of its own (a section that fails or
outruns its share of --budget prints why, and the rest go on):
  compile  benchmarks/compile_flags.py: the recipe's train step, eval step and
           sampler compiled under the project's XLA flags and XLA's own.
  recipe   experiments/tiny_shakespeare.py (the nanoGPT recipe) with an empty
           compilation cache: seconds to its first step, steps/s, the whole
           run's wall time, the best validation loss; then the same command
           in a fresh workdir on the now warm cache, to its first step.
  kernels  MultiHeadAttention forward+backward (d_model 512, 8 heads, causal)
           of dot_product, alibi, t5_bias and shaw at n=2048 (b=4) and n=8192
           (b=1), bfloat16 and float32: ms of the dense, chunked and (dot_product
           in 16 bits) cuDNN kernels, and the kernel `auto` picks, read from
           the lowered program (a cuDNN call, a loop over blocks, or neither).
  scan     benchmarks/scan_layers.py: the recipe's model with its layers unrolled
           and scanned (model.scan_layers), compile and step time.
  mfu      benchmarks/train_throughput.py: Transformer-big, bfloat16, batch 64.
  mha      benchmarks/attention.py: our layer against Flax's at n=2048, b=4.
  smollm2  benchmarks/pretrained_speed.py --random_weights: SmolLM2-shaped
           prefill and decode, ours against transformers (same random weights).
  nanogpt  nanoGPT's own train.py on the same recipe (its source from
           $FFL_NANOGPT_DIR or .gpu_carry/nanogpt, benchmarks/gpu_carry.sh;
           torch from this Python or --torch_python): seconds to its first
           iteration, ms an iteration, the best validation loss.
  tests    as much of the test suite as the time left allows (attention and
           decoding first); not with --quick.
--quick: tiny sizes and a few steps, for any machine (the test suite runs it on
CPU). Prints the table last and writes results.md and results.json to --out
(default benchmarks/results/gpu).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_DIR = tempfile.gettempdir()  # main() sets --out
TORCH_PYTHON = None  # main() sets --torch_python
SECTIONS = ('compile', 'recipe', 'kernels', 'scan', 'mfu', 'mha', 'smollm2', 'nanogpt', 'tests')
# Each section's share of --budget, in the order they run; 'tests' takes the rest.
SHARES = {'compile': 0.18, 'recipe': 0.23, 'kernels': 0.21, 'scan': 0.06, 'mfu': 0.07,
          'mha': 0.04, 'smollm2': 0.08, 'nanogpt': 0.1}
# bf16 dense matmul peaks (datasheets), TFLOP/s, for the MFU row.
PEAK_TFLOPS = {'H100': 989.0, 'H200': 989.0, 'A100': 312.0}
QUICK_RECIPE = ['--config.model.d_model=32', '--config.model.num_heads=2',
                '--config.model.mlp_dim=64', '--config.model.num_decoder_layers=2',
                '--config.model.max_len=32', '--config.data.max_len=32',
                '--config.train.batch_size=4', '--config.train.num_steps=3',
                '--config.train.log_every=1', '--config.train.eval_every=3',
                '--config.eval.batch_size=16', '--config.eval.max_examples=32',
                '--config.eval.sample_len=8', '--config.eval.final_test=False']


def _env(**extra):
  """The environment of a command run here: the repository importable (also
  with FFL_PYTHON's interpreter, which has no editable install)."""
  env = {**os.environ, **extra}
  env['PYTHONPATH'] = REPO + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
  return env


class Rows:
  """The table: (section, quantity, value, target or anchor)."""

  def __init__(self):
    self.rows: list[tuple[str, str, str, str]] = []

  def add(self, section, quantity, value, target=''):
    self.rows.append((section, quantity, str(value), target))
    print(f'  {section:8} {quantity}: {value}' + (f'   [{target}]' if target else ''), flush=True)


def _run_until(command, log_path, deadline, *, cwd, env=None, stop=signal.SIGTERM,
               grace=25.0, watch=None):
  """Runs `command` with its output in log_path until it exits or `deadline`
  (time.time()); then sends `stop` and, after `grace` seconds, kills it.
  Returns (log, whether it was stopped, exit code, seconds from launch until
  `watch` first appeared in the log, or None)."""
  start, seen = time.time(), None
  with open(log_path, 'w') as log_file:
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_file,
                            stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None and time.time() < deadline:
      if watch and seen is None:
        with open(log_path) as f:
          seen = time.time() - start if watch in f.read() else None
      time.sleep(0.25)
    stopped = proc.poll() is None
    if stopped:
      proc.send_signal(stop)
      try:
        proc.wait(timeout=grace)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
  with open(log_path) as f:
    log = f.read()
  if watch and seen is None and watch in log:
    seen = time.time() - start
  return log, stopped, proc.returncode, seen


def _table_cells(out: str) -> list[str]:
  """The rows of the markdown tables a script printed, cells joined by '; '."""
  return ['; '.join(c.strip() for c in line.strip('| ').split('|'))
          for line in out.splitlines() if line.startswith('|') and not set(line) <= set('|- :')]


def _python_with(*modules) -> str | None:
  """A Python that imports `modules`: --torch_python, else this one, else None."""
  for python in (TORCH_PYTHON, sys.executable):
    if python and subprocess.run([python, '-c', f'import {", ".join(modules)}'],
                                 capture_output=True, timeout=120).returncode == 0:
      return python
  return None


# ---------------------------------------------------------------- compile


def compile_settings(rows: Rows, quick: bool, seconds: float):
  """benchmarks/compile_flags.py's settings 'project' and 'xla defaults'."""
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import compile_flags
  names = ['project'] if quick else ['project', 'xla defaults']  # (the same flags on CPU)
  results = compile_flags.run(names, timeout=seconds / len(names), quick=quick)
  for name, r in results.items():
    rows.add('compile', f'{name}: state built / train step / eval + sampler compile (s); '
             'step ms', r if isinstance(r, str) else
             f"{r['setup_s']:.1f} / {r['compile_s']:.1f} / {r['eval_compile_s']:.1f}; "
             f"{r['step_ms']:.2f}")


# ---------------------------------------------------------------- recipe


def _recipe_command(workdir, quick):
  return [sys.executable, '-m', 'flaxformer_lite.main',
          '--config=experiments/tiny_shakespeare.py', f'--workdir={workdir}',
          *(QUICK_RECIPE if quick else [])]


def _first_step_seconds(log: str) -> float | None:
  match = re.search(r'first step done, ([\d.]+) s after the process started', log)
  return float(match.group(1)) if match else None


def _step_itself(log: str) -> str:
  """'N.N' seconds of the first train step's own call (its line's parenthesis), or '-'."""
  match = re.search(r'first step done, .*\(the step itself ([\d.]+) s\)', log)
  return match.group(1) if match else '-'


def recipe(rows: Rows, quick: bool, seconds: float):
  """The nanoGPT recipe: a whole run on an empty cache, then the same command
  on the warm cache until its first step."""
  tmp = tempfile.mkdtemp(prefix='gpu_check_recipe_')
  env = _env(FFL_COMPILE_CACHE=os.path.join(tmp, 'cache'))
  deadline = time.time() + seconds
  start = time.time()
  log_path = os.path.join(tmp, 'cold.log')
  # Out of time: the run saves its step and stops (SIGTERM), and what it logged is reported.
  log, stopped, code, _ = _run_until(_recipe_command(os.path.join(tmp, 'cold'), quick),
                                     log_path, deadline - 40, cwd=REPO, env=env)
  wall = time.time() - start
  if code != 0 and not stopped:
    raise RuntimeError(f'the recipe exited {code}: {log[-1500:]}')
  rows.add('recipe', 'first step, empty cache (s after launch)', _first_step_seconds(log),
           'target <= 30 s')
  rows.add('recipe', '  the step itself, empty cache (s)', _step_itself(log))
  for name, took in re.findall(r'\d\d:\d\d:\d\d (.+?) compiled in ([\d.]+) s', log):
    rows.add('recipe', f'  {name} compiled (s)', took)
  rates = [float(r) for r in re.findall(r'([\d.]+) steps/s', log)][1:]
  rows.add('recipe', 'steps/s (median of the logged windows)',
           f'{statistics.median(rates):.1f}' if rates else '-')
  steps = re.findall(r'step (\d+)/(\d+)', log)
  rows.add('recipe', 'whole run, wall (s)' + (
      f' STOPPED at the time limit, step {steps[-1][0]} of {steps[-1][1]}' if stopped and steps
      else ' STOPPED at the time limit' if stopped else ''), f'{wall:.0f}', 'target <= 150 s')
  evals = []
  metrics = os.path.join(tmp, 'cold', 'metrics.jsonl')
  with open(metrics) if os.path.exists(metrics) else contextlib.nullcontext([]) as f:
    for line in f:
      record = json.loads(line)
      if record.get('split') == 'eval' and 'loss' in record:
        evals.append((record['loss'], record['step']))
  best = min(evals) if evals else None
  rows.add('recipe', 'best validation loss (at step)',
           f'{best[0]:.4f} ({best[1]})' if best else '-', 'target <= 1.48; nanoGPT 1.4697')

  warm = subprocess.Popen(_recipe_command(os.path.join(tmp, 'warm'), quick), cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  for line in warm.stdout:  # (a silent hang is bounded by the section's own timeout)
    lines.append(line)
    if 'first step done' in line or time.time() > deadline + 60:
      break
  warm.send_signal(signal.SIGTERM)
  try:
    warm.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    warm.kill()
  log = ''.join(lines)
  shutil.copy(log_path, os.path.join(LOG_DIR, 'recipe_cold.log'))
  with open(os.path.join(LOG_DIR, 'recipe_warm.log'), 'w') as f:
    f.write(log)
  rows.add('recipe', 'first step, warm cache (s after launch)', _first_step_seconds(log),
           'target <= 5 s')
  rows.add('recipe', '  the step itself, warm cache (s)', _step_itself(log))
  served = re.findall(r'\d\d:\d\d:\d\d (.+?): cache, ', log)
  rows.add('recipe', '  served by the cache', ', '.join(served) or 'nothing')


# ---------------------------------------------------------------- kernels


def kernel_cases(quick):
  """(variant, n, b, dtype) of the kernel table."""
  if quick:
    return [('dot_product', 64, 1, 'bfloat16'), ('alibi', 64, 1, 'float32')]
  sizes = [(2048, 4), (8192, 1)]
  return [(v, n, b, dtype) for dtype in ('bfloat16', 'float32') for n, b in sizes
          for v in ('dot_product', 'alibi', 't5_bias', 'shaw')]


def picked(lowered_text: str) -> str:
  """Which kernel a lowered attention program runs: cuDNN's fused call, the
  Pallas kernel's Triton call, the chunked kernel's loop over blocks, else
  the dense path."""
  if '__cudnn$fmha' in lowered_text:
    return 'cudnn'
  if '__gpu$xla.gpu.triton' in lowered_text:
    return 'pallas'
  if 'stablehlo.while' in lowered_text:
    return 'chunked'
  return 'dense'


def kernels_section(quick: bool, repeats: int) -> list[dict]:
  """Runs in a process of its own (--section kernels): one dict per case."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import timing
  from flaxformer_lite.attention import registry
  from flaxformer_lite.attention.masks import MaskSpec
  from flaxformer_lite.layers import MultiHeadAttention

  d_model, heads = (32, 2) if quick else (512, 8)
  on_gpu = jax.default_backend() == 'gpu'
  out = []
  for variant, n, b, dtype in kernel_cases(quick):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(b, n, d_model)), jnp.float32)
    d_y = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    spec = MaskSpec(causal=True)

    def build(implementation):
      layer = MultiHeadAttention(num_heads=heads, attention=variant, dtype=jnp.dtype(dtype),
                                 attention_kwargs={'implementation': implementation})
      params = layer.init(jax.random.key(0), x[:, :8], mask=spec)

      def loss(params, x):
        return jnp.sum(layer.apply(params, x, mask=spec).astype(jnp.float32) * d_y)
      return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)

    kernels = ['dense', 'chunked']
    if variant == 'dot_product' and dtype != 'float32' and on_gpu:
      kernels.append('cudnn')
    if registry.pallas_runs(registry.get(variant)) and dtype != 'float32' and on_gpu:
      kernels.append('pallas')
    fns, temps, failed = timing.compile_all({k: lambda k=k: build(k) for k in kernels})
    auto_fn, auto_args = build('auto')
    auto = picked(auto_fn.lower(*auto_args).as_text())
    times = timing.interleaved_times(fns, repeats)
    row = {'variant': variant, 'n': n, 'b': b, 'dtype': dtype, 'auto': auto,
           'ms': {k: timing.median(v) for k, v in times.items()}, 'temp_mib': temps,
           'failed': failed}
    print('KERNEL ' + json.dumps(row), flush=True)
    out.append(row)
  return out


def fused_cases(quick):
  """(n, b, head_dim) of the attention-only table: the Pallas score kernel
  against cuDNN and XLA's dense attention (bf16, causal, 8 heads)."""
  if quick:
    return [(64, 1, 16)]
  # n=256, b=64: the nanoGPT recipe's batch, where auto's dot_product choice
  # (cuDNN) against the Pallas kernel matters most to its users.
  return [(256, 64, 64), (2048, 4, 64), (8192, 1, 64), (2048, 4, 128), (32768, 1, 64)]


def fused_section(quick: bool, repeats: int) -> list[dict]:
  """Attention alone, forward and backward: kernels/pallas_gpu.py (plain and
  with ALiBi's slopes as a score), cuDNN and XLA through
  jax.nn.dot_product_attention, and tokamax.dot_product_attention where
  tokamax imports; TFLOP/s counts the causal half of
  4 * b * h * n^2 * d forward (3.5x that with the backward, FlashAttention's
  convention). On CPU (--quick) the Pallas kernel runs interpreted."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import timing
  from flaxformer_lite.attention import registry
  from flaxformer_lite.attention.kernels import pallas_gpu

  on_gpu = jax.default_backend() == 'gpu'
  try:  # a Pallas kernel library (benchmarks/gpu_carry.sh carries its wheels)
    import tokamax
  except Exception as e:  # noqa: BLE001  (missing, or its own imports fail)
    tokamax = None
    if on_gpu:
      print(f'FUSED-NOTE tokamax not measured: {type(e).__name__}: {str(e)[:200]}', flush=True)
  heads = 2 if quick else 8
  alibi = registry.get('alibi').terms(heads)  # the scheme's own score and tables
  alibi_tables = {}  # ALiBi's slopes are a formula of the head index
  t5 = registry.get('t5_bias').terms(heads, **registry.resolve_kwargs('t5_bias', {}))
  t5_table = jnp.asarray(np.random.default_rng(2).normal(size=(32, heads)) * 0.1, jnp.float32)

  out = []
  for n, b, d in fused_cases(quick):
    rng = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(rng.normal(size=(b, n, heads, d)), jnp.bfloat16) for _ in range(4))

    def grad_of(attend):
      def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
      return lambda: (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v))

    builds = {
        'pallas': grad_of(lambda q, k, v: pallas_gpu.flash_attention(
            q, k, v, causal=True, interpret=not on_gpu)),
        'pallas alibi': grad_of(lambda q, k, v: pallas_gpu.flash_attention(
            q, k, v, causal=True, score=alibi.score, tables=alibi_tables,
            interpret=not on_gpu)),
        'xla': grad_of(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation='xla')),
    }
    if on_gpu:
      builds['cudnn'] = grad_of(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation='cudnn'))
      if tokamax is not None:  # its own choice of kernel, as a user calls it
        builds['tokamax'] = grad_of(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=True))
      builds['pallas t5_bias'] = grad_of(lambda q, k, v: pallas_gpu.flash_attention(
          q, k, v, causal=True, score=t5.score,
          tables=t5.prepare({'rel_embedding': t5_table}, None, None)))
    fns, temps, failed = timing.compile_all(builds)
    times = timing.interleaved_times(fns, repeats)
    ms = {name: timing.median(v) for name, v in times.items()}
    flops = 3.5 * 4 * b * heads * n * n * d / 2
    row = {'n': n, 'b': b, 'd': d, 'ms': ms, 'temp_mib': temps, 'failed': failed,
           'tflops': {name: flops / (t / 1e3) / 1e12 for name, t in ms.items()}}
    print('FUSED ' + json.dumps(row), flush=True)
    out.append(row)
  return out


def kernels(rows: Rows, quick: bool, seconds: float):
  try:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), '--section', 'kernels',
                           *(['--quick'] if quick else [])], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=seconds)
    stdout, failure = proc.stdout, (proc.returncode != 0 and proc.stderr[-1500:])
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or '')
    failure = f'stopped at the time limit ({seconds:.0f} s)'
  else:
    stderr = proc.stderr
  with open(os.path.join(LOG_DIR, 'kernels.log'), 'w') as f:
    f.write(stdout[-100_000:] + stderr[-50_000:])
  cases = [json.loads(line[len('KERNEL '):]) for line in stdout.splitlines()
           if line.startswith('KERNEL ')]
  for c in cases:
    ms = c['ms']
    cells = ' / '.join(f'{k} {ms[k]:.2f}' for k in ('dense', 'chunked', 'cudnn', 'pallas')
                       if k in ms)
    best = min(ms, key=ms.get) if ms else None
    verdict = '' if best is None else (
        'auto = fastest' if c['auto'] == best or ms.get(c['auto']) == ms[best]
        else f"auto {ms.get(c['auto'], float('nan')) / ms[best]:.2f}x the fastest ({best})")
    rows.add('kernels', f"{c['variant']} {c['dtype']} n={c['n']} b={c['b']} (ms)",
             f"{cells}; auto -> {c['auto']}", verdict)
  for c in [json.loads(line[len('FUSED '):]) for line in stdout.splitlines()
            if line.startswith('FUSED ')]:
    ms, tf = c['ms'], c['tflops']
    cells = ' / '.join(f'{k} {ms[k]:.2f} ({tf[k]:.0f} TFLOP/s)' for k in ms)
    anchor = ''
    if 'tokamax' in ms and 'cudnn' in ms:
      anchor = f"tokamax {ms['tokamax'] / ms['cudnn']:.2f}x cuDNN; "
    if 'cudnn' in ms:
      anchor += (f"pallas {ms['pallas'] / ms['cudnn']:.2f}x cuDNN (target <= 1.3); alibi, t5 "
                f"{ms['pallas alibi'] / ms['pallas']:.2f}x, "
                f"{ms.get('pallas t5_bias', float('nan')) / ms['pallas']:.2f}x plain "
                '(target <= 1.3)')
    rows.add('kernels', f"attention only, bf16 causal n={c['n']} b={c['b']} d={c['d']} "
             '(fwd+bwd ms)', cells + ('; failed: ' + ', '.join(c['failed']) if c['failed']
                                      else ''), anchor)
  for note in [line[len('FUSED-NOTE '):] for line in stdout.splitlines()
               if line.startswith('FUSED-NOTE ')][:1]:
    rows.add('kernels', 'attention only: tokamax', note)
  if failure:
    raise RuntimeError(f'after {len(cases)} cases: {failure}')


# ---------------------------------------------------------------- the others


def _script(args, seconds):
  proc = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), capture_output=True,
                        text=True, timeout=seconds)
  if proc.returncode != 0:
    raise RuntimeError(f'{" ".join(args[:1])} exited {proc.returncode}: {proc.stderr[-1500:]}')
  return proc.stdout


def scan(rows: Rows, quick: bool, seconds: float):
  """benchmarks/scan_layers.py: the recipe's model unrolled and scanned."""
  args = (['--layers', '1', '--batch', '1', '--repeats', '1', '--d_model', '32', '--context', '16']
          if quick else ['--layers', '6', '--batch', '64'])
  out = _script(['benchmarks/scan_layers.py', *args], seconds)
  for cells in _table_cells(out):
    rows.add('scan', 'unrolled vs scanned', cells)


def mfu(rows: Rows, quick: bool, seconds: float):
  # --quick: a nominal peak (the MFU is not the point), not the CPU's measured one
  peak = 1.0 if quick else next((p for name, p in PEAK_TFLOPS.items() if name in _versions()),
                                 0.0)
  args = (['--preset=tiny', '--vocab=256', '--batch=2', '--src_len=16', '--tgt_len=16', '--steps=2']
          if quick else ['--preset=big', '--dtype=bfloat16', '--batch=64', '--steps=10'])
  out = _script(['benchmarks/train_throughput.py', *args,
                 *([f'--peak_tflops={peak}'] if peak else [])], seconds)
  for label in ('step time', 'tokens/s', 'MFU'):
    line = next((l for l in out.splitlines() if label in l), None)
    if line:
      rows.add('mfu', 'Transformer-big bf16 b=64: ' + label if not quick else label,
               line.split('|')[2].strip().strip('*'), 'target >= 40%' if label == 'MFU' else '')


def mha(rows: Rows, quick: bool, seconds: float):
  args = (['--length=32', '--d_model=32', '--heads=2', '--repeats=2'] if quick
          else ['--length=2048', '--batch=4', '--repeats=30'])
  out = _script(['benchmarks/attention.py', *args], seconds)
  for line in out.splitlines():
    if 'time, median ms' in line:
      ours, flax_, _, to_flax, _ = line[28:].split()
      rows.add('mha', f'{line[:28].split(" time")[0]}: ours / Flax ms'
               f'{"" if quick else " (f32, n=2048, b=4)"}', f'{ours} / {flax_} = {to_flax}x',
               'target <= 1.0x' if 'bwd' in line else '')


def smollm2(rows: Rows, quick: bool, seconds: float):
  python = _python_with('torch', 'transformers')
  if python is None:
    rows.add('smollm2', 'ours vs transformers', 'skipped: no torch + transformers here')
    return
  args = (['--layers=2', '--vocab=512', '--prefill', '64', '--decode_prompt=16',
           '--decode_steps=4', '--repeats=1'] if quick else
          ['--prefill', '2048', '8192', '--decode_prompt=512', '--decode_steps=32',
           '--repeats=3', '--dtype=bfloat16'])
  out_json = os.path.join(tempfile.mkdtemp(prefix='gpu_check_smollm2_'), 'speed.json')
  out = _script(['benchmarks/pretrained_speed.py', '--random_weights', *args,
                 f'--hf_python={python}', f'--out={out_json}'], seconds)
  for cells in _table_cells(out):
    rows.add('smollm2', 'table', cells)


NANOGPT_QUICK = ['--device=cpu', '--compile=False', '--max_iters=2', '--lr_decay_iters=2',
                 '--eval_interval=2', '--eval_iters=2', '--log_interval=1', '--batch_size=4',
                 '--block_size=32', '--n_layer=1', '--n_head=2', '--n_embd=32']
def nanogpt(rows: Rows, quick: bool, seconds: float):
  """nanoGPT's train.py with config/train_shakespeare_char.py, in a copy of its
  source (never written into), Tiny Shakespeare from the shared corpora."""
  source = next((d for d in (os.environ.get('FFL_NANOGPT_DIR'),
                             os.path.join(REPO, '.gpu_carry', 'nanogpt'))
                 if d and os.path.isfile(os.path.join(d, 'train.py'))), None)
  python = _python_with('torch', 'numpy')
  corpus = os.path.join(os.environ.get('FFL_SHARED_DATA') or
                        os.path.join(os.path.dirname(REPO), 'shared', 'data'),
                        'tiny_shakespeare', 'input.txt')
  missing = [why for why, ok in (('no nanoGPT source (benchmarks/gpu_carry.sh)', source),
                                 ('no Python with torch', python),
                                 (f'no {corpus}', os.path.exists(corpus))) if not ok]
  if missing:
    rows.add('nanogpt', "nanoGPT's train.py", 'skipped: ' + '; '.join(missing))
    return
  work = os.path.join(tempfile.mkdtemp(prefix='gpu_check_nanogpt_'), 'nanogpt')
  shutil.copytree(source, work)
  shutil.copy(corpus, os.path.join(work, 'data', 'shakespeare_char', 'input.txt'))
  subprocess.run([python, 'data/shakespeare_char/prepare.py'], cwd=work, check=True,
                 capture_output=True, timeout=120)
  log_path = os.path.join(work, 'train.log')
  start = time.time()
  log, stopped, code, first = _run_until(
      [python, 'train.py', 'config/train_shakespeare_char.py', '--out_dir=out',
       *(NANOGPT_QUICK if quick else [])], log_path, start + seconds - 10, cwd=work,
      stop=signal.SIGKILL, grace=10, watch='iter 0:')
  wall = time.time() - start
  shutil.copy(log_path, os.path.join(LOG_DIR, 'nanogpt.log'))
  if code != 0 and not stopped:
    raise RuntimeError(f'train.py exited {code}: {log[-1500:]}')
  rows.add('nanogpt', 'first iteration (s after launch)', f'{first:.1f}' if first else '-',
           'ours: recipe, first step')
  times = [float(t) for t in re.findall(r'time ([\d.]+)ms', log)][5:]
  rows.add('nanogpt', 'ms an iteration (median after 5)',
           f'{statistics.median(times):.2f}' if times else '-')
  iters = re.findall(r'iter (\d+):', log)
  rows.add('nanogpt', 'whole run, wall (s)' + (
      f' STOPPED at the time limit, iteration {iters[-1]}' if stopped and iters else ''),
      f'{wall:.0f}', 'nanoGPT: about 3 minutes on an A100')
  vals = [(float(v), int(s)) for s, v in re.findall(r'step (\d+): train loss [\d.]+, val loss ([\d.]+)', log)]
  rows.add('nanogpt', 'best validation loss (at step)',
           f'{min(vals)[0]:.4f} ({min(vals)[1]})' if vals else '-', 'published: 1.4697')


def _failure_causes(path: str, limit: int = 12) -> list[tuple[str, str]]:
  """(cause, 'N tests, e.g. NODEID') for the failures that tests/conftest.py
  logged to `path` (FFL_FAILURE_LOG), the commonest causes first."""
  if not os.path.exists(path):
    return []
  by_cause: dict[str, list[str]] = {}
  with open(path) as f:
    for line in f:
      node, _, cause = line.rstrip('\n').partition(': ')
      by_cause.setdefault(cause.strip()[:200], []).append(node)
  ranked = sorted(by_cause.items(), key=lambda kv: -len(kv[1]))[:limit]
  return [(cause, f'{len(nodes)} tests, e.g. {nodes[0]}') for cause, nodes in ranked]


def tests(rows: Rows, quick: bool, seconds: float):
  if quick:
    return
  if seconds < 30:
    rows.add('tests', 'on this device', 'skipped: no time left')
    return
  workers = ['-n', '4'] if importlib.util.find_spec('xdist') else []
  command = [sys.executable, '-m', 'pytest', 'tests/attention', 'tests/test_decoding.py',
             'tests/layers', 'tests/test_models.py', '-q', '-rfE', '-p', 'no:cacheprovider',
             *workers]
  failures = os.path.join(LOG_DIR, 'tests_failures.txt')
  with contextlib.suppress(FileNotFoundError):
    os.remove(failures)
  # Several test processes share the GPU: each takes memory as it needs it,
  # not JAX's default 75% of the device at start. Each failure is logged as it
  # happens, so a run the time limit stops still says why tests failed.
  env = _env(XLA_PYTHON_CLIENT_PREALLOCATE='false', FFL_FAILURE_LOG=failures)
  try:
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=seconds)
    out, ended = proc.stdout, proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-300:]]
    with open(os.path.join(LOG_DIR, 'tests.log'), 'w') as f:
      f.write(proc.stdout[-200_000:] + proc.stderr[-20_000:])
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    with open(os.path.join(LOG_DIR, 'tests.log'), 'w') as f:
      f.write(out[-200_000:])
    progress = ''.join(line.split('[')[0] for line in out.splitlines()
                       if re.fullmatch(r'[.FEsx]+\s*\[\s*\d+%\]', line.strip()))
    ended = [f'stopped at the time limit ({seconds:.0f} s): {progress.count(".")} passed, '
             f'{progress.count("F") + progress.count("E")} failed so far']
  rows.add('tests', 'attention, decoding, layers, models on this device', ended[0])
  for cause, where in _failure_causes(failures):
    rows.add('tests', f'  failed: {cause}', where)


RUNNERS = {'compile': compile_settings, 'recipe': recipe, 'kernels': kernels, 'scan': scan, 'mfu': mfu, 'mha': mha,
           'smollm2': smollm2, 'nanogpt': nanogpt, 'tests': tests}


def _xla_flags() -> str:
  sys.path.insert(0, REPO)
  from flaxformer_lite import compilation
  return compilation.xla_flags(os.environ)


@functools.cache
def _versions() -> str:
  """'DEVICE KIND xN (backend); jax .., jaxlib .., flax ..', from a process like the sections'."""
  code = ('import jax, jaxlib, flax; d = jax.devices()[0]; '
          'print(f"{d.device_kind} x{jax.device_count()} ({jax.default_backend()}); '
          'jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}")')
  out = subprocess.run([sys.executable, '-c', code], env=_env(), capture_output=True, text=True,
                       timeout=120)
  return out.stdout.strip() or out.stderr[-300:]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--skip', nargs='*', default=[], choices=SECTIONS)
  parser.add_argument('--only', nargs='*', default=[], choices=SECTIONS,
                      help='run these sections alone (each then gets the whole budget share '
                           'of the sections skipped, in proportion)')
  parser.add_argument('--budget', type=float, default=510.0, help='seconds for all sections')
  parser.add_argument('--out', default=os.path.join(REPO, 'benchmarks', 'results', 'gpu'))
  parser.add_argument('--section', choices=['kernels'], help=argparse.SUPPRESS)
  parser.add_argument('--repeats', type=int, default=0)
  parser.add_argument('--torch_python', default=None,
                      help="a Python with torch (and transformers) for nanoGPT's train.py and "
                           "the SmolLM2 comparison (default: this one)")
  args = parser.parse_args(argv)
  if args.section == 'kernels':
    kernels_section(args.quick, args.repeats or (2 if args.quick else 10))
    fused_section(args.quick, args.repeats or (2 if args.quick else 10))
    return 0

  global LOG_DIR, TORCH_PYTHON
  LOG_DIR, TORCH_PYTHON = args.out, args.torch_python
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  header = (f'{_versions()}; {datetime.date.today().isoformat()}; XLA_FLAGS as the project '
            f'sets them: {_xla_flags() or "none"}')
  print(f'# gpu_check: {header}', flush=True)
  rows, problems = Rows(), []
  chosen = [n for n in SECTIONS if n not in args.skip and (not args.only or n in args.only)]
  total_share = sum(SHARES.get(n, 0.0) for n in chosen if n != 'tests') or 1.0
  scale = 1.0 if 'tests' in chosen else 1.0 / total_share
  for name in chosen:
    left = args.budget - (time.time() - start)
    seconds = left if name == 'tests' else min(left, SHARES[name] * scale * args.budget)
    if seconds <= 1:
      problems.append(f'{name}: no time left')
      continue
    t0 = time.time()
    try:
      RUNNERS[name](rows, args.quick, seconds)
    except Exception as e:  # noqa: BLE001  (one section's failure must not stop the rest)
      problems.append(f'{name}: {type(e).__name__}: {str(e).strip()[-800:]}')
    print(f'# {name}: {time.time() - t0:.0f} s', flush=True)

  os.makedirs(args.out, exist_ok=True)
  lines = [f'gpu_check ({"--quick" if args.quick else "full"}): {header}; '
           f'{time.time() - start:.0f} s', '',
           '| section | quantity | value | target / anchor |', '| --- | --- | --- | --- |']
  lines += [f'| {s} | {q} | {v} | {t} |' for s, q, v, t in rows.rows]
  lines += [''] + [f'- failed: {p}' for p in problems]
  with open(os.path.join(args.out, 'results.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump({'header': header, 'quick': args.quick, 'rows': rows.rows,
               'failed': problems}, f, indent=1)
  print('\n'.join(lines))
  return 1 if problems else 0


if __name__ == '__main__':
  sys.exit(main())
