"""One prepared accelerator check: what a GPU user meets, as one table, in
calls that each fit one command on a lent GPU machine.
  benchmarks/gpu_check.sh [--quick] [--call N ...] [--only SECTION ...] [--out DIR]
The calls (CALLS: each a fixed list of sections, each section with its own
budget in seconds; without --call, every call in turn):
  1  recipe, nanogpt, tests        2  kernels, mha, mfu, smollm2
Each section runs in processes of its own, stopped (its whole process group)
when its budget is spent; it prints its rows as it measures them and the
table on disk is rewritten after every row, so a section or a call cut short
still leaves what it measured.
  recipe   experiments/tiny_shakespeare.py (the nanoGPT recipe) with an empty
           compilation cache: seconds to its first step, the time its three
           programs compiled, steps/s, the whole run's wall time, the best
           validation loss; then the same command in a fresh workdir on the
           now warm cache, to its first step.
  nanogpt  nanoGPT's own train.py on the same recipe (its source from
           $FFL_NANOGPT_DIR or .gpu_carry/nanogpt, benchmarks/gpu_carry.sh;
           torch from this Python or --torch_python): seconds to its first
           iteration, ms an iteration, the best validation loss it reached.
  tests    as much of the test suite as its budget allows (attention and
           decoding first), each failure's cause ranked; not with --quick.
  kernels  MultiHeadAttention forward+backward (d_model 512, 8 heads, causal,
           bfloat16, n=2048, b=4) of dot_product: ms of the dense, chunked,
           cuDNN and fused Pallas kernels, and the kernel `auto` picks, read
           from the lowered program; then attention alone at the recipe's
           shape (n=256, b=64, benchmarks/fused_attention.py): the Pallas
           kernel plain and with every scheme it runs (--quick off a GPU:
           ALiBi and Shaw), each against its GPU target, beside cuDNN,
           XLA and tokamax where it imports.
  mha      benchmarks/attention.py: our layer against Flax's at n=2048, b=4.
  mfu      benchmarks/train_throughput.py: Transformer-big, bfloat16, batch 64.
  smollm2  benchmarks/pretrained_speed.py --random_weights: SmolLM2-shaped
           prefill and decode, ours against transformers (same random weights).
--quick: tiny sizes and a few steps, for any machine (the test suite runs it on
CPU), under the same budgets. Writes results.md and results.json to --out
(default benchmarks/results/gpu/call-N, N the calls run, or only-SECTION)
and prints the table last.
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
# The prepared calls, one command each on a lent GPU machine: their sections
# in order, each with its budget in seconds, sized from the section's last
# measured time on a GPU plus a margin (benchmarks/KERNELS.md, "gpu_check.sh",
# gives each budget's source).
CALLS = {
    1: {'recipe': 165, 'nanogpt': 60, 'tests': 80},
    2: {'kernels': 105, 'mha': 50, 'mfu': 75, 'smollm2': 80},
}
SECTIONS = tuple(name for sections in CALLS.values() for name in sections)
BUDGETS = {name: seconds for sections in CALLS.values() for name, seconds in sections.items()}
# A lent machine's time beyond the sections (KERNELS.md: its start, the
# transfers, the wheels' install, each call's header, the wait between calls),
# and the limits the calls fit: the device time they may take together (of a
# lease's 15 minutes), one command's, and a call's own start before its first
# section.
OVERHEAD_S = 160
DEVICE_S = 13 * 60
COMMAND_S = 10 * 60
CALL_START_S = 60
# Of the recipe's budget: the warm run's, and a stopped run's time to save and exit.
RECIPE_WARM_S = 25
RECIPE_STOP_S = 10
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


def _replace(path: str, text: str):
  """Writes `path` whole or not at all: a call stopped mid-write leaves the last table."""
  with open(path + '.tmp', 'w') as f:
    f.write(text)
  os.replace(path + '.tmp', path)


class Rows:
  """The table: (section, quantity, value, target or anchor) and the sections
  that failed or ran out of time, rewritten to `out` after every change."""

  def __init__(self, out: str, header: str, quick: bool):
    self.out, self.header, self.quick, self.start = out, header, quick, time.time()
    self.rows: list[tuple[str, str, str, str]] = []
    self.problems: list[str] = []

  def add(self, section, quantity, value, target=''):
    self.rows.append((section, quantity, str(value), target))
    print(f'  {section:8} {quantity}: {value}' + (f'   [{target}]' if target else ''), flush=True)
    self.write()

  def fail(self, problem: str):
    self.problems.append(problem)
    print(f'  failed: {problem}', flush=True)
    self.write()

  def lines(self) -> list[str]:
    lines = [f'gpu_check ({"--quick" if self.quick else "full"}): {self.header}; '
             f'{time.time() - self.start:.0f} s', '',
             '| section | quantity | value | target / anchor |', '| --- | --- | --- | --- |']
    lines += [f'| {s} | {q} | {v} | {t} |' for s, q, v, t in self.rows]
    return lines + [''] + [f'- failed: {p}' for p in self.problems]

  def write(self):
    _replace(os.path.join(self.out, 'results.md'), '\n'.join(self.lines()) + '\n')
    _replace(os.path.join(self.out, 'results.json'), json.dumps(
        {'header': self.header, 'quick': self.quick, 'rows': self.rows,
         'failed': self.problems}, indent=1))


def _run_until(command, log_path, deadline, *, cwd=REPO, env=None, stop=signal.SIGKILL,
               grace=0.0, on_line=None):
  """Runs `command` in a process group of its own, its output in log_path,
  until it exits or `deadline` (time.time()); then sends `stop` to it and,
  `grace` seconds later, kills its whole group (children left holding on too).
  on_line(line, seconds since launch) sees each whole line as it is written; when it
  returns True, the command is stopped as at the deadline. Returns (log,
  whether the deadline stopped it, exit code)."""
  start, pending, asked, stopped = time.time(), b'', False, False

  def read(reader):
    nonlocal pending, asked
    *lines, pending = (pending + reader.read()).split(b'\n')
    for line in lines:
      if on_line and on_line(line.decode(errors='replace'), time.time() - start):
        asked = True

  with open(log_path, 'wb') as log_file, open(log_path, 'rb') as reader:
    proc = subprocess.Popen(command, cwd=cwd, env=env or _env(), stdout=log_file,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
      while proc.poll() is None and time.time() < deadline and not asked:
        read(reader)
        time.sleep(0.25)
      stopped = proc.poll() is None and not asked
      if proc.poll() is None:
        proc.send_signal(stop)
        with contextlib.suppress(subprocess.TimeoutExpired):
          proc.wait(timeout=grace)
    finally:  # (on_line raising too)
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    read(reader)
  with open(log_path, errors='replace') as f:
    return f.read(), stopped, proc.returncode


def _table_cells(out: str) -> list[str]:
  """The rows of the markdown tables a script printed, cells joined by '; '."""
  return ['; '.join(c.strip() for c in line.strip('| ').split('|'))
          for line in out.splitlines() if line.startswith('|') and not set(line) <= set('|- :')]


def _python_with(*modules, deadline: float) -> str | None:
  """A Python that imports `modules`: --torch_python, else this one, else None."""
  for python in (TORCH_PYTHON, sys.executable):
    with contextlib.suppress(subprocess.TimeoutExpired):
      if python and subprocess.run([python, '-c', f'import {", ".join(modules)}'],
                                   capture_output=True,
                                   timeout=max(1.0, min(60.0, deadline - time.time()))
                                   ).returncode == 0:
        return python
  return None


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
  on the warm cache until its first step. The first step's and each
  program's rows come as the run logs them."""
  tmp = tempfile.mkdtemp(prefix='gpu_check_recipe_')
  env = _env(FFL_COMPILE_CACHE=os.path.join(tmp, 'cache'))
  start = time.time()
  end = start + seconds

  def as_logged(line, _):
    if _first_step_seconds(line) is not None:
      rows.add('recipe', 'first step, empty cache (s after launch)', _first_step_seconds(line),
               'target <= 30 s')
      rows.add('recipe', '  the step itself, empty cache (s)', _step_itself(line))
    for name, took in re.findall(r'\d\d:\d\d:\d\d (.+?) compiled in ([\d.]+) s', line):
      rows.add('recipe', f'  {name} compiled (s)', took)

  # Out of time: the run saves its step and stops (SIGTERM), and what it logged is reported.
  log, stopped, code = _run_until(
      _recipe_command(os.path.join(tmp, 'cold'), quick), os.path.join(LOG_DIR, 'recipe_cold.log'),
      end - RECIPE_WARM_S - RECIPE_STOP_S, env=env, stop=signal.SIGTERM, grace=RECIPE_STOP_S,
      on_line=as_logged)
  wall = time.time() - start
  if code != 0 and not stopped:
    raise RuntimeError(f'the recipe exited {code}: {log[-1500:]}')
  if _first_step_seconds(log) is None:
    rows.add('recipe', 'first step, empty cache (s after launch)', '-', 'target <= 30 s')
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

  log, stopped, _ = _run_until(
      _recipe_command(os.path.join(tmp, 'warm'), quick), os.path.join(LOG_DIR, 'recipe_warm.log'),
      end - RECIPE_STOP_S, env=env, stop=signal.SIGTERM, grace=RECIPE_STOP_S,
      on_line=lambda line, _: 'first step done' in line)
  rows.add('recipe', 'first step, warm cache (s after launch)' + (
      ' STOPPED at the time limit' if stopped else ''), _first_step_seconds(log), 'target <= 5 s')
  rows.add('recipe', '  the step itself, warm cache (s)', _step_itself(log))
  served = re.findall(r'\d\d:\d\d:\d\d (.+?): cache, ', log)
  rows.add('recipe', '  served by the cache', ', '.join(served) or 'nothing')


# ---------------------------------------------------------------- nanogpt


NANOGPT_QUICK = ['--device=cpu', '--compile=False', '--max_iters=2', '--lr_decay_iters=2',
                 '--eval_interval=2', '--eval_iters=2', '--log_interval=1', '--batch_size=4',
                 '--block_size=32', '--n_layer=1', '--n_head=2', '--n_embd=32']


def nanogpt(rows: Rows, quick: bool, seconds: float):
  """nanoGPT's train.py with config/train_shakespeare_char.py, in a copy of its
  source (never written into), Tiny Shakespeare from the shared corpora; a run
  longer than the budget reports its first iteration and its pace."""
  end = time.time() + seconds
  source = next((d for d in (os.environ.get('FFL_NANOGPT_DIR'),
                             os.path.join(REPO, '.gpu_carry', 'nanogpt'))
                 if d and os.path.isfile(os.path.join(d, 'train.py'))), None)
  python = _python_with('torch', 'numpy', deadline=end)
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
                 capture_output=True, timeout=max(1.0, end - time.time()))
  first = []

  def first_iteration(line, since_launch):
    if not first and line.startswith('iter 0:'):
      first.append(since_launch)
      rows.add('nanogpt', 'first iteration (s after launch)', f'{since_launch:.1f}',
               'ours: recipe, first step')

  start = time.time()
  log, stopped, code = _run_until(
      [python, 'train.py', 'config/train_shakespeare_char.py', '--out_dir=out',
       *(NANOGPT_QUICK if quick else [])], os.path.join(LOG_DIR, 'nanogpt.log'), end, cwd=work,
      on_line=first_iteration)
  wall = time.time() - start
  if code != 0 and not stopped:
    raise RuntimeError(f'train.py exited {code}: {log[-1500:]}')
  if not first:
    rows.add('nanogpt', 'first iteration (s after launch)', '-', 'ours: recipe, first step')
  times = [float(t) for t in re.findall(r'time ([\d.]+)ms', log)][5:]
  rows.add('nanogpt', 'ms an iteration (median after 5)',
           f'{statistics.median(times):.2f}' if times else '-')
  iters = re.findall(r'iter (\d+):', log)
  rows.add('nanogpt', 'whole run, wall (s)' + (
      f' STOPPED at the time limit, iteration {iters[-1] if iters else "-"}' if stopped else ''),
      f'{wall:.0f}', 'nanoGPT: about 3 minutes on an A100')
  vals = [(float(v), int(s)) for s, v in re.findall(r'step (\d+): train loss [\d.]+, val loss ([\d.]+)', log)]
  rows.add('nanogpt', 'best validation loss (at step)',
           f'{min(vals)[0]:.4f} ({min(vals)[1]})' if vals else '-', 'published: 1.4697')


# ---------------------------------------------------------------- tests


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
  workers = (['-n', str(min(8, max(1, (os.cpu_count() or 2) // 2)))]
             if importlib.util.find_spec('xdist') else [])
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
  log, stopped, _ = _run_until(command, os.path.join(LOG_DIR, 'tests.log'),
                               time.time() + seconds, env=env)
  if stopped:
    progress = ''.join(line.split('[')[0] for line in log.splitlines()
                       if re.fullmatch(r'[.FEsx]+\s*\[\s*\d+%\]', line.strip()))
    ended = (f'stopped at the time limit ({seconds:.0f} s): {progress.count(".")} passed, '
             f'{progress.count("F") + progress.count("E")} failed so far')
  else:
    ended = ([line for line in log.splitlines() if line.strip()] or ['no output'])[-1]
  rows.add('tests', 'attention, decoding, layers, models on this device', ended)
  for cause, where in _failure_causes(failures):
    rows.add('tests', f'  failed: {cause}', where)


# ---------------------------------------------------------------- kernels


def kernel_cases(quick):
  """(variant, n, b, dtype) of the kernel table (benchmarks/chunked_attention.py
  --pallas sweeps the variants and lengths)."""
  if quick:
    return [('dot_product', 64, 1, 'bfloat16'), ('alibi', 64, 1, 'float32')]
  return [('dot_product', 2048, 4, 'bfloat16')]


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
  from flaxformer_lite.attention import masks, registry
  from flaxformer_lite.layers import MultiHeadAttention

  d_model, heads = (32, 2) if quick else (512, 8)
  on_gpu = jax.default_backend() == 'gpu'
  out = []
  for variant, n, b, dtype in kernel_cases(quick):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(b, n, d_model)), jnp.float32)
    d_y = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    spec = masks.causal()

    def build(implementation):
      layer = MultiHeadAttention(num_heads=heads, attention=variant, dtype=jnp.dtype(dtype),
                                 attention_kwargs={'kernel': implementation})
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
  """(n, b, head_dim) of the attention-only table: the Pallas kernel with
  every scheme it runs against cuDNN and XLA's dense attention (causal, 8
  heads; benchmarks/fused_attention.py sweeps the targets' lengths)."""
  if quick:
    return [(64, 1, 16)]
  return [(256, 64, 64)]  # the nanoGPT recipe's batch, where auto's choice matters most


# The schemes --quick times off a GPU, beside the plain kernel: one through a
# score (ALiBi), one through lookups of keys and values (Shaw), so that the
# suite stays within its time (tests/attention/test_entry.py holds every
# scheme on the kernel to the reference).
QUICK_FUSED = ('alibi', 'shaw')


def fused_section(quick: bool, repeats: int) -> list[dict]:
  """Attention alone, forward and backward, through benchmarks/fused_attention.py:
  the Pallas kernel plain and with each scheme it runs (on CPU with --quick:
  QUICK_FUSED, interpreted), cuDNN and XLA through jax.nn.dot_product_attention,
  and tokamax.dot_product_attention where tokamax imports; bfloat16 on a GPU,
  float32 elsewhere. Prints a FUSED row per case: each kernel's fused_attention
  summary, with its targets, and what failed."""
  import jax

  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import fused_attention

  on_gpu = jax.default_backend() == 'gpu'
  try:  # a Pallas kernel library (benchmarks/gpu_carry.sh carries its wheels)
    import tokamax
  except Exception as e:  # noqa: BLE001  (missing, or its own imports fail)
    tokamax = None
    if on_gpu:
      print(f'FUSED-NOTE tokamax not measured: {type(e).__name__}: {str(e)[:200]}', flush=True)
  heads = 2 if quick else 8
  dtype = (fused_attention.GPU_GRID if on_gpu else fused_attention.CPU_GRID)['dtype']
  # its own choice of kernel, as a user calls it
  others = {'tokamax': lambda q, k, v, _: tokamax.dot_product_attention(
      q, k, v, is_causal=True)} if on_gpu and tokamax is not None else {}
  out = []
  for n, b, d in fused_cases(quick):
    values, failed = fused_attention.measure_case(
        n, b, heads, d, dtype, QUICK_FUSED if quick and not on_gpu else None, repeats,
        others=others)
    row = {'n': n, 'b': b, 'd': d, 'dtype': dtype, 'values': values, 'failed': failed}
    print('FUSED ' + json.dumps(row), flush=True)
    out.append(row)
  return out


def _kernel_row(rows: Rows, c: dict):
  ms = c['ms']
  cells = ' / '.join(f'{k} {ms[k]:.2f}' for k in ('dense', 'chunked', 'cudnn', 'pallas')
                     if k in ms)
  best = min(ms, key=ms.get) if ms else None
  verdict = '' if best is None else (
      'auto = fastest' if c['auto'] == best or ms.get(c['auto']) == ms[best]
      else f"auto {ms.get(c['auto'], float('nan')) / ms[best]:.2f}x the fastest ({best})")
  rows.add('kernels', f"{c['variant']} {c['dtype']} n={c['n']} b={c['b']} (ms)",
           f"{cells}; auto -> {c['auto']}", verdict)


def _fused_row(rows: Rows, c: dict):
  """A FUSED case (fused_section) as one row: each kernel's ms and TFLOP/s;
  as the anchor, each Pallas kernel's target where fused_attention.TARGETS
  sets one (the plain kernel's against cuDNN), else its time over the plain
  kernel's."""
  values = c['values']
  cells = ' / '.join(f"{k} {v['ms']:.2f} ({v['TFLOP/s']:.0f} TFLOP/s)" for k, v in values.items())
  anchors = []
  for name, v in values.items():
    label = name.removeprefix('pallas ')
    if v['target']:
      anchors.append(f"{label}: {v['target']}")
    elif name.startswith('pallas '):
      anchors.append(f"{label} {_times(v['x plain'])} plain")
    elif name == 'tokamax':
      anchors.append(f"tokamax {_times(v['x cuDNN'])} cuDNN")
  failed = '; failed: ' + ', '.join(c['failed']) if c['failed'] else ''
  rows.add('kernels', f"attention only, {c['dtype']} causal n={c['n']} b={c['b']} d={c['d']} "
           '(fwd+bwd ms)', cells + failed, '; '.join(anchors))


def _times(ratio) -> str:
  return '-' if ratio is None else f'{ratio:.2f}x'


def kernels(rows: Rows, quick: bool, seconds: float):
  """kernels_section and fused_section in a process of their own, each case's
  row as it is measured."""
  def as_measured(line, _):
    kind, _, data = line.partition(' ')
    if kind == 'KERNEL':
      _kernel_row(rows, json.loads(data))
    elif kind == 'FUSED':
      _fused_row(rows, json.loads(data))
    elif kind == 'FUSED-NOTE':
      rows.add('kernels', 'attention only: tokamax', data)

  log, stopped, code = _run_until(
      [sys.executable, os.path.abspath(__file__), '--section', 'kernels',
       *(['--quick'] if quick else [])], os.path.join(LOG_DIR, 'kernels.log'),
      time.time() + seconds, on_line=as_measured)
  if stopped:
    raise RuntimeError(f'stopped at the time limit ({seconds:.0f} s)')
  if code:
    raise RuntimeError(f'exited {code}: {log[-1500:]}')


# ---------------------------------------------------------------- the scripts


def _script(rows: Rows, section: str, args: list[str], seconds: float, parse):
  """A benchmarks/ script for at most `seconds`, its output in LOG_DIR/SECTION.log;
  parse(output) adds its rows, from what it printed before any time limit."""
  log, stopped, code = _run_until([sys.executable, *args],
                                  os.path.join(LOG_DIR, f'{section}.log'), time.time() + seconds)
  parse(log)
  if stopped:
    last = next((line for line in reversed(log.splitlines()) if line.strip()), '')
    raise RuntimeError(f'stopped at the time limit ({seconds:.0f} s); its last line: {last[:300]}')
  if code:
    raise RuntimeError(f'{args[0]} exited {code}: {log[-1500:]}')


def mha(rows: Rows, quick: bool, seconds: float):
  def parse(out):
    for line in out.splitlines():
      if 'time, median ms' in line:
        ours, flax_, _, to_flax, _ = line[28:].split()
        rows.add('mha', f'{line[:28].split(" time")[0]}: ours / Flax ms'
                 f'{"" if quick else " (f32, n=2048, b=4)"}', f'{ours} / {flax_} = {to_flax}x',
                 'target <= 1.0x' if 'bwd' in line else '')

  args = (['--length=32', '--d_model=32', '--heads=2', '--repeats=2'] if quick
          else ['--length=2048', '--batch=4', '--repeats=30'])
  _script(rows, 'mha', ['benchmarks/attention.py', *args], seconds, parse)


def mfu(rows: Rows, quick: bool, seconds: float):
  def parse(out):
    for label in ('step time', 'tokens/s', 'MFU'):
      line = next((l for l in out.splitlines() if label in l and l.startswith('|')), None)
      if line:
        rows.add('mfu', 'Transformer-big bf16 b=64: ' + label if not quick else label,
                 line.split('|')[2].strip().strip('*'), 'target >= 40%' if label == 'MFU' else '')

  # --quick: a nominal peak (the MFU is not the point), not the CPU's measured one
  peak = 1.0 if quick else next((p for name, p in PEAK_TFLOPS.items() if name in _versions()),
                                 0.0)
  args = (['--preset=tiny', '--vocab=256', '--batch=2', '--src_len=16', '--tgt_len=16', '--steps=2']
          if quick else ['--preset=big', '--dtype=bfloat16', '--batch=64', '--steps=10'])
  _script(rows, 'mfu', ['benchmarks/train_throughput.py', *args,
                        *([f'--peak_tflops={peak}'] if peak else [])], seconds, parse)


def smollm2(rows: Rows, quick: bool, seconds: float):
  end = time.time() + seconds
  python = _python_with('torch', 'transformers', deadline=end)
  if python is None:
    rows.add('smollm2', 'ours vs transformers', 'skipped: no torch + transformers here')
    return

  def parse(out):
    cells = _table_cells(out)
    for row in cells:
      rows.add('smollm2', 'table', row)
    if not cells:  # cut short: the timings it printed as it went
      for line in out.splitlines():
        if line.startswith('#   ') and 'warm-up' not in line:
          rows.add('smollm2', 'measured before the time limit', line[4:])

  args = (['--layers=2', '--vocab=512', '--prefill', '64', '--decode_prompt=16',
           '--decode_steps=4', '--repeats=1'] if quick else
          ['--prefill', '2048', '8192', '--decode_prompt=512', '--decode_steps=32',
           '--repeats=3', '--dtype=bfloat16'])
  out_json = os.path.join(tempfile.mkdtemp(prefix='gpu_check_smollm2_'), 'speed.json')
  _script(rows, 'smollm2', ['benchmarks/pretrained_speed.py', '--random_weights', *args,
                            f'--hf_python={python}', f'--out={out_json}'],
          end - time.time(), parse)


RUNNERS = {'recipe': recipe, 'nanogpt': nanogpt, 'tests': tests, 'kernels': kernels,
           'mha': mha, 'mfu': mfu, 'smollm2': smollm2}


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
                       timeout=CALL_START_S)
  return out.stdout.strip() or out.stderr[-300:]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--call', nargs='+', type=int, choices=sorted(CALLS),
                      help='run these calls (default: every call in turn)')
  parser.add_argument('--only', nargs='+', choices=SECTIONS,
                      help='run these sections alone, each with its budget')
  parser.add_argument('--out', help='default: benchmarks/results/gpu/call-N or only-SECTION')
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
  calls = args.call or sorted(CALLS)
  chosen = args.only or [name for call in calls for name in CALLS[call]]
  LOG_DIR = args.out or os.path.join(REPO, 'benchmarks', 'results', 'gpu', (
      'only-' + '-'.join(args.only) if args.only else 'call-' + '-'.join(map(str, calls))))
  TORCH_PYTHON = args.torch_python
  os.makedirs(LOG_DIR, exist_ok=True)
  header = (f'{_versions()}; {datetime.date.today().isoformat()}; XLA_FLAGS as the project '
            f'sets them: {_xla_flags() or "none"}; sections: '
            + ', '.join(f'{name} {BUDGETS[name]} s' for name in chosen))
  print(f'# gpu_check: {header}', flush=True)
  rows = Rows(LOG_DIR, header, args.quick)
  rows.write()
  for name in chosen:
    t0 = time.time()
    try:
      RUNNERS[name](rows, args.quick, BUDGETS[name])
    except Exception as e:  # noqa: BLE001  (one section's failure must not stop the rest)
      rows.fail(f'{name}: {type(e).__name__}: {str(e).strip()[-800:]}')
    print(f'# {name}: {time.time() - t0:.0f} s of its {BUDGETS[name]} s', flush=True)
  rows.write()
  print('\n'.join(rows.lines()))
  return 1 if rows.problems else 0


if __name__ == '__main__':
  sys.exit(main())
