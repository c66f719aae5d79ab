"""Does RoPE scaling extend a pretrained model's context? SmolLM2-135M, no fine-tuning.

  ./launch.sh run benchmarks/pretrained_context.py          # every task, row and length
  ./launch.sh run benchmarks/pretrained_context.py --tasks perplexity passkey \\
      --lengths 512 2048 --trials 20
  ./launch.sh run benchmarks/pretrained_context.py --tasks memory --lengths 32768
  ./launch.sh run benchmarks/pretrained_context.py --tasks maps
  ./launch.sh run benchmarks/pretrained_context.py --lengths 512 --trials 2 \\
      --rows none,linear2 --eval_tokens 1024 --out /tmp/quick     # a quick look

The model is SmolLM2-135M-Instruct (./launch.sh fetch smollm2; --model PATH
takes another Llama GGUF), read by `pretrained.load` and built by
`models.build`, trained at context 8192 with RoPE base 1e5. Each row changes
its rotary attention's frequencies alone (attention/schemes/rotary.py):
  none      RoPE as trained
  linearS   Position Interpolation (rope_scaling=linear), factor S
  ntkS      NTK-aware base (rope_scaling=ntk), factor S
  yarnS     YaRN (rope_scaling=yarn), factor S, rope_original_max_len 8192
Every call runs with attention_kwargs.kernel='auto': the chunked
kernel wherever the dense scores would pass 16 MiB (past about 680
tokens), so that 32,768 tokens fit.

Tasks (--tasks; each cell is one compiled forward pass of [1, L] tokens
per window or trial, its logits turned into each position's next-token
loss and whether its argmax is the next token):
  perplexity  Tiny Shakespeare's validation text (the last 10% of the
      characters, data/corpora.py; 35,983 tokens of SmolLM2's BPE) cut from
      its start into non-overlapping windows of L tokens, as many as fit in
      max(L, --eval_tokens) tokens (default 8192: 16 windows at 512, 4 at
      2048, one from 8192 on); each window scores its last L - 1 tokens.
      Every L up to --eval_tokens scores the same text. Nats per token and
      perplexity, its exp.
  passkey     A 5-digit key in filler text (Mohtashami and Jaggi 2023): an
      instruction, the filler ("The grass is green. ..." repeated), the key
      sentence "The pass key is K. Remember it." after the whole filler
      group (its five sentences) nearest a uniformly drawn depth, more
      filler cut to the length, "What is the pass key? The pass key is"
      and the answer " K": L tokens in all.
      Right when the argmax at each answer position is the answer's token:
      the space and the five digits, teacher-forced, which is greedy
      decoding's exact match (each greedy token, right, is the next
      teacher-forced input). --trials prompts a length, keys and depths
      drawn from (--seed, L, trial): every row sees the same prompts.
  maps        Attention weights of a few heads on a short passkey prompt
      (--map_tokens), through plot_attention: one PNG, attention_heads.png.
      --heads auto: the heads that put the most weight, from the queries
      that predict the answer, on the key's digits in the prompt, and
      layer 0's head 0 beside them; or LAYER:HEAD,... .
  memory      XLA's compiled memory of one L-token call (nothing runs):
      arguments (the parameters), temporaries and output.

Prints a markdown table per task and writes under --out (default
benchmarks/results/pretrained_context/): results.jsonl, one JSON line a cell
(a re-run skips the cells done with the same settings, so a long grid can
be stopped and resumed), tables.md, and the maps' PNG. The results and
their wall times on the 2-core CPU (about 50 minutes for the second command)
are in benchmarks/RESULTS.md, "Does RoPE scaling extend a pretrained model's
context?".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flaxformer_lite import models, plot_attention, pretrained  # noqa: E402
from flaxformer_lite.data import corpora, loading, shared  # noqa: E402

TASKS = ('perplexity', 'passkey', 'maps', 'memory')
TABLED = ('perplexity', 'passkey', 'memory')  # a cell per row and length
ROWS = 'none,linear2,linear4,ntk2,ntk4,yarn2,yarn4'
LENGTHS = (512, 2048, 8192, 16384, 32768)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'pretrained_context')
NOT_RUN = 'not run'

INSTRUCTION = ('There is an important piece of information hidden inside a lot of irrelevant '
               'text. Find it and memorize it; I will quiz you about it.\n')
FILLER = ' The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.'
KEY_SENTENCE = ' The pass key is {key}. Remember it.'
QUESTION = '\nWhat is the pass key? The pass key is'
ANSWER = ' {key}'


@dataclasses.dataclass
class Row:
  """One rope_scaling setting: name 'none' | 'linearS' | 'ntkS' | 'yarnS'."""
  name: str
  scaling: str
  factor: float


def parse_rows(specs) -> list[Row]:
  """['none,linear2', 'yarn4'] -> their Rows (commas or separate words)."""
  rows = []
  for name in (n for spec in specs for n in spec.split(',') if n):
    found = re.fullmatch(r'(linear|ntk|yarn)(\d+(?:\.\d+)?)', name)
    if name == 'none':
      rows.append(Row('none', 'none', 1.0))
    elif found and float(found.group(2)) >= 1:
      rows.append(Row(name, found.group(1), float(found.group(2))))
    else:
      raise ValueError(f'--rows: {name!r} is not a row; valid: none, or linear, ntk or yarn '
                       'followed by a factor >= 1 (linear2, yarn4, ntk1.5)')
  return rows


def row_config(model_config, row: Row, original_max_len: int, chunk_size: int = 0):
  """The checkpoint's `model` section with this row's rope_scaling, on 'auto' kernels
  (chunk_size: the chunked kernel's blocks; 0 keeps the default)."""
  c = model_config.copy_and_resolve_references()
  if c.attention != 'rotary':
    raise ValueError(f'{c.attention!r} attention: the rows change rotary attention '
                     '(a Llama-family GGUF)')
  kwargs = c.attention_kwargs
  kwargs.rope_scaling, kwargs.rope_factor = row.scaling, row.factor
  kwargs.rope_original_max_len = original_max_len if row.scaling == 'yarn' else 0
  kwargs.kernel = 'auto'
  if chunk_size:
    kwargs.chunk_size = chunk_size
  models.validate(c)
  return c


def scorer(model):
  """Jitted (params, ids [b, L]) -> (nll [b, L-1] float32: -log p(ids[t+1] |
  ids[:t+1]), hit [b, L-1] bool: argmax of those logits == ids[t+1])."""
  @jax.jit
  def score(params, ids):
    logits = model.apply({'params': params}, ids)  # [b, L, V]
    # Reduced over all L rows and sliced after: a slice of the [b, L, V]
    # logits first would be a copy of them (6 GiB at 32,768 tokens).
    following = jnp.roll(ids, -1, axis=1)
    picked = jnp.take_along_axis(logits, following[..., None], -1)[..., 0]
    nll = jax.nn.logsumexp(logits, -1) - picked
    hit = jnp.argmax(logits, -1) == following
    return nll[:, :-1], hit[:, :-1]
  return score


def validation_ids(tokenizer, data_dir: str = '') -> np.ndarray:
  """Tiny Shakespeare's validation text (corpora.py's split) -> its token ids [T]."""
  data_dir = data_dir or loading.default_data_dir()
  with loading.data_dir_lock(data_dir):
    builder = corpora.tiny_shakespeare(data_dir, shared.manual_dir('tiny_shakespeare'))
  (text,) = corpora.read_text(builder, 'validation')
  return np.asarray(tokenizer.encode(text), np.int32)


def windows(ids, length: int, eval_tokens: int) -> np.ndarray:
  """ids [T] -> [k, length]: non-overlapping windows from the start, as many
  as fit in max(length, eval_tokens) tokens (and in T)."""
  if len(ids) < length:
    raise ValueError(f'the text has {len(ids)} tokens, fewer than one window of {length}')
  count = min(max(length, eval_tokens), len(ids)) // length
  return np.asarray(ids[:count * length]).reshape(count, length)


def perplexity(score, params, ids, length: int, eval_tokens: int) -> dict:
  """Mean next-token loss over `windows` of ids [T], each window one call."""
  batches = windows(ids, length, eval_tokens)
  total = 0.0
  for window in batches:
    nll, _ = score(params, jnp.asarray(window[None]))
    total += float(np.sum(np.asarray(nll, np.float64)))
  tokens = batches.shape[0] * (length - 1)
  return {'nll': total / tokens, 'ppl': math.exp(total / tokens), 'tokens': tokens,
          'windows': int(batches.shape[0])}


@dataclasses.dataclass
class Passkey:
  """One passkey prompt.

  ids: [L] int32, the prompt and then the answer (its last `answer` tokens).
  key: the 5 digits; key_at: the index of the key sentence's first token;
  digits: the indices in ids of the key's digits (in the key sentence).
  depth: key_at's place in the filler, 0 (its start) .. 1 (its end).
  """
  ids: np.ndarray
  key: str
  key_at: int
  digits: np.ndarray
  answer: int
  depth: float


def passkey_prompt(tokenizer, length: int, key: str, depth: float) -> Passkey:
  """The L-token prompt hiding `key` after the whole filler sentence group
  nearest `depth` (0..1) of the filler; the filler's last group is cut to
  make the length exact."""
  head, unit, hidden, question, answer = (
      np.asarray(tokenizer.encode(text), np.int32)
      for text in (INSTRUCTION, FILLER, KEY_SENTENCE.format(key=key), QUESTION,
                   ANSWER.format(key=key)))
  fill = length - len(head) - len(hidden) - len(question) - len(answer)
  if fill < 0:
    raise ValueError(f'a passkey prompt needs at least {length - fill} tokens, not {length}')
  filler = np.tile(unit, fill // len(unit) + 1)[:fill]
  at = len(unit) * min(round(depth * fill / len(unit)), fill // len(unit))
  ids = np.concatenate([head, filler[:at], hidden, filler[at:], question, answer])
  digits = len(head) + at + np.flatnonzero([tokenizer.decode([t]).strip().isdigit()
                                            for t in hidden])
  return Passkey(ids, key, len(head) + at, digits, len(answer), at / fill if fill else 0.0)


def passkey_trials(tokenizer, length: int, trials: int, seed: int) -> list[Passkey]:
  """`trials` prompts of `length` tokens; key and depth drawn from (seed, length, trial)."""
  out = []
  for trial in range(trials):
    rng = np.random.default_rng([seed, length, trial])
    out.append(passkey_prompt(tokenizer, length, str(rng.integers(10000, 100000)),
                              float(rng.uniform())))
  return out


def retrieved(hit, answer: int) -> bool:
  """hit [L-1] (scorer's, one row) -> whether every answer token is the argmax."""
  return bool(np.all(np.asarray(hit)[-answer:]))


def passkey(score, params, prompts) -> dict:
  right = [retrieved(score(params, jnp.asarray(p.ids[None]))[1][0], p.answer) for p in prompts]
  return {'correct': int(sum(right)), 'trials': len(right), 'accuracy': sum(right) / len(right),
          'depths_missed': [round(p.depth, 3) for p, r in zip(prompts, right) if not r]}


def memory(score, params, length: int) -> dict:
  """XLA's compiled memory (MiB) of one [1, length] call."""
  shape = jax.ShapeDtypeStruct((1, length), jnp.int32)
  stats = score.lower(params, shape).compile().memory_analysis()
  out = {name: getattr(stats, f'{name}_size_in_bytes') / 2**20
         for name in ('argument', 'temp', 'output', 'alias')}
  out['total'] = out['argument'] + out['temp'] + out['output'] - out['alias']
  return out


def _label(tokenizer):
  def label(i) -> str:
    return tokenizer.decode([int(i)]).replace('\n', '\\n').replace(' ', '·')
  return label


def key_heads(weights: dict, prompt: Passkey, count: int) -> list[tuple[int, int]]:
  """The `count` (layer, head) pairs whose queries that predict the answer
  put the most weight on the key's digits in the prompt, most first.

  weights: {layer: [h, L, L]} of one prompt.
  """
  queries = np.arange(len(prompt.ids) - prompt.answer - 1, len(prompt.ids) - 1)
  mass = {(layer, h): float(w[h][np.ix_(queries, prompt.digits)].sum(-1).mean())
          for layer, w in weights.items() for h in range(w.shape[0])}
  return sorted(mass, key=mass.get, reverse=True)[:count]


def plot_heads(model_config, params, tokenizer, prompt: Passkey, heads: str, out_dir: str,
               name: str):
  """One PNG of the chosen heads' weights on `prompt` (module docstring),
  titled with the model's `name`: (its path, the (layer, head) pairs)."""
  config = types.SimpleNamespace(model=model_config)
  layers = plot_attention.attention_maps(config, params, prompt.ids, label=_label(tokenizer))
  weights = {int(re.search(r'layer_(\d+)', m.path).group(1)): m.weights for m in layers}
  if heads == 'auto':
    chosen = [(0, 0)] + key_heads(weights, prompt, 3)
  else:
    chosen = [tuple(int(x) for x in pair.split(':')) for pair in heads.split(',')]
  selected = plot_attention.AttentionMap(
      'attention_heads', np.stack([weights[layer][h] for layer, h in chosen]), layers[0].queries,
      layers[0].keys, 'input', 'input', heads=[f'layer {layer} head {h}' for layer, h in chosen])
  title = (f'{name}, RoPE as trained: a {len(prompt.ids)}-token passkey prompt '
           f'(key {prompt.key} at token {prompt.key_at})')
  (path,) = plot_attention.plot([selected], out_dir, title)
  return path, chosen


def _read(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _cell(records, task, row, length):
  found = [r for r in records if (r['task'], r['row'], r['length']) == (task, row, length)]
  return found[-1] if found else None


def tables(records, rows: list[str], lengths: list[int]) -> str:
  """Markdown tables of the records: perplexity, passkey and memory, rows x lengths."""
  head = '| rope | ' + ' | '.join(str(n) for n in lengths) + ' |\n|---|' + '---:|' * len(lengths)
  out = []
  formats = {'perplexity': ('Perplexity (nats/token), Tiny Shakespeare validation',
                            lambda r: f'{r["ppl"]:.2f} ({r["nll"]:.3f})'),
             'passkey': ('Passkey retrieval, exact match of the key',
                         lambda r: f'{r["accuracy"]:.2f} ({r["correct"]}/{r["trials"]})'),
             'memory': ('Compiled memory of one call, GiB (parameters + temporaries + output)',
                        lambda r: f'{r["total"] / 1024:.2f} ({r["argument"] / 1024:.2f} + '
                                  f'{r["temp"] / 1024:.2f} + {r["output"] / 1024:.2f})')}
  for task, (title, cell) in formats.items():
    if not any(r['task'] == task for r in records):
      continue
    lines = [f'{title}\n', head]
    for row in rows:
      cells = [_cell(records, task, row, n) for n in lengths]
      lines.append(f'| {row} | ' + ' | '.join(cell(c) if c else NOT_RUN for c in cells) + ' |')
    out.append('\n'.join(lines))
  return '\n\n'.join(out) + '\n'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tasks', nargs='+', choices=TASKS, default=['perplexity', 'passkey',
                                                                      'maps'])
  parser.add_argument('--rows', nargs='+', default=[ROWS],
                      help=f'rope_scaling rows, comma-separated (default {ROWS})')
  parser.add_argument('--lengths', nargs='+', type=int, default=list(LENGTHS))
  parser.add_argument('--trials', type=int, default=20, help='passkey prompts per cell')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--eval_tokens', type=int, default=8192,
                      help='perplexity: tokens of text scored at each length (at least one '
                           'window)')
  parser.add_argument('--original_max_len', type=int, default=8192,
                      help="yarn's rope_original_max_len: the trained context")
  parser.add_argument('--chunk_size', type=int, default=0,
                      help="the chunked kernel's block size (default: the kernel's); the "
                           'results do not depend on it, the time does (a GPU runs faster '
                           'with larger blocks)')
  parser.add_argument('--map_tokens', type=int, default=64)
  parser.add_argument('--heads', default='auto', help="maps: 'auto' or LAYER:HEAD,...")
  parser.add_argument('--model', default=None, help='a Llama GGUF (default: smollm2, fetched)')
  parser.add_argument('--data_dir', default='', help='TFDS data_dir (default: TFDS_DATA_DIR '
                      'or ~/tensorflow_datasets)')
  parser.add_argument('--out', default=OUT)
  args = parser.parse_args(argv)
  try:
    rows = parse_rows(args.rows)
  except ValueError as e:
    parser.error(str(e))
  start = time.time()
  os.makedirs(args.out, exist_ok=True)
  results = os.path.join(args.out, 'results.jsonl')
  records = _read(results)
  def settings(task, n):
    """What a cell's result depends on besides its row and length: the
    scored text (max(n, --eval_tokens) tokens), the passkey trials."""
    return {'perplexity': {'eval_tokens': max(n, args.eval_tokens)},
            'passkey': {'trials': args.trials, 'seed': args.seed}, 'memory': {}}[task]

  def done(r):
    return r['settings'] == settings(r['task'], r['length'])

  todo = {(n, row.name): [t for t in args.tasks if t in TABLED and not any(
              done(r) and (r['task'], r['row'], r['length']) == (t, row.name, n)
              for r in records)] for n in args.lengths for row in rows}
  if any(todo.values()) or 'maps' in args.tasks:  # else: the tables of a finished grid
    path = args.model or pretrained.fetch('smollm2')
    base, params = pretrained.load(path)
    params = jax.device_put(params)
    tokenizer = pretrained.tokenizer(path)
    print(f'# {os.path.basename(path)}: {base.num_decoder_layers} layers, d {base.d_model}, '
          f'{jax.devices()[0].device_kind}, {os.cpu_count()} cores; load '
          f'{time.time() - start:.0f} s', flush=True)
  if 'maps' in args.tasks:
    prompt = passkey_prompt(tokenizer, args.map_tokens, '58231', 0.3)
    png, chosen = plot_heads(base, params, tokenizer, prompt, args.heads, args.out,
                             os.path.basename(args.model) if args.model else 'SmolLM2-135M')
    print(f'maps: {png} (layer, head: {chosen})', flush=True)
  if any('perplexity' in tasks for tasks in todo.values()):
    text = validation_ids(tokenizer, args.data_dir)
  for n in args.lengths:
    if any('passkey' in todo[n, row.name] for row in rows):
      prompts = passkey_trials(tokenizer, n, args.trials, args.seed)
    for row in rows:
      if not todo[n, row.name]:
        continue
      score = scorer(models.build(row_config(base, row, args.original_max_len, args.chunk_size)))
      for task in todo[n, row.name]:
        began = time.time()
        try:
          if task == 'perplexity':
            out = perplexity(score, params, text, n, args.eval_tokens)
          elif task == 'passkey':
            out = passkey(score, params, prompts)
          else:
            out = memory(score, params, n)
        except ValueError as e:
          print(f'# {task} {row.name} {n}: {e}', flush=True)
          continue
        record = {'task': task, 'row': row.name, 'length': n, 'settings': settings(task, n),
                  **out, 'seconds': round(time.time() - began, 1),
                  'device': jax.devices()[0].device_kind}
        records.append(record)
        with open(results, 'a') as f:
          f.write(json.dumps(record) + '\n')
        print(json.dumps(record), flush=True)

  # Every length with a result, not only this call's: a grid filled in by
  # several calls keeps one table.
  kept = [r for r in records if done(r)]
  table = tables(kept, [r.name for r in rows],
                 sorted(set(args.lengths) | {r['length'] for r in kept}))
  with open(os.path.join(args.out, 'tables.md'), 'w') as f:
    f.write(table)
  print(table)
  print(f'# wall time {time.time() - start:.0f} s', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
