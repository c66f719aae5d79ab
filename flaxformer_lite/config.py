"""The base experiment config, its validation, and config.json I/O.

Experiment files start from `base_config()` and set values. Every option of
every attention variant is declared under `model.attention_kwargs` as an
unset placeholder, so `--config.model.attention_kwargs.X=...` works from any
experiment file; options that the chosen variant does not take are errors.
"""
from __future__ import annotations

import difflib
import json
from typing import Any

import jax
import ml_collections
from ml_collections import config_dict

from flaxformer_lite import data, model_types, models
from flaxformer_lite.data import corpora, tokenizers
from flaxformer_lite.attention import registry
from flaxformer_lite.layers import embeddings, rnn, transformer
from flaxformer_lite.train import profiling, schedules

PARALLEL_MODES = ('jit', 'pmap', 'fsdp')  # train/partitioning.py
# Keys that may change between a run and its resumption.
RESUMABLE_CHANGES = ('train.num_steps', 'train.log_every', 'train.eval_every',
                     'train.checkpoint_every', 'train.keep_checkpoints',
                     'eval.num_examples_to_log', 'eval.final_test', 'train.skip_nonfinite',
                     'eval.batch_size', 'eval.beam_size', 'eval.beam_alpha',
                     'eval.max_decode_len', 'eval.max_examples', 'data.manual_dir',
                     'train.profile_steps', 'model.remat',
                     # the update does not depend on them: a run may move to another device count
                     'train.parallel', 'train.grad_accum_steps', 'train.model_parallel')


class ConfigError(ValueError):
  """A bad config value; main.py turns it into exit code 2."""


def attention_kwargs_placeholders() -> ml_collections.ConfigDict:
  """Every option of every registered variant, unset, typed by its default."""
  return ml_collections.ConfigDict(
      {k: config_dict.placeholder(type(v)) for k, v in registry.all_kwargs().items()})


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = m = ml_collections.ConfigDict()
  m.type = 'encoder_decoder'  # model_types.MODEL_TYPES
  m.vocab_size = 0  # 0: taken from the dataset
  m.d_model = 128
  m.num_heads = 4
  # Key/value heads: 0 = num_heads; 1 = multi-query; a divisor of num_heads in
  # between = grouped-query attention (every variant; layers/attention.py).
  m.num_kv_heads = 0
  m.num_encoder_layers = 2
  m.num_decoder_layers = 2
  m.mlp_dim = 512
  m.dropout_rate = 0.1
  m.attention_dropout_rate = 0.0
  m.attention = 'dot_product'  # any name from --list_attention
  m.attention_kwargs = attention_kwargs_placeholders()
  m.positions = 'sinusoidal'  # sinusoidal | learned | none
  m.max_len = 256  # longest sequence (learned positions, decoding)
  m.pre_ln = True  # False: post-LN as in the 2017 paper
  m.activation = 'relu'  # relu | gelu
  m.dtype = 'float32'  # float32 | bfloat16 (compute; params stay float32)
  # Transformer initialisation: 'default' (flax's, embeddings scaled by sqrt(d))
  # | 'gpt2' (N(0, 0.02), residual outputs / sqrt(2L), unscaled embeddings).
  m.init = 'default'
  # Rematerialisation of each Transformer block in training (layers/transformer.py
  # REMAT): none | block (recompute all but the block's input) | dots_saveable.
  m.remat = 'none'
  # model.type=rnn_seq2seq (layers/rnn.py): the cell, and Luong's input feeding
  # (the previous attentional state joins the next decoder input).
  m.rnn_cell = 'lstm'  # lstm | gru
  m.rnn_input_feeding = True

  c.train = t = ml_collections.ConfigDict()
  t.num_steps = 2000
  t.batch_size = 64  # global: across all devices and hosts
  # > 0: seq2seq batches of rows of similar length, about this many tokens
  # (padding included) per batch instead of batch_size rows (data/pipeline.py).
  t.batch_tokens = 0
  # Gradient accumulation: the global batch is split into this many
  # microbatches, one forward/backward each, one update (same result).
  t.grad_accum_steps = 1
  t.schedule = 'rsqrt'  # schedules.SCHEDULES
  # 'rsqrt': factor on the paper's d^-0.5 * min(s^-0.5, s * warmup^-1.5);
  # the other schedules: the peak learning rate.
  t.learning_rate = 1.0
  t.warmup_steps = 400
  t.label_smoothing = 0.1
  t.adam_b1 = 0.9
  t.adam_b2 = 0.98
  t.adam_eps = 1e-9
  t.final_learning_rate = 0.0  # where warmup_cosine / warmup_linear end
  t.weight_decay = 0.0  # AdamW's, on matrices and embeddings
  t.grad_clip = 0.0  # global-norm clipping; 0 = off
  t.skip_nonfinite = False  # True: a step with a NaN/inf loss or gradient leaves the state as it was
  t.log_every = 100
  t.eval_every = 500
  t.checkpoint_every = 500
  t.keep_checkpoints = 3
  t.parallel = 'jit'  # jit (data parallel) | fsdp (+ sharded state) | pmap; train/partitioning.py
  # Devices on the mesh's 'model' axis (heads and MLP units sharded over them,
  # train/partitioning.py); the rest form the 'data' axis. 1 = data parallel only.
  t.model_parallel = 1
  # 'START:STOP': a jax.profiler trace of steps START..STOP-1 (0-based) under
  # WORKDIR/plugins/profile, for TensorBoard's Profile tab; '' = off (train/profiling.py).
  t.profile_steps = ''

  c.data = d = ml_collections.ConfigDict()
  d.task = 'reverse'  # data.TASKS: synthetic (reverse, copy, sort), multi30k, tiny_shakespeare, tfds
  d.tfds_name = ''  # task=tfds: a TFDS catalog name, e.g. wmt14_translate/de-en, lm1b
  d.manual_dir = ''  # raw files of a real corpus; '' = download from the public location
  d.data_dir = ''  # TFDS data dir; '' = $TFDS_DATA_DIR or ~/tensorflow_datasets
  # Synthetic tasks: lengths min_len..max_len (+ EOS). Translation: training
  # pairs longer than max_len tokens (+ EOS) are dropped or truncated
  # (overlong). Language models: the context length.
  d.max_len = 16
  d.overlong = 'drop'  # drop | truncate (always counted and logged)
  # Sequence-to-sequence training: several examples per row, each attending
  # within itself (data/pipeline.py PackedBatches), instead of one padded
  # example per row. Evaluation stays one example per row.
  d.pack = False
  d.source_lang = 'en'  # translation: the features of the pair
  d.target_lang = 'de'
  d.tokenizer = 'sentencepiece'  # real text: sentencepiece | char | byte
  d.vocab_size = 8000  # sentencepiece: joint source+target vocabulary
  d.spm_model_type = 'unigram'  # unigram | bpe
  d.mlm_rate = 0.15  # model.type=encoder_only: fraction of tokens masked (BERT)
  d.num_symbols = 16  # synthetic tasks ...
  d.min_len = 1
  d.num_train = 50_000
  d.num_eval = 1_000
  d.seed = 0

  c.eval = e = ml_collections.ConfigDict()
  e.batch_size = 250
  e.num_examples_to_log = 3
  e.final_test = True  # evaluate 'test' (and 'test_long') after training
  e.max_examples = 0  # > 0: evaluate only the first max_examples of each split (quick looks)
  e.beam_size = 1  # the final test's decoding: 1 = greedy (periodic evals are greedy)
  e.beam_alpha = 0.6  # GNMT length penalty
  e.max_decode_len = 0  # 0: target width (token tasks), 1.5 x source + 10 (text)
  return c


def _check(ok: bool, message: str):
  if not ok:
    raise ConfigError(message)


def _choice(name: str, value: Any, valid):
  _check(value in valid, f'{name}={value!r} is not valid; valid: {", ".join(map(str, valid))}')


def unknown_key_message(config, path: str) -> str | None:
  """None when `path` ('model.d_model') names a key of `config`; else the
  message naming the first part that does not exist, the nearest valid key
  and the valid keys beside it."""
  node, walked = config, []
  for key in path.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or key not in node:
      valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      near = difflib.get_close_matches(key, valid, n=1)
      where = '.'.join(walked) or 'the config'
      hint = f' Did you mean {".".join(walked + near)!r}?' if near else ''
      return (f'unknown config key {path!r} (no {key!r} in {where}).{hint} '
              f'Valid keys in {where}: {", ".join(valid)}')
    node = node[key]
    walked.append(key)
  return None


def check_keys(config) -> None:
  """Every key of `config` is one that base_config() declares: a typo in an
  experiment file (`config.model.d_modle = 256`) would otherwise add a key
  and train the default. Raises ConfigError (unknown_key_message)."""
  base = base_config()
  for key in sorted(flatten(config)):
    message = unknown_key_message(base, key)
    if message:
      raise ConfigError(message)


def validate(config) -> None:
  """Raises ConfigError naming the bad value and what is valid. No compilation.
  Batch sizes need no arithmetic for the device count: a batch that does not
  split over the devices is padded with weight-0 rows (train/loop.py)."""
  check_keys(config)
  m, t, d = config.model, config.train, config.data
  _choice('model.type', m.type, tuple(model_types.MODEL_TYPES))
  _choice('model.attention', m.attention, registry.names())
  variant = registry.get(m.attention)
  _check(m.type in variant.models,
         f'model.attention={m.attention!r} cannot be used in model.type={m.type!r}; '
         f'it works in: {", ".join(variant.models)}')
  try:
    registry.resolve_kwargs(m.attention, m.attention_kwargs)
  except ValueError as e:
    raise ConfigError(f'model.{e}') from None
  for key in ('d_model', 'num_heads', 'mlp_dim', 'max_len'):
    _check(m[key] > 0, f'model.{key}={m[key]} must be > 0')
  for key in ('num_encoder_layers', 'num_decoder_layers'):
    _check(m[key] >= 0, f'model.{key}={m[key]} must be >= 0')
  _check(m.d_model % m.num_heads == 0,
         f'model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}; '
         f'valid num_heads: {[h for h in range(1, m.d_model + 1) if m.d_model % h == 0]}')
  kv_valid = [g for g in range(1, m.num_heads + 1) if m.num_heads % g == 0]
  _check(m.num_kv_heads == 0 or m.num_kv_heads in kv_valid,
         f'model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}; '
         f'valid: 0 (= num_heads) or {kv_valid}')
  _check(m.attention != 'rotary' or (m.d_model // m.num_heads) % 2 == 0,
         f'attention=rotary rotates pairs of features: the head size '
         f'model.d_model/model.num_heads={m.d_model // m.num_heads} must be even')
  _choice('model.positions', m.positions, embeddings.POSITIONS)
  _check(m.positions != 'sinusoidal' or m.d_model % 2 == 0,
         f'sinusoidal positions need an even model.d_model, got {m.d_model}')
  _choice('model.activation', m.activation, tuple(transformer.ACTIVATIONS))
  _choice('model.init', m.init, transformer.INITS)
  _choice('model.remat', m.remat, tuple(transformer.REMAT))
  _check(m.remat == 'none' or m.type != 'rnn_seq2seq',
         f'model.remat={m.remat!r} rematerialises Transformer blocks; model.type=rnn_seq2seq '
         f"has none (use model.remat='none')")
  _choice('model.dtype', m.dtype, tuple(models.DTYPES))
  for key in ('dropout_rate', 'attention_dropout_rate'):
    _check(0.0 <= m[key] < 1.0, f'model.{key}={m[key]} must be in [0, 1)')
  implementation, _ = registry.resolve_kernel(m.attention, m.attention_kwargs)
  _check(implementation != 'chunked' or m.attention_dropout_rate == 0.0,
         f"model.attention_kwargs.implementation='chunked' has no attention dropout, and "
         f'model.attention_dropout_rate={m.attention_dropout_rate}; set it to 0, or use '
         f"implementation='auto' (dense while attention dropout is on) or 'dense'")
  _choice('model.rnn_cell', m.rnn_cell, tuple(rnn.CELLS))
  if m.type == 'rnn_seq2seq':
    _check(m.d_model % 2 == 0,
           f'model.type=rnn_seq2seq splits model.d_model={m.d_model} over the two '
           f'directions of its bidirectional encoder; use an even d_model')
    for key in ('num_encoder_layers', 'num_decoder_layers'):
      _check(m[key] >= 1, f'model.{key}={m[key]} must be >= 1 for model.type=rnn_seq2seq')

  _check(t.num_steps > 0, f'train.num_steps={t.num_steps} must be > 0')
  _check(t.batch_size > 0, f'train.batch_size={t.batch_size} must be > 0')
  _choice('train.schedule', t.schedule, schedules.SCHEDULES)
  _check(t.learning_rate > 0, f'train.learning_rate={t.learning_rate} must be > 0')
  _check(t.warmup_steps > 0 or t.schedule == 'constant',
         f'train.warmup_steps={t.warmup_steps} must be > 0 for schedule {t.schedule!r}')
  _check(0.0 <= t.label_smoothing < 1.0,
         f'train.label_smoothing={t.label_smoothing} must be in [0, 1)')
  for key in ('log_every', 'eval_every', 'checkpoint_every', 'keep_checkpoints'):
    _check(t[key] > 0, f'train.{key}={t[key]} must be > 0')
  _choice('train.parallel', t.parallel, PARALLEL_MODES)
  devices = jax.device_count()
  _check(t.model_parallel >= 1 and devices % t.model_parallel == 0
         and (t.parallel != 'pmap' or t.model_parallel == 1),
         f'train.model_parallel={t.model_parallel} on {devices} device(s); valid: '
         + ('1 (train.parallel=pmap has no model axis)' if t.parallel == 'pmap' else
            str([m for m in range(1, devices + 1) if devices % m == 0])))
  try:
    profiling.parse(t.profile_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _check(t.grad_accum_steps >= 1, f'train.grad_accum_steps={t.grad_accum_steps} must be >= 1')
  hosts = jax.process_count()  # each process reads batch_size / hosts rows
  _check(t.batch_size % hosts == 0,
         f'train.batch_size={t.batch_size} is global and must be divisible by the {hosts} '
         f'processes (hosts); e.g. {hosts * max(1, t.batch_size // hosts)}')

  _choice('data.task', d.task, data.TASKS)
  _check(d.max_len >= 1, f'data.max_len={d.max_len} must be >= 1')
  if d.pack:
    _check(m.type == 'encoder_decoder',
           f'data.pack=True packs translation pairs for model.type=encoder_decoder; '
           f'model.type={m.type!r} ' + ('reads a row with a recurrent encoder, across its examples'
                                        if m.type == 'rnn_seq2seq' else
                                        'trains on one token stream, which has no padding'))
    _check(m.attention not in PACK_REFUSED,
           f'data.pack=True with model.attention={m.attention!r}: ' + PACK_REFUSED.get(
               m.attention, '') + '; valid: every other variant')
  kind = task_kind(d)
  objective = OBJECTIVE_KIND[m.type]
  _check(kind is None or kind == objective,
         f'model.type={m.type!r} trains on {objective} data but data.task={d.task!r} is '
         f'{kind} data; use model.type in '
         f'{[k for k, v in OBJECTIVE_KIND.items() if v == kind]} for it')
  if d.task in data.REAL_TASKS:
    _check(d.task != 'tfds' or bool(d.tfds_name),
           'data.task=tfds needs data.tfds_name, e.g. wmt14_translate/de-en or lm1b')
    _choice('data.tokenizer', d.tokenizer, tokenizers.TOKENIZERS)
    _choice('data.spm_model_type', d.spm_model_type, ('unigram', 'bpe'))
    _check(d.vocab_size >= 16, f'data.vocab_size={d.vocab_size} must be >= 16')
    _choice('data.overlong', d.overlong, data.OVERLONG)
    if d.manual_dir and d.task in data.BUILDER_NAMES:
      try:
        corpora.check_manual_dir(data.BUILDER_NAMES[d.task], d.manual_dir)
      except data.DataError as e:
        raise ConfigError(f'data.manual_dir: {e}') from None
  _check(0.0 < d.mlm_rate < 1.0, f'data.mlm_rate={d.mlm_rate} must be in (0, 1)')
  _check(t.batch_tokens >= 0, f'train.batch_tokens={t.batch_tokens} must be >= 0')
  if d.task in data.REAL_TASKS and kind != 'lm':
    _check(m.positions != 'learned' or m.max_len >= d.max_len + 1,
           f'model.max_len={m.max_len} is shorter than data.max_len + EOS ({d.max_len + 1})')
  if kind == 'lm':
    _check(m.positions != 'learned' or m.max_len >= d.max_len,
           f'model.max_len={m.max_len} is shorter than the context data.max_len={d.max_len}')
  if d.task in data.TASKS and d.task not in data.REAL_TASKS:  # synthetic
    _check(1 <= d.min_len <= d.max_len,
           f'data.min_len={d.min_len} and data.max_len={d.max_len} need 1 <= min_len <= max_len')
    _check(d.num_symbols >= 1, f'data.num_symbols={d.num_symbols} must be >= 1')
    _check(d.num_train >= t.batch_size,
           f'data.num_train={d.num_train} is smaller than train.batch_size={t.batch_size}')
    longest = 2 * d.max_len + 1  # the test_long split, EOS included
    _check(m.positions != 'learned' or m.max_len >= longest,
           f'model.max_len={m.max_len} is shorter than the longest sequence ({longest}, '
           f'data.max_len={d.max_len} doubled for test_long, + EOS); set model.max_len >= {longest}')
  e = config.eval
  _check(e.batch_size > 0, f'eval.batch_size={e.batch_size} must be > 0')
  _check(e.max_examples >= 0, f'eval.max_examples={e.max_examples} must be >= 0 (0 = all)')
  _check(e.beam_size >= 1, f'eval.beam_size={e.beam_size} must be >= 1 (1 = greedy)')
  _check(e.max_decode_len >= 0, f'eval.max_decode_len={e.max_decode_len} must be >= 0')


# Variants whose output for one example depends on the whole row, not its segment.
PACK_REFUSED = {
    'luong_local_p': 'its predicted position p_i = S sigmoid(.) spans the whole row '
                     '(S = the row length), not the example',
    'luong_local_m': 'its window centre p_i (the query index, clipped to the number of '
                     'keys it sees) is a place in the row, not in the example'}

# The data each model type trains on.
OBJECTIVE_KIND = {name: t.data for name, t in model_types.MODEL_TYPES.items()}


def task_kind(data_config) -> str | None:
  """'seq2seq' | 'lm' for a task, None when only the data can tell (tfds)."""
  task = data_config.task
  if task == 'tiny_shakespeare':
    return 'lm'
  if task == 'tfds':
    return None
  return 'seq2seq'


def check_dataset(config, kind: str):
  """After loading: the model type fits the data (tfds catalog names)."""
  objective = OBJECTIVE_KIND[config.model.type]
  _check(kind == objective,
         f'model.type={config.model.type!r} trains on {objective} data but '
         f'data.tfds_name={config.data.tfds_name!r} is {kind} data')


def to_json(config) -> str:
  return config.to_json(indent=2, sort_keys=True)


def _tuples(x):
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x


def from_json(text: str) -> ml_collections.ConfigDict:
  """config.json -> ConfigDict; JSON lists come back as tuples."""
  return ml_collections.ConfigDict(_tuples(json.loads(text)))


def flatten(x, prefix='') -> dict[str, Any]:
  """Nested dict/ConfigDict -> {'a.b.c': value}."""
  out = {}
  for k, v in (x.items() if hasattr(x, 'items') else ()):
    key = f'{prefix}{k}'
    if hasattr(v, 'items'):
      out.update(flatten(v, key + '.'))
    else:
      out[key] = v
  return out


def differences(saved, new) -> list[str]:
  """'key: saved -> new' for keys that matter for resuming (see RESUMABLE_CHANGES).

  A key that a saved config lacks (written before the key existed) counts as
  its base_config() default, which is what that run used.
  """
  a, b = flatten(saved), flatten(new)
  defaults = flatten(base_config())
  out = []
  for k in sorted(set(a) | set(b)):
    if k in RESUMABLE_CHANGES:
      continue
    va, vb = a.get(k, defaults.get(k, '<missing>')), b.get(k, '<missing>')
    if _tuples(va) != _tuples(vb):
      out.append(f'{k}: {va!r} -> {vb!r}')
  return out
