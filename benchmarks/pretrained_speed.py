"""SmolLM2-135M prefill and cached decoding, tokens/s, against Hugging Face transformers on PyTorch.

  ./launch.sh run benchmarks/pretrained_speed.py [--prefill 2048 8192] [--decode_prompt 512]
      [--decode_steps 32] [--attention 2048 8192] [--repeats 3]
      [--hf_python /tmp/hfenv/bin/python] [--dtype float32|bfloat16]
      [--random_weights [--layers N] [--vocab N]]
  taskset -c 0 ./launch.sh run benchmarks/pretrained_speed.py ...   # both sides on one core

On a GPU machine with one python holding jax, torch and transformers, and
no internet (no file to fetch), SmolLM2-135M's shapes with random weights:
  python benchmarks/pretrained_speed.py --random_weights --dtype bfloat16 \
      --prefill 2048 8192 --decode_prompt 512 --decode_steps 32 --repeats 3

Both sides run the same GGUF file (./launch.sh fetch smollm2; --model PATH),
dequantised to float32: ours through pretrained.load and models.build with
attention_kwargs.kernel='auto' (the chunked kernel past 16 MiB of
scores, and when decoding once the cache spans more than two blocks),
theirs through LlamaForCausalLM.from_pretrained(gguf_file=...) with its
default attention (reported: sdpa, torch's fused dense kernel).

--random_weights: no file; the worker (it has torch) builds a
LlamaForCausalLM of SmolLM2-135M's config (hidden 576, MLP 1536, 30 layers,
9 heads, 3 key/value heads, vocabulary 49152, rope_theta 100000, tied
embeddings; --layers and --vocab shrink it) from a fixed torch seed and
saves it (config.json + model.safetensors) into a temporary directory that
both sides then load, ours through pretrained.load, theirs through
from_pretrained. Before timing, both run the same 8-token prompt once and
the header says how far their logits differ (logits max |diff|) and whether
their greedy tokens agree: a check that the two compute the same model.

--dtype bfloat16 (a GPU's): ours with model.dtype='bfloat16' and its
parameters cast to bfloat16 too (as theirs), theirs loaded with
dtype=torch.bfloat16; float32 (the default) on both otherwise.

Devices: ours on JAX's default device (a GPU where jax has one), theirs on
CUDA where torch.cuda.is_available() (inputs there too, and
torch.cuda.synchronize() before each clock read); the header names both.

The Hugging Face side runs in a venv of its own (torch, transformers and
gguf: `pip install -e '.[golden]'` into it, as for tests/golden/make_golden.py;
--hf_python's default: this python itself where it imports torch and
transformers, else $FFL_HF_PYTHON or /tmp/hfenv/bin/python) as a worker
subprocess: this file, run by --hf_python with --hf_worker,
loads the model once, then reads one JSON request a line on stdin and
answers with its time. Torch stays out of this project's venv and its
tests, and one process holds one framework's thread pool. The worker is
asked while this process waits, so the two never run at once, and every
measurement is taken on both sides in turn, repeat by repeat (timed
interleaved, as the other benchmarks here), after an untimed warm-up of
each (our compilation).

Threads: both use the cores this process may run on (its affinity; taskset
to choose them): XLA's CPU client sizes its thread pool by them, the worker
calls torch.set_num_threads with their count. Where other jobs keep the
cores busy, pin both to one core: torch's OpenMP threads spin waiting for
each other, and its times with two threads vary by 4x there.

Batch 1, greedy:
  prefill N   one call on N prompt tokens into an empty cache (ours: the
              decode model's, N + 1 slots; theirs: a DynamicCache), the
              logits of every position computed; tokens/s = N / seconds.
  decode      after a --decode_prompt-token prefill (not timed),
              --decode_steps calls of one token each, the argmax of the last
              logits fed back; tokens/s = steps / seconds.
  attention N one layer's causal attention alone at the model's shapes (its
              query, key/value heads and head size; random q, k, v of N
              positions): ours the chunked kernel `auto` picks there, theirs
              torch.nn.functional.scaled_dot_product_attention(is_causal=True)
              as transformers' sdpa calls it, keys and values repeated to the
              query heads; tokens/s = N / seconds.
Prints a markdown table (median seconds over --repeats) and writes it as
JSON to --out (default benchmarks/results/pretrained_context/speed.json).
A side that fails (no --hf_python, too little memory) prints '-' and why.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, 'results', 'pretrained_context', 'speed.json')
# Before each measurement: the other side's idle threads stop spinning first
# (torch's OpenMP threads spin-wait after a call, on the cores ours then uses).
SETTLE_S = 0.5
HF_PYTHON = os.environ.get('FFL_HF_PYTHON', '/tmp/hfenv/bin/python')
# SmolLM2-135M's shapes (its config.json), for --random_weights.
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=8192, hidden_act='silu', bos_token_id=1,
               eos_token_id=2, pad_token_id=2)
CHECK_TOKENS = 8  # the prompt of the logits check


def default_hf_python() -> str:
  """This python where it holds torch and transformers too (one python, both
  frameworks), else $FFL_HF_PYTHON or /tmp/hfenv/bin/python."""
  import importlib.util
  if all(importlib.util.find_spec(m) for m in ('torch', 'transformers')):
    return sys.executable
  return HF_PYTHON


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
  """n token ids, the same on both sides; none of them a special token (0-16)."""
  return np.random.default_rng([seed, n]).integers(17, vocab, n).tolist()


def threads() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


class Ours:
  """This project's model: prefill and decode timed as the module docstring says."""

  def __init__(self, path: str, dtype: str = 'float32'):
    import jax
    from flaxformer_lite import decoding, models, pretrained
    self.jax, self.decoding, self.dtype = jax, decoding, dtype
    config, params = pretrained.load(path)
    config.attention_kwargs.kernel = 'auto'
    config.dtype = dtype
    self.config, self.vocab, self._attention = config, config.vocab_size, {}
    self.model = models.build(config, decode=True)
    # bfloat16: the parameters too, as theirs (dtype=torch.bfloat16), not cast each call.
    self.params = jax.device_put(jax.tree.map(lambda x: np.asarray(x).astype(
        models.DTYPES[dtype]), params))
    self.device = jax.devices()[0]
    call = decoding._lm_fn  # noqa: SLF001  (tokens, cache) -> (logits, cache)

    def prefill(params, tokens, cache):
      return call(self.model, params)(tokens, cache)

    def step(params, token, cache):  # token [1, 1] -> the argmax [1, 1] of its logits
      logits, cache = call(self.model, params)(token, cache)
      return jax.numpy.argmax(logits[:, -1], -1).astype(token.dtype)[:, None], cache

    # The cache is donated: decoding updates it in place, as decoding.greedy's loop does.
    self.prefill = jax.jit(prefill, donate_argnums=2)
    self.step = jax.jit(step, donate_argnums=2)

  def _cache(self, slots: int):
    import jax.numpy as jnp
    return self.decoding.init_cache(self.model, jnp.zeros((1, slots), jnp.int32))

  def time_prefill(self, ids: list[int]) -> float:
    tokens = self.jax.numpy.asarray([ids], 'int32')
    cache = self._cache(len(ids) + 1)
    start = time.perf_counter()
    logits, _ = self.prefill(self.params, tokens, cache)
    self.jax.block_until_ready(logits)
    return time.perf_counter() - start

  def time_decode(self, ids: list[int], steps: int) -> float:
    jnp = self.jax.numpy
    logits, cache = self.prefill(self.params, jnp.asarray([ids], 'int32'),
                                 self._cache(len(ids) + steps))
    token = jnp.argmax(logits[:, -1], -1).astype('int32')[:, None]
    self.jax.block_until_ready(token)
    start = time.perf_counter()
    for _ in range(steps):
      token, cache = self.step(self.params, token, cache)
    self.jax.block_until_ready(token)
    return time.perf_counter() - start

  def logits(self, ids: list[int]) -> np.ndarray:
    """float32 [len(ids), vocab]: a prefill's logits of every position."""
    logits, _ = self.prefill(self.params, self.jax.numpy.asarray([ids], 'int32'),
                             self._cache(len(ids) + 1))
    return np.asarray(logits[0], np.float32)

  def time_attention(self, n: int) -> float:
    if n not in self._attention:  # compiled, and its buffers touched, once
      from flaxformer_lite.attention import masks, registry
      jnp, c = self.jax.numpy, self.config
      variant, kernel = registry.get(c.attention), registry.resolve_kernel(c.attention,
                                                                          c.attention_kwargs)
      q, k, v = (jnp.asarray(x, self.dtype) for x in attention_inputs(
          n, c.num_heads, c.num_kv_heads or c.num_heads, c.d_model // c.num_heads))
      attend = self.jax.jit(lambda q, k, v: variant.chunked(
          q, k, v, mask=masks.causal(), chunk_size=kernel.chunk_size))
      self.jax.block_until_ready(attend(q, k, v))
      self._attention[n] = functools.partial(attend, q, k, v)
    start = time.perf_counter()
    self.jax.block_until_ready(self._attention[n]())
    return time.perf_counter() - start


def attention_inputs(n: int, heads: int, kv_heads: int, head_dim: int):
  """float32 q [1, n, heads, d], k and v [1, n, kv_heads, d]: the same on both sides."""
  r = np.random.default_rng(n)
  return (r.normal(size=(1, n, heads, head_dim)).astype(np.float32) / head_dim ** 0.5,
          *(r.normal(size=(1, n, kv_heads, head_dim)).astype(np.float32) for _ in range(2)))


class Theirs:
  """The Hugging Face worker, driven over its stdin and stdout."""

  def __init__(self, python: str, path: str, dtype: str = 'float32', random_weights=None):
    """random_weights: None, or (layers, vocab, max_len): the worker first
    builds and saves such a model into directory `path`."""
    build = [] if random_weights is None else [
        '--random_weights', '--layers', str(random_weights[0]), '--vocab',
        str(random_weights[1]), '--max_len', str(random_weights[2])]
    self.proc = subprocess.Popen(
        [python, os.path.abspath(__file__), '--hf_worker', '--model', path, '--dtype', dtype,
         *build], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.info = self._answer()

  def _answer(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f'the Hugging Face worker stopped (exit {self.proc.wait()}); its '
                         'error is above')
    return json.loads(line)

  def ask(self, **request) -> float:
    return self.answer(**request)['seconds']

  def answer(self, **request) -> dict:
    self.proc.stdin.write(json.dumps(request) + '\n')
    self.proc.stdin.flush()
    answer = self._answer()
    if answer.get('note'):
      print(f'#   theirs, {request["op"]} {request.get("n", "")}: {answer["note"]}', flush=True)
    return answer

  def logits(self, ids: list[int]) -> np.ndarray:
    return np.asarray(self.answer(op='logits', ids=ids)['logits'], np.float32)

  def time_prefill(self, ids):
    return self.ask(op='prefill', ids=ids)

  def time_decode(self, ids, steps):
    return self.ask(op='decode', ids=ids, steps=steps)

  def time_attention(self, n):
    return self.ask(op='attention', n=n)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def random_llama(path: str, layers: int, vocab: int, max_len: int):
  """SmolLM2-135M's config (layers and vocab as given; positions at least
  max_len) with random weights (torch seed 0), saved into directory `path`:
  config.json + model.safetensors, float32. Runs in the worker (torch)."""
  import torch
  import transformers
  shape = dict(SMOLLM2, num_hidden_layers=layers, vocab_size=vocab,
               max_position_embeddings=max(SMOLLM2['max_position_embeddings'], max_len))
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).float().eval()
  # Its initialiser draws N(0, 0.02) weights and unit norms: give the norms
  # spread too, so that a norm's weight read wrongly shows in the check.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.uniform_(0.5, 1.5)
  model.save_pretrained(path, safe_serialization=True)
  # Transformers 5 writes rope_theta inside rope_parameters; pretrained.py
  # reads the top-level rope_theta (and refuses any rope_scaling): both
  # written as transformers 4 did, which transformers 5 reads as well.
  config_path = os.path.join(path, 'config.json')
  with open(config_path) as f:
    config = json.load(f)
  config['rope_theta'] = SMOLLM2['rope_theta']
  if (config.get('rope_scaling') or {}).get('rope_type', 'default') == 'default':
    config.pop('rope_scaling', None)
  with open(config_path, 'w') as f:
    json.dump(config, f, indent=2)


def hf_worker(path: str, dtype: str = 'float32', random_weights=None) -> int:
  """The Hugging Face side (module docstring): runs in the venv with torch."""
  reply = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)  # what the libraries print goes to stderr, not into the replies
  import torch
  import transformers
  torch.set_num_threads(threads())
  if random_weights is not None:
    random_llama(path, *random_weights)
  source = dict(pretrained_model_name_or_path=path) if os.path.isdir(path) else dict(
      pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path))
  torch_dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
  model = transformers.LlamaForCausalLM.from_pretrained(**source, dtype=torch_dtype).eval()
  cuda = torch.cuda.is_available()
  device = torch.device('cuda' if cuda else 'cpu')
  model.to(device)

  def sync():  # before a clock is read: the GPU's queued work done
    if cuda:
      torch.cuda.synchronize()

  def send(**message):
    reply.write(json.dumps(message) + '\n')
    reply.flush()

  send(torch=torch.__version__, transformers=transformers.__version__,
       attention=model.config._attn_implementation, threads=torch.get_num_threads(),
       device=torch.cuda.get_device_name() if cuda else 'cpu', dtype=str(model.dtype))
  config = model.config
  heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
  # The cache's keyword: `cache` in recent transformers, `past_key_values` before
  # (an unknown keyword would be dropped silently, and decoding run without it).
  import inspect
  cache_kw = ('cache' if 'cache' in inspect.signature(model.forward).parameters
              else 'past_key_values')
  for line in sys.stdin:
    request = json.loads(line)
    if request['op'] == 'logits':
      with torch.inference_mode():
        logits = model(torch.tensor([request['ids']], device=device)).logits[0]
      send(logits=logits.float().cpu().numpy().tolist())
      continue
    if request['op'] == 'attention':
      q, k, v = (torch.from_numpy(x).transpose(1, 2).to(device, torch_dtype)
                 for x in attention_inputs(request['n'], heads, kv_heads,
                                           config.hidden_size // heads))
      k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
      attend = torch.nn.functional.scaled_dot_product_attention
      with open('/proc/self/statm') as f:  # resident pages now
        resident = int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
      if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
      with torch.inference_mode():
        attend(q, k, v, is_causal=True)
        sync()
        start = time.perf_counter()
        attend(q, k, v, is_causal=True)
        sync()
        seconds = time.perf_counter() - start
      if cuda:
        most = (torch.cuda.max_memory_allocated() - before) / 2**20
        send(seconds=seconds, note=f'its GPU memory grew by at most {most:.0f} MiB (dense '
             f'float32 scores: {4 * heads * request["n"] ** 2 / 2**20:.0f} MiB)')
        continue
      # The most the calls can have added to what was resident (the peak,
      # ru_maxrss in KiB, may be the model's load): dense scores would add
      # 4 * heads * n^2 bytes.
      most = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - resident
      send(seconds=seconds, note=f'its memory grew by at most {most:.0f} MiB (dense float32 '
           f'scores: {4 * heads * request["n"] ** 2 / 2**20:.0f} MiB)')
      continue
    ids = torch.tensor([request['ids']], device=device)
    with torch.inference_mode():
      cache = transformers.DynamicCache(config=model.config)
      sync()
      start = time.perf_counter()
      out = model(ids, use_cache=True, **{cache_kw: cache})
      if request['op'] == 'decode':
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        start = time.perf_counter()
        for _ in range(request['steps']):
          token = model(token, use_cache=True, **{cache_kw: cache}).logits[:, -1].argmax(
              -1, keepdim=True)
      sync()
      seconds = time.perf_counter() - start
    send(seconds=seconds)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--prefill', nargs='*', type=int, default=[2048, 8192])
  parser.add_argument('--decode_prompt', type=int, default=512)
  parser.add_argument('--decode_steps', type=int, default=32, help='0: no decode row')
  parser.add_argument('--attention', nargs='*', type=int, default=[],
                      help='also time one layer\'s causal attention alone at these lengths')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--hf_python', default=None,
                      help="a python with torch, transformers and gguf ('': ours alone; "
                      'default: this python where it has torch and transformers, else '
                      f'{HF_PYTHON})')
  parser.add_argument('--model', default=None, help='a Llama GGUF or Hugging Face directory '
                      '(default: smollm2, fetched)')
  parser.add_argument('--random_weights', action='store_true',
                      help="SmolLM2-135M's shapes, random weights, built by the worker")
  parser.add_argument('--layers', type=int, default=SMOLLM2['num_hidden_layers'],
                      help='with --random_weights: this many layers')
  parser.add_argument('--vocab', type=int, default=SMOLLM2['vocab_size'],
                      help='with --random_weights: this vocabulary')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--out', default=OUT)
  parser.add_argument('--hf_worker', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--max_len', type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.hf_worker:
    return hf_worker(args.model, args.dtype, (args.layers, args.vocab, args.max_len)
                     if args.random_weights else None)
  if args.hf_python is None:
    args.hf_python = default_hf_python()
  if args.random_weights and args.model:
    parser.error('--random_weights builds its own model: no --model')
  if args.random_weights and not args.hf_python:
    parser.error('--random_weights: the worker builds the weights; it needs --hf_python')
  sys.path.insert(0, os.path.dirname(HERE))
  temp = tempfile.mkdtemp(prefix='smollm2_random_') if args.random_weights else None
  try:
    return run(args, temp)
  finally:
    if temp:
      shutil.rmtree(temp, ignore_errors=True)


def run(args, temp) -> int:
  import jax
  from flaxformer_lite import pretrained
  path = temp or args.model or pretrained.fetch('smollm2')
  model_name = (f'random SmolLM2-135M shape, {args.layers} layers, vocab {args.vocab}'
                if temp else os.path.basename(path))
  start = time.time()
  failed, info, theirs = {}, {}, None
  if args.random_weights:  # the worker writes the model first (it has torch); ours loads it
    longest = max([*args.prefill, args.decode_prompt + args.decode_steps, *args.attention]) + 1
    theirs = Theirs(args.hf_python, path, args.dtype, (args.layers, args.vocab, longest))
  sides = {'ours': Ours(path, args.dtype)}
  if theirs is None and args.hf_python:
    try:
      theirs = Theirs(args.hf_python, path, args.dtype)
    except (OSError, RuntimeError) as e:
      failed['theirs'] = str(e)
  elif theirs is None:
    failed['theirs'] = 'no --hf_python'
  if theirs is not None:
    sides['theirs'], info = theirs, theirs.info
  vocab = sides['ours'].vocab
  check = None
  if 'theirs' not in failed:  # the same prompt's logits on both sides, once, untimed
    ids = prompt_ids(CHECK_TOKENS, vocab, seed=1)
    ours_logits, theirs_logits = sides['ours'].logits(ids), sides['theirs'].logits(ids)
    check = {'tokens': CHECK_TOKENS,
             'logits_max_abs_diff': float(np.abs(ours_logits - theirs_logits).max()),
             'logits_max_abs': float(np.abs(theirs_logits).max()),
             'argmax_agree': int((ours_logits.argmax(-1) == theirs_logits.argmax(-1)).sum())}
  runs = {f'prefill {n}': (lambda side, n=n: side.time_prefill(prompt_ids(n, vocab)), n)
          for n in args.prefill}
  if args.decode_steps:
    ids = prompt_ids(args.decode_prompt, vocab)
    runs[f'decode after {args.decode_prompt}'] = (
        lambda side: side.time_decode(ids, args.decode_steps), args.decode_steps)
  runs.update({f'attention {n}': (lambda side, n=n: side.time_attention(n), n)
               for n in args.attention})
  device = sides['ours'].device
  ours_device = (device.platform if device.device_kind == device.platform
                 else f'{device.platform} {device.device_kind}')
  print(f'# {model_name}, batch 1, {args.dtype}, {threads()} threads a side '
        f'({os.cpu_count()} cores); ours: jax {jax.__version__}, {ours_device}; theirs: '
        + (f'transformers {info["transformers"]}, torch {info["torch"]}, attention '
           f'{info["attention"]}, {info["threads"]} threads, {info.get("device", "cpu")}'
           if info else failed['theirs']),
        flush=True)
  if check:
    print(f'# logits max |diff| {check["logits_max_abs_diff"]:.2e} (max |logit| '
          f'{check["logits_max_abs"]:.2f}), greedy tokens agree at {check["argmax_agree"]} of '
          f'{CHECK_TOKENS} positions', flush=True)
  times = {(name, side): [] for name in runs for side in ('ours', 'theirs')}
  for repeat in range(args.repeats + 1):  # the first: warm-up, not recorded
    for name, (run, _) in runs.items():
      for side, model in sides.items():
        if side in failed:
          continue
        time.sleep(SETTLE_S)
        try:
          seconds = run(model)
        except Exception as e:  # noqa: BLE001  (a side out of memory: '-' and why)
          failed[side] = f'{name}: {type(e).__name__}: {str(e)[:300]}'
          continue
        if repeat:
          times[name, side].append(seconds)
        print(f'#   {name} {side}: {seconds:.3f} s' + ('' if repeat else ' (warm-up)'),
              flush=True)
  if 'theirs' in sides and 'theirs' not in failed:
    sides['theirs'].close()
  rows = []
  for name, (_, tokens) in runs.items():
    med = {side: float(np.median(t)) if t else None
           for (n, side), t in times.items() if n == name}
    rate = {side: tokens / s if s else None for side, s in med.items()}
    rows.append({'run': name, 'tokens': tokens, 'seconds': med, 'tokens_per_s': rate,
                 'repeats_s': {side: t for (n, side), t in times.items() if n == name},
                 'ours_over_theirs': (rate['ours'] / rate['theirs']
                                      if rate['ours'] and rate['theirs'] else None)})

  def cell(v, spec):
    return '-' if v is None else format(v, spec)

  lines = ['| run | ours s | theirs s | ours tokens/s | theirs tokens/s | ours / theirs |',
           '|---|---:|---:|---:|---:|---:|']
  for r in rows:
    lines.append(f'| {r["run"]} | {cell(r["seconds"]["ours"], ".3f")} | '
                 f'{cell(r["seconds"]["theirs"], ".3f")} | '
                 f'{cell(r["tokens_per_s"]["ours"], ",.0f")} | '
                 f'{cell(r["tokens_per_s"]["theirs"], ",.0f")} | '
                 f'{cell(r["ours_over_theirs"], ".2f")} |')
  print('\n'.join(lines))
  for side, why in failed.items():
    print(f'# {side}: {why}')
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump({'model': model_name, 'threads': threads(), 'cores': os.cpu_count(),
               'repeats': args.repeats, 'theirs': info, 'failed': failed, 'rows': rows,
               'wall_s': round(time.time() - start), 'dtype': args.dtype,
               'device': {'ours': ours_device, 'theirs': info.get('device')},
               'random_weights': ({'layers': args.layers, 'vocab': args.vocab}
                                  if args.random_weights else None),
               'check': check}, f, indent=1)
  print(f'# wall time {time.time() - start:.0f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
