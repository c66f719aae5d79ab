"""SmolLM2-135M prefill and cached decoding, tokens/s, against Hugging Face transformers on PyTorch.

  ./launch.sh run benchmarks/pretrained_speed.py [--prefill 2048 8192] [--decode_prompt 512]
      [--decode_steps 32] [--attention 2048 8192] [--repeats 3]
      [--hf_python /tmp/hfenv/bin/python]
  taskset -c 0 ./launch.sh run benchmarks/pretrained_speed.py ...   # both sides on one core

Both sides run the same GGUF file (./launch.sh fetch smollm2; --model PATH),
dequantised to float32: ours through pretrained.load and models.build with
attention_kwargs.implementation='auto' (the chunked kernel past 16 MiB of
scores, and when decoding once the cache spans more than two blocks),
theirs through LlamaForCausalLM.from_pretrained(gguf_file=...) with its
default attention (reported: sdpa, torch's fused dense kernel).

The Hugging Face side runs in a venv of its own (torch, transformers and
gguf: `pip install -e '.[golden]'` into it, as for tests/golden/make_golden.py)
as a worker subprocess: this file, run by --hf_python with --hf_worker,
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
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, 'results', 'pretrained_context', 'speed.json')
# Before each measurement: the other side's idle threads stop spinning first
# (torch's OpenMP threads spin-wait after a call, on the cores ours then uses).
SETTLE_S = 0.5
HF_PYTHON = os.environ.get('FFL_HF_PYTHON', '/tmp/hfenv/bin/python')


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
  """n token ids, the same on both sides; none of them a special token (0-16)."""
  return np.random.default_rng([seed, n]).integers(17, vocab, n).tolist()


def threads() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


class Ours:
  """This project's model: prefill and decode timed as the module docstring says."""

  def __init__(self, path: str):
    import jax
    from flaxformer_lite import decoding, models, pretrained
    self.jax, self.decoding = jax, decoding
    config, params = pretrained.load(path)
    config.attention_kwargs.implementation = 'auto'
    self.config, self.vocab, self._attention = config, config.vocab_size, {}
    self.model = models.build(config, decode=True)
    self.params = jax.device_put(params)
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

  def time_attention(self, n: int) -> float:
    if n not in self._attention:  # compiled, and its buffers touched, once
      from flaxformer_lite.attention import masks, registry
      jnp, c = self.jax.numpy, self.config
      variant, kernel = registry.get(c.attention), registry.resolve_kernel(c.attention,
                                                                          c.attention_kwargs)
      q, k, v = (jnp.asarray(x) for x in attention_inputs(
          n, c.num_heads, c.num_kv_heads or c.num_heads, c.d_model // c.num_heads))
      attend = self.jax.jit(lambda q, k, v: variant.chunked(
          q, k, v, mask=masks.MaskSpec(causal=True), chunk_size=kernel.chunk_size))
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

  def __init__(self, python: str, path: str):
    self.proc = subprocess.Popen(
        [python, os.path.abspath(__file__), '--hf_worker', '--model', path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.info = self._answer()

  def _answer(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f'the Hugging Face worker stopped (exit {self.proc.wait()}); its '
                         'error is above')
    return json.loads(line)

  def ask(self, **request) -> float:
    self.proc.stdin.write(json.dumps(request) + '\n')
    self.proc.stdin.flush()
    answer = self._answer()
    if answer.get('note'):
      print(f'#   theirs, {request["op"]} {request.get("n", "")}: {answer["note"]}', flush=True)
    return answer['seconds']

  def time_prefill(self, ids):
    return self.ask(op='prefill', ids=ids)

  def time_decode(self, ids, steps):
    return self.ask(op='decode', ids=ids, steps=steps)

  def time_attention(self, n):
    return self.ask(op='attention', n=n)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def hf_worker(path: str) -> int:
  """The Hugging Face side (module docstring): runs in the venv with torch."""
  reply = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)  # what the libraries print goes to stderr, not into the replies
  import torch
  import transformers
  torch.set_num_threads(threads())
  model = transformers.LlamaForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()

  def send(**message):
    reply.write(json.dumps(message) + '\n')
    reply.flush()

  send(torch=torch.__version__, transformers=transformers.__version__,
       attention=model.config._attn_implementation, threads=torch.get_num_threads())
  config = model.config
  heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
  for line in sys.stdin:
    request = json.loads(line)
    if request['op'] == 'attention':
      q, k, v = (torch.from_numpy(x).transpose(1, 2) for x in attention_inputs(
          request['n'], heads, kv_heads, config.hidden_size // heads))
      k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
      attend = torch.nn.functional.scaled_dot_product_attention
      with open('/proc/self/statm') as f:  # resident pages now
        resident = int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
      with torch.inference_mode():
        attend(q, k, v, is_causal=True)
        start = time.perf_counter()
        attend(q, k, v, is_causal=True)
        seconds = time.perf_counter() - start
      # The most the calls can have added to what was resident (the peak,
      # ru_maxrss in KiB, may be the model's load): dense scores would add
      # 4 * heads * n^2 bytes.
      most = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - resident
      send(seconds=seconds, note=f'its memory grew by at most {most:.0f} MiB (dense float32 '
           f'scores: {4 * heads * request["n"] ** 2 / 2**20:.0f} MiB)')
      continue
    ids = torch.tensor([request['ids']])
    with torch.inference_mode():
      cache = transformers.DynamicCache(config=model.config)
      start = time.perf_counter()
      out = model(ids, cache=cache, use_cache=True)
      if request['op'] == 'decode':
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(request['steps']):
          token = model(token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
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
  parser.add_argument('--hf_python', default=HF_PYTHON,
                      help="a python with torch, transformers and gguf ('': ours alone)")
  parser.add_argument('--model', default=None, help='a Llama GGUF (default: smollm2, fetched)')
  parser.add_argument('--out', default=OUT)
  parser.add_argument('--hf_worker', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.hf_worker:
    return hf_worker(args.model)
  sys.path.insert(0, os.path.dirname(HERE))
  import jax
  from flaxformer_lite import pretrained
  path = args.model or pretrained.fetch('smollm2')
  start = time.time()
  sides = {'ours': Ours(path)}
  failed, info = {}, {}
  if args.hf_python:
    try:
      sides['theirs'] = Theirs(args.hf_python, path)
      info = sides['theirs'].info
    except (OSError, RuntimeError) as e:
      failed['theirs'] = str(e)
  else:
    failed['theirs'] = 'no --hf_python'
  vocab = sides['ours'].vocab
  runs = {f'prefill {n}': (lambda side, n=n: side.time_prefill(prompt_ids(n, vocab)), n)
          for n in args.prefill}
  if args.decode_steps:
    ids = prompt_ids(args.decode_prompt, vocab)
    runs[f'decode after {args.decode_prompt}'] = (
        lambda side: side.time_decode(ids, args.decode_steps), args.decode_steps)
  runs.update({f'attention {n}': (lambda side, n=n: side.time_attention(n), n)
               for n in args.attention})
  print(f'# {os.path.basename(path)}, batch 1, float32, {threads()} threads a side '
        f'({os.cpu_count()} cores), {jax.devices()[0].device_kind}; theirs: '
        + (f'transformers {info["transformers"]}, torch {info["torch"]}, attention '
           f'{info["attention"]}, {info["threads"]} threads' if info else failed['theirs']),
        flush=True)
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
    json.dump({'model': os.path.basename(path), 'threads': threads(), 'cores': os.cpu_count(),
               'repeats': args.repeats, 'theirs': info, 'failed': failed, 'rows': rows,
               'wall_s': round(time.time() - start)}, f, indent=1)
  print(f'# wall time {time.time() - start:.0f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
