"""Attention maps of a trained run, one PNG per attention layer:

  python -m flaxformer_lite.plot_attention --workdir=DIR [--split=validation]
      [--example=0] [--window=START:STOP] [--out=DIR/attention]

Rebuilds the model from DIR/config.json, restores the newest checkpoint,
decodes example `--example` of `--split` greedily, then runs the
teacher-forced pass on (input, decoded output) and plots every
'attention_weights' entry the model sows into 'intermediates' (Transformer
layers with `models.build(..., sow_weights=True)`, the RNN decoder always):
one figure per module path, one subplot per head, rows = queries,
columns = keys, labelled with the token ids (up to LABELLED_TOKENS of them).

The weights are dense [h, n, m] arrays, so at most MAX_WINDOW input tokens
go through the model, and the decoded output stops at MAX_WINDOW tokens.
`--window=START:STOP` picks which input tokens: the model encodes (and
decodes from) them as an input of their own, its positions counted from 0.
Without it, an example longer than MAX_WINDOW is cut to its first
MAX_WINDOW tokens. The title names the window where it is not the whole
input.

`attention_maps` and `plot` also take a decoder-only model's config and
params without a workdir (benchmarks/pretrained_context.py --tasks maps:
a few heads of a pretrained SmolLM2).

Exit codes: 0 done; 2 bad flag (a --window wider than MAX_WINDOW included),
or DIR holds no run (config.json and a checkpoint).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import numpy as np
from absl import app, flags, logging
from flax import traverse_util
from matplotlib.figure import Figure

from flaxformer_lite import compilation, config as config_lib
from flaxformer_lite import data, decoding, models, tokens
from flaxformer_lite.attention import registry
from flaxformer_lite.layers import scan
from flaxformer_lite.train import checkpoints
from flaxformer_lite.train import state as state_lib

# A registry of our own: importing this module next to main.py (which also
# defines --workdir) must not clash.
FLAGS = flags.FlagValues()
flags.DEFINE_string('workdir', None, 'A training workdir (config.json, checkpoints/).',
                    flag_values=FLAGS)
flags.DEFINE_string('split', 'validation', 'Dataset split to take the example from.',
                    flag_values=FLAGS)
flags.DEFINE_integer('example', 0, 'Index of the example in the split.', flag_values=FLAGS)
flags.DEFINE_string('window', None, 'START:STOP: the input tokens run through the model '
                    '(at most MAX_WINDOW; default: the first MAX_WINDOW).', flag_values=FLAGS)
flags.DEFINE_string('out', None, 'Output folder (default: WORKDIR/attention).',
                    flag_values=FLAGS)

SPECIAL_TOKENS = {tokens.PAD_ID: '<pad>', tokens.BOS_ID: '<s>', tokens.EOS_ID: '</s>'}
# Tokens a plot runs through the model: the sown weights of every layer are
# dense [h, n, m] float32, quadratic in this, and no image shows more.
MAX_WINDOW = 1024
# Axes up to this long get one tick label per token; longer ones, positions.
LABELLED_TOKENS = 64
HEADS_PER_ROW = 2


class UsageError(ValueError):
  """A bad flag or a workdir without a run; exit code 2."""


@dataclasses.dataclass
class Run:
  """What a workdir holds: its config, dataset, newest parameters and step."""
  config: object
  dataset: data.Dataset
  params: dict
  step: int


@dataclasses.dataclass
class AttentionMap:
  """One sown attention layer for one example.

  path: the module path, e.g. 'decoder/layer_0/cross_attention'.
  weights: [h, n, m] float32, rows (queries) summing to 1 over visible keys.
  queries, keys: n and m token labels.
  query_axis, key_axis: what the labels are ('input', 'output', 'decoder input').
  heads: h subplot titles; None: 'head 0' .. 'head h-1' (a map gathered
    from several layers names each head's layer).
  """
  path: str
  weights: np.ndarray
  queries: list[str]
  keys: list[str]
  query_axis: str
  key_axis: str
  heads: list[str] | None = None


def load_run(workdir: str) -> Run:
  """Config, dataset and the newest checkpoint's parameters of `workdir`."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise UsageError(f'--workdir={workdir} holds no config.json, so it is not a training '
                     'workdir; pass the --workdir of a run of flaxformer_lite.main')
  with open(path) as f:
    config = config_lib.from_json(f.read())
  config_lib.import_modules(config.model.get('import_modules', ''))  # the run's own variants
  if config.model.type == 'decoder_only':
    raise UsageError('plot_attention decodes an input sequence; model.type=decoder_only '
                     'has none (valid: encoder_decoder, rnn_seq2seq)')
  # Checked before Checkpointer, which would create the folder.
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise UsageError(f'--workdir={workdir} has a config.json but no checkpoints/ yet; '
                     'train until the first checkpoint (train.checkpoint_every)')
  ckpt = checkpoints.Checkpointer(workdir, config.train.keep_checkpoints)
  try:
    if ckpt.latest_step() is None:
      raise UsageError(f'{ckpt.directory} holds no complete checkpoint yet')
    dataset = data.load(config.data)
    model = models.build(config.model)
    # The parameters' shapes do not depend on the length: a long example
    # would only make the initialisation that builds the restore target slow.
    example = {k: v[:1, :MAX_WINDOW] for k, v in dataset.splits['train'].items()}
    target = state_lib.create(model, config, example, jax.random.key(config.seed))
    state, _ = ckpt.restore(target)
  finally:
    ckpt.close()
  return Run(config, dataset, state.params, int(state.step))


def trim(ids) -> np.ndarray:
  """ids [L] -> the tokens before any padding, up to and including the first EOS."""
  ids = np.asarray(ids)
  ids = ids[:np.argmax(ids == tokens.PAD_ID)] if np.any(ids == tokens.PAD_ID) else ids
  eos = np.flatnonzero(ids == tokens.EOS_ID)
  return ids[:eos[0] + 1] if eos.size else ids


def parse_window(text: str) -> tuple[int, int]:
  """'START:STOP' -> (start, stop), 0 <= start < stop."""
  try:
    start, stop = (int(x) for x in text.split(':'))
    valid = 0 <= start < stop
  except ValueError:
    valid = False
  if not valid:
    raise UsageError(f'--window={text!r} is not START:STOP with 0 <= START < STOP '
                     '(input token positions, e.g. --window=0:512)')
  return start, stop


def check_window(window: tuple[int, int], max_window: int = MAX_WINDOW) -> None:
  """Raises UsageError, naming --window, where (start, stop) spans more than max_window."""
  start, stop = window
  if stop - start > max_window:
    raise UsageError(f'--window={start}:{stop} asks for {stop - start} tokens; plot_attention '
                     f'runs at most {max_window} through the model (their attention weights '
                     f'are dense [n, m] arrays): pass a --window of at most {max_window} '
                     f'tokens, e.g. --window={start}:{start + max_window}')


def select_window(inputs, window: tuple[int, int] | None,
                  max_window: int = MAX_WINDOW) -> tuple[np.ndarray, str]:
  """inputs [L] -> (inputs[start:stop], a title note: '' when that is all of them).

  `window` None: the first `max_window` tokens. A window wider than
  `max_window` is refused (check_window); its stop is cut at L, like a slice.
  """
  length = len(inputs)
  start, stop = window or (0, min(length, max_window))
  check_window((start, stop), max_window)
  if start >= length:
    raise UsageError(f'--window={start}:{stop} starts past the example, which has '
                     f'{length} input tokens (0..{length - 1})')
  stop = min(stop, length)
  note = '' if (start, stop) == (0, length) else f'  input tokens {start}:{stop} of {length}'
  return inputs[start:stop], note


def greedy_decode(config, params, inputs, max_len: int) -> np.ndarray:
  """inputs [m] (no padding) -> decoded [n <= max_len], EOS included."""
  translate = functools.partial(decoding.greedy_translate, models.build(config.model),
                                models.build(config.model, decode=True))
  out = jax.jit(translate, static_argnums=2)(params, inputs[None], max_len)
  return trim(out[0])


def _token(i) -> str:
  return SPECIAL_TOKENS.get(int(i), str(int(i)))


def attention_maps(config, params, inputs, decoded=None, label=None) -> list[AttentionMap]:
  """Teacher-forced weights of every sown attention layer.

  inputs [m], decoded [n] (no padding). Queries of encoder layers are the
  input tokens; other queries are decoder positions, labelled with the token
  each one outputs (decoded[t]). Keys are decoder inputs (BOS, decoded[:-1])
  for decoder self-attention (a 'self_attention' module under 'decoder'),
  otherwise the input tokens. A decoder-only model (config.model.type) reads
  inputs alone (decoded None): queries and keys are its input tokens.
  label: token id -> its label (default: the id, '<pad>', '<s>', '</s>').
  """
  label = label or _token
  model = models.build(config.model, sow_weights=True)
  forward = jax.jit(functools.partial(model.apply, mutable=['intermediates']))
  labels = {'input': [label(t) for t in inputs]}
  if config.model.type == 'decoder_only':
    _, state = forward({'params': params}, inputs[None])
  else:
    decoder_inputs = tokens.shift_right(decoded[None])
    _, state = forward({'params': params}, inputs[None], decoder_inputs)
    labels.update({'output': [label(t) for t in decoded],
                   'decoder input': [label(t) for t in decoder_inputs[0]]})
  maps = []
  # A scanned stack (model.scan_layers) sows [L, ...] under `layers`: split
  # it into layer_0 .. layer_{L-1}, the unrolled paths and weights.
  sown_layers = scan.unstack_layers(state['intermediates'])
  for key, sown in traverse_util.flatten_dict(sown_layers).items():
    if key[-1] != 'attention_weights':
      continue
    modules = key[:-1]
    is_encoder = modules[0] == 'encoder' or config.model.type == 'decoder_only'
    decoder_self = not is_encoder and 'self_attention' in modules
    query_axis = 'input' if is_encoder else 'output'
    key_axis = 'decoder input' if decoder_self else 'input'
    for call, weights in enumerate(sown):  # sow keeps one entry per call
      path = '/'.join(modules) + (f'/call_{call}' if len(sown) > 1 else '')
      maps.append(AttentionMap(path, np.asarray(weights[0], np.float32), labels[query_axis],
                               labels[key_axis], query_axis, key_axis))
  return maps


def plot(maps: list[AttentionMap], out_dir: str, title: str,
         notes: dict[str, str] | None = None) -> list[str]:
  """One PNG per map (module path, '/' -> '.'), one subplot per head;
  `notes` adds a line to the title of the map at that path."""
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for m in maps:
    h, n, k = m.weights.shape
    # An inch for every 8 labelled tokens (7-point labels fit), at most 8
    # inches a head: longer axes keep that size. Heads in rows of at most
    # HEADS_PER_ROW, so that the figure stays legible at a page's width.
    width, height = (min(8.0, max(2.5, 0.125 * min(x, LABELLED_TOKENS))) for x in (k, n))
    columns = min(h, HEADS_PER_ROW)
    rows = -(-h // columns)
    # Figure() without pyplot: the Agg canvas, no global backend state.
    fig = Figure(figsize=(max(5.0, 1.5 + columns * width), 1.0 + rows * (0.8 + height)),
                 layout='constrained')
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[h:]:
      ax.set_axis_off()
    axes = axes[:h]
    for head, ax in enumerate(axes):
      image = ax.imshow(m.weights[head], vmin=0.0, vmax=1.0, cmap='viridis')
      if k <= LABELLED_TOKENS:
        ax.set_xticks(range(k), labels=m.keys, rotation=90, fontsize=7)
      if n <= LABELLED_TOKENS:
        ax.set_yticks(range(n), labels=m.queries, fontsize=7)
      ax.set_title(m.heads[head] if m.heads else f'head {head}', fontsize=9)
      ax.set_xlabel(f'key: {m.key_axis} token' + ('' if k <= LABELLED_TOKENS else ' (index)'))
      if head % columns == 0:
        ax.set_ylabel(f'query: {m.query_axis} token'
                      + ('' if n <= LABELLED_TOKENS else ' (index)'))
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    note = (notes or {}).get(m.path, '')
    fig.suptitle(f'{title}\n{m.path}{note}', fontsize=10)
    path = os.path.join(out_dir, m.path.replace('/', '.') + '.png')
    fig.savefig(path, dpi=100)
    paths.append(path)
  return paths


def plot_run(workdir: str, split: str, example: int, out_dir: str,
             window: tuple[int, int] | None = None, max_window: int = MAX_WINDOW) -> list[str]:
  """Loads `workdir`, decodes `window` of one example (select_window) and
  writes its PNGs; returns their paths."""
  if window is not None:  # fails before the run is loaded
    check_window(window, max_window)
  run = load_run(workdir)
  splits = run.dataset.splits
  if split not in splits:
    raise UsageError(f'--split={split!r} is not a split; valid: {", ".join(splits)}')
  count = len(splits[split]['inputs'])
  if not 0 <= example < count:
    raise UsageError(f'--example={example} is out of range; split {split!r} has '
                     f'{count} examples (0..{count - 1})')
  inputs, window_note = select_window(trim(splits[split]['inputs'][example]), window,
                                      max_window)
  decoded = greedy_decode(run.config, run.params, inputs,
                          min(splits[split]['targets'].shape[1], max_window))
  maps = attention_maps(run.config, run.params, inputs, decoded)
  title = (f'attention={run.config.model.attention}  model={run.config.model.type}\n'
           f'step {run.step}  {split}[{example}]{window_note}')
  notes = {}
  if registry.get(run.config.model.attention).uses_positions:
    # layers/transformer.py: position-aware variants do not cross encoder and decoder.
    notes = {m.path: '  (cross-attention: dot_product)' for m in maps
             if 'cross_attention' in m.path}
  return plot(maps, out_dir, title, notes)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  compilation.set_xla_flags()
  compilation.enable_cache()
  if not FLAGS.workdir:
    _fail('--workdir is required: the workdir of a training run')
  try:
    window = parse_window(FLAGS.window) if FLAGS.window is not None else None
    paths = plot_run(FLAGS.workdir, FLAGS.split, FLAGS.example,
                     FLAGS.out or os.path.join(FLAGS.workdir, 'attention'), window)
  except (UsageError, config_lib.ConfigError) as e:
    _fail(str(e))
  for path in paths:
    print(path)


def _fail(message: str):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  """Parses our FLAGS; absl's global FLAGS (app.run needs them parsed) get
  defaults only."""
  flags.FLAGS(argv[:1])
  try:
    rest = FLAGS(argv)
  except flags.Error as e:
    _fail(f'{e}. Flags: --workdir=DIR [--split=validation] [--example=0] '
          '[--window=START:STOP] [--out=DIR]')
  if len(rest) > 1:
    _fail(f'unexpected arguments {rest[1:]}; flags look like --workdir=DIR')
  return rest


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
