"""Train short, test long: how each position scheme extrapolates (Press et al. 2022, fig. 1).

  ./launch.sh run benchmarks/train_short_test_long.py --out=workdirs/short_long \
      --manual_dir=../shared/data/tiny_shakespeare

The small model uses one core about as well as two, so on a 2-core machine
one process per seed (`taskset -c 0 ... --seeds 0 &`, `taskset -c 1 ...
--seeds 1`) halves the wall time; a last run of the command without --seeds
then finds every run done and writes the table and the plot.
`--plot_only=RESULTS.jsonl` redraws the figure of saved results without
training (benchmarks/results/train_short_test_long.png:
`--plot_only=benchmarks/results/train_short_test_long.jsonl`).

Trains a character LM on Tiny Shakespeare (experiments/tiny_shakespeare_cpu.py:
nanoGPT's CPU recipe, with Flax's initialisation) at context --train_context
with each position scheme, the same budget and seeds for all (by default 1000
steps, 3.1M characters), then measures validation loss (nats per
character) at each --eval_contexts length: the validation split cut into
non-overlapping windows of that length, every character scored once, as the
ALiBi paper's non-overlapping evaluation. Long contexts run on the chunked
attention kernel ('auto' picks it), so 16k characters fit in a few hundred MiB.
A scheme that cannot run at a length (learned positions past the trained
table) is marked n/a.

Writes under --out: one training workdir per (scheme, seed) (re-running the
command resumes and skips what is done), results.jsonl (one line per run and
context), table.md (mean and spread over seeds) and loss_vs_context.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flaxformer_lite import config as config_lib, data, models, sweep_plots  # noqa: E402
from flaxformer_lite.train import checkpoints, loop, state as state_lib  # noqa: E402

# scheme -> (model.positions, model.attention, attention_kwargs)
SCHEMES = {
    'sinusoidal': ('sinusoidal', 'dot_product', {}),
    'learned': ('learned', 'dot_product', {}),
    'nope': ('none', 'dot_product', {}),
    'rotary': ('none', 'rotary', {}),
    'alibi': ('none', 'alibi', {}),
    't5_bias': ('none', 't5_bias', {'bidirectional': False}),
    'shaw_k16': ('none', 'shaw', {'max_distance': 16}),
    'shaw_k64': ('none', 'shaw', {'max_distance': 64}),
    'transformer_xl': ('none', 'transformer_xl', {}),
    'deberta': ('none', 'deberta', {}),
}


def scheme_config(scheme: str, seed: int, args):
  """The experiment's config with this scheme, context and budget."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'experiments'))
  import tiny_shakespeare_cpu  # noqa: E402  (an experiment file: values only)
  c = tiny_shakespeare_cpu.get_config()
  positions, attention, kwargs = SCHEMES[scheme]
  c.seed = seed
  c.model.positions, c.model.attention = positions, attention
  # Flax's initialisation, tokens scaled by sqrt(d_model) (Vaswani et al.),
  # for every scheme: with the recipe's GPT-2 initialisation (token
  # embeddings of std 0.02, unscaled) a sinusoid of amplitude 1 drowns the
  # tokens and the model stays at the unigram loss.
  c.model.init = 'default'
  for k, v in kwargs.items():
    c.model.attention_kwargs[k] = v
  c.model.max_len = c.data.max_len = args.train_context
  c.data.manual_dir = args.manual_dir
  c.train.num_steps = args.steps
  c.train.warmup_steps = min(c.train.warmup_steps, max(args.steps // 20, 1))
  c.train.eval_every = c.train.checkpoint_every = args.steps
  c.train.log_every = max(args.steps // 10, 1)
  return c


def loss_at_context(config, params, stream, context: int, tokens_per_batch: int) -> float:
  """Mean next-character loss over `stream` [T] in non-overlapping windows of `context`."""
  c = config_lib.from_json(config_lib.to_json(config))
  c.data.max_len = context
  model = models.build(c.model)
  arrays = data.lm_eval_arrays(stream, context)
  rows = max(1, tokens_per_batch // context)

  @jax.jit
  def sums(params, inputs, targets):
    logits = model.apply({'params': params}, inputs).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    weights = (targets != models.PAD_ID).astype(jnp.float32)
    return jnp.sum(nll * weights), jnp.sum(weights)

  total, count = 0.0, 0.0
  for batch in data.eval_batches(arrays, rows, rows=rows):
    s, w = sums(params, batch['inputs'], batch['targets'])
    total, count = total + float(s), count + float(w)
  return total / count


def trained_params(config, workdir: str):
  dataset = data.load(config.data)
  with config.unlocked():
    config.model.vocab_size = config.model.vocab_size or dataset.vocab_size
  model = models.build(config.model)
  example = {'inputs': np.ones((1, config.data.max_len), np.int32)}
  example['targets'] = example['inputs']
  state = state_lib.create(model, config, example, jax.random.key(0))
  ckpt = checkpoints.Checkpointer(workdir, keep=1)
  state, _ = ckpt.restore(state)
  ckpt.manager.close()
  return config, state.params, dataset.splits['validation']


def _summary(records, schemes, contexts):
  """Markdown table: mean ± half the range over seeds, per scheme and context."""
  head = '| scheme | ' + ' | '.join(str(n) for n in contexts) + ' |'
  lines = [head, '|' + '---|' * (len(contexts) + 1)]
  for scheme in schemes:
    cells = []
    for n in contexts:
      vals = [r['loss'] for r in records if r['scheme'] == scheme and r['context'] == n]
      if not vals:
        cells.append('')
      elif any(v is None for v in vals):
        cells.append('n/a')
      else:
        cells.append(f'{np.mean(vals):.3f} ± {(max(vals) - min(vals)) / 2:.3f}')
    lines.append(f'| {scheme} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


# Each scheme its own marker and dash: curves that share a color or cross stay apart.
ZOOM = 0.1  # the right panel: losses within 10% of the lowest


def _curves(records, schemes, contexts):
  """{scheme: (contexts, means, mins, maxs, the first context it cannot run at)}."""
  out = {}
  for scheme in schemes:
    xs, ys, lo, hi, na = [], [], [], [], None
    for n in contexts:
      vals = [r['loss'] for r in records if r['scheme'] == scheme and r['context'] == n]
      if vals and all(v is not None for v in vals):
        xs.append(n), ys.append(np.mean(vals)), lo.append(min(vals)), hi.append(max(vals))
      elif vals and na is None:
        na = n
    if xs:
      out[scheme] = xs, ys, lo, hi, na
  return out


def _plot(records, schemes, contexts):
  """Validation loss against evaluation context: every scheme from 0 on the
  left, the best ones (within ZOOM of the lowest loss) magnified on the right,
  the legend below both. Returns the matplotlib Figure."""
  plt = sweep_plots.pyplot()
  curves = _curves(records, schemes, contexts)
  seeds = sorted({r['seed'] for r in records})
  best = min(min(ys) for _, ys, _, _, _ in curves.values())
  top = max(max(hi) for _, _, _, hi, _ in curves.values())
  with plt.rc_context(sweep_plots.READABLE):
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(11, 5.2), layout='constrained')
    for i, (scheme, (xs, ys, lo, hi, na)) in enumerate(curves.items()):
      style = sweep_plots.curve_style(i)
      label = scheme + (f' (n/a from {na})' if na else '')
      for ax in (full, zoom):
        ax.plot(xs, ys, label=label if ax is full else None, **style)
        if len(seeds) > 1:
          ax.fill_between(xs, lo, hi, color=style['color'], alpha=0.15, linewidth=0)
    full.set_ylim(0, top * 1.05)
    full.axhspan(best * 0.995, best * (1 + ZOOM), color='0.5', alpha=0.15)
    full.set_title('every scheme (shaded: the zoomed range)')
    zoom.set_ylim(best * 0.995, best * (1 + ZOOM))
    zoom.set_title(f'zoom: within {ZOOM:.0%} of the lowest loss')
    for ax in (full, zoom):
      ax.set_xscale('log', base=2)
      ax.set_xticks(contexts, [str(n) for n in contexts], rotation=45)
      ax.minorticks_off()
      ax.set_xlabel('evaluation context (characters)')
      ax.set_ylabel('validation loss (nats/char)')
      ax.grid(alpha=0.3)
    spread = (f'mean of {len(seeds)} seeds, band: their range' if len(seeds) > 1
              else 'one seed')
    fig.suptitle('Tiny Shakespeare, trained at context '
                 f'{min(r["train_context"] for r in records)} ({spread})')
    fig.legend(loc='outside lower center', ncol=5)
  return fig


def _read(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _selected(records, args) -> list[dict]:
  """The records of this command's budget, context and schemes."""
  return [r for r in records if r['steps'] == args.steps
          and r['train_context'] == args.train_context and r['scheme'] in args.schemes]


def _save_plot(records, args, path: str):
  sweep_plots.save(_plot(records, args.schemes, args.eval_contexts), path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='workdirs/train_short_test_long')
  parser.add_argument('--manual_dir', default='../shared/data/tiny_shakespeare')
  parser.add_argument('--schemes', nargs='+', default=list(SCHEMES), choices=list(SCHEMES))
  parser.add_argument('--seeds', nargs='+', type=int, default=[0, 1])
  # 1000 steps of 12 x 256 characters: twice the training characters of
  # nanoGPT's recipe (2000 steps of 12 x 64) in half its updates.
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--train_context', type=int, default=256)
  parser.add_argument('--eval_contexts', nargs='+', type=int,
                      default=[256, 512, 1024, 2048, 4096, 8192, 16384])
  parser.add_argument('--eval_chars', type=int, default=0,
                      help='score only the first N validation characters (0: all)')
  parser.add_argument('--tokens_per_batch', type=int, default=16384)
  parser.add_argument('--plot_only', metavar='RESULTS.jsonl',
                      help='draw the figure of these results beside them (RESULTS.png) and '
                      'exit: no training')
  args = parser.parse_args(argv)
  if args.plot_only:
    figure = os.path.splitext(args.plot_only)[0] + '.png'
    _save_plot(_selected(_read(args.plot_only), args), args, figure)
    print(f'wrote {figure}')
    return
  os.makedirs(args.out, exist_ok=True)
  results_path = os.path.join(args.out, 'results.jsonl')
  done = _read(results_path) if os.path.exists(results_path) else []
  runs = [(s, seed) for s in args.schemes for seed in args.seeds]
  start = time.time()
  for i, (scheme, seed) in enumerate(runs, 1):
    have = {r['context'] for r in done if r['scheme'] == scheme and r['seed'] == seed
            and r['steps'] == args.steps and r['train_context'] == args.train_context}
    todo = [n for n in args.eval_contexts if n not in have]
    if not todo:
      print(f'[{i}/{len(runs)}] {scheme} seed {seed}: done before', flush=True)
      continue
    workdir = os.path.join(args.out, f'{scheme}_seed{seed}')
    config = scheme_config(scheme, seed, args)
    t0 = time.time()
    results = loop.train_and_evaluate(config, workdir)
    trained = time.time() - t0
    if 'preempted' in results:  # evaluate finished runs only
      print(f'[{i}/{len(runs)}] {scheme} seed {seed}: stopped at step {results["step"]} '
            f'({results["preempted"]}); re-run the command to resume', flush=True)
      sys.exit(1)
    config, params, stream = trained_params(config, workdir)
    if args.eval_chars:
      stream = stream[:args.eval_chars]
    t1 = time.time()
    losses = {}
    for n in todo:
      learned_too_short = config.model.positions == 'learned' and n > config.model.max_len
      loss = None if learned_too_short else loss_at_context(config, params, stream, n,
                                                            args.tokens_per_batch)
      losses[n] = loss
      record = dict(scheme=scheme, seed=seed, steps=args.steps,
                    train_context=args.train_context, context=n, loss=loss,
                    train_seconds=round(trained, 1))
      done.append(record)
      with open(results_path, 'a') as f:
        f.write(json.dumps(record) + '\n')
    shown = ' '.join(f'{n}:{"n/a" if v is None else f"{v:.3f}"}' for n, v in losses.items())
    print(f'[{i}/{len(runs)}] {scheme} seed {seed}: {args.steps} steps in {trained:.0f}s '
          f'(val loss {results["eval"]["loss"]:.3f} at {args.train_context}); eval '
          f'{time.time() - t1:.0f}s: {shown}; {(time.time() - start) / 60:.1f} min so far',
          flush=True)
  records = _selected(done, args)
  table = _summary(records, args.schemes, args.eval_contexts)
  with open(os.path.join(args.out, 'table.md'), 'w') as f:
    f.write(table + '\n')
  _save_plot(records, args, os.path.join(args.out, 'loss_vs_context.png'))
  print(table)
  print(f'wrote {args.out}/table.md and loss_vs_context.png; '
        f'{(time.time() - start) / 60:.1f} min', flush=True)


if __name__ == '__main__':
  main()
