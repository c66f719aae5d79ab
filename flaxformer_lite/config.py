"""The base experiment config, ConfigError, config.json I/O, and the import of
the user's modules a config names (model.import_modules).

Experiment files start from `base_config()` and set values. Each rule on the
values lives with the module that owns it (models.validate, data.validate,
train/validation.py); main.validate runs them all once, before anything is
compiled. This module imports only the attention registry and masks, for the
options. Every option of every attention variant is declared under
`model.attention_kwargs` as an unset placeholder (every registered mask's
under `model.mask_kwargs`), so `--config.model.attention_kwargs.X=...` works
from any experiment file; options that the chosen variant does not take are
errors.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import sys
from typing import Any

import ml_collections
from ml_collections import config_dict

from flaxformer_lite.attention import masks, registry

# Keys that may change between a run and its resumption.
RESUMABLE_CHANGES = ('train.num_steps', 'train.log_every', 'train.eval_every',
                     'train.checkpoint_every', 'train.keep_checkpoints',
                     'eval.num_examples_to_log', 'eval.final_test', 'train.skip_nonfinite',
                     'eval.batch_size', 'eval.beam_size', 'eval.beam_alpha',
                     'eval.sequence_accuracy',
                     'eval.max_decode_len', 'eval.max_examples', 'data.manual_dir',
                     'train.profile_steps', 'model.remat', 'model.scan_layers',
                     'eval.batch_tokens',
                     'eval.contexts', 'eval.sample_prompt', 'eval.sample_len',
                     # the update does not depend on them: a run may move to another device count
                     'train.parallel', 'train.grad_accum_steps', 'train.model_parallel')


class ConfigError(ValueError):
  """A bad config value; main.py turns it into exit code 2."""


def attention_kwargs_placeholders() -> ml_collections.ConfigDict:
  """Every option of every registered variant, unset, typed by its default."""
  return ml_collections.ConfigDict(
      {k: config_dict.placeholder(type(v)) for k, v in registry.all_kwargs().items()})


def mask_kwargs_placeholders() -> ml_collections.ConfigDict:
  """Every option of every registered mask (masks.NAMED), unset."""
  fields = [f for named in masks.NAMED.values() if named.options
            for f in dataclasses.fields(named.options)]
  return ml_collections.ConfigDict({f.name: config_dict.placeholder(type(f.default))
                                    for f in fields})


def import_modules(names: str) -> None:
  """Imports each module of `names` (model.import_modules: comma-separated
  module names): the registrations they run add the user's attention
  variants (and their options, when imported before base_config()). Raises
  ConfigError naming a module that is not found or fails to import."""
  for name in filter(None, (n.strip() for n in names.split(','))):
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name is None or not (name + '.').startswith(e.name + '.'):
        raise ConfigError(f'model.import_modules: importing {name!r} failed: {e}') from None
      raise ConfigError(
          f'model.import_modules: no module {name!r} on the path; valid: names importable '
          f'from the checkout or PYTHONPATH ({", ".join(p or "." for p in sys.path[:3])}, '
          '...), comma-separated, such as my_variants for my_variants.py') from None
    except Exception as e:  # the user's module raised: say where, in one line
      raise ConfigError(f'model.import_modules: importing {name!r} failed: '
                        f'{type(e).__name__}: {e}') from None


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = m = ml_collections.ConfigDict()
  m.type = 'encoder_decoder'  # model_types.MODEL_TYPES
  # A pretrained checkpoint to start from (flaxformer_lite/pretrained.py), a path
  # or a name ('minilm', 'smollm2': fetched into the user cache once): its
  # architecture replaces this section's (pretrained.ARCHITECTURE), its weights
  # the initial ones; the attention variant and its options stay this config's.
  m.init_from = ''
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
  # The user's own modules, comma-separated names importable from the checkout
  # or PYTHONPATH ('my_variants'), imported before model.attention is looked
  # up, so that the variants they register can be named here (import_modules).
  m.import_modules = ''
  m.attention_kwargs = attention_kwargs_placeholders()
  # A registered mask in place of the model's causal rule (masks.NAMED;
  # decoder_only): 'prefix_lm' lets the first mask_kwargs.prefix_len tokens
  # of a row see each other. 'none': the model's own.
  m.mask = 'none'
  m.mask_kwargs = mask_kwargs_placeholders()
  m.positions = 'sinusoidal'  # sinusoidal | learned | none
  m.max_len = 256  # longest sequence (learned positions, decoding)
  # Randomized positions (Ruoss et al. 2023): > 0 = L; in training each batch's
  # positions are a sorted random draw of n from 0..L-1 (shared by its rows),
  # in evaluation and decoding 0..n-1. Absolute positions and every variant of
  # registry.position_array_names() read them. 0: off.
  m.randomized_positions = 0
  m.pre_ln = True  # False: post-LN as in the 2017 paper
  # The MLP: relu | gelu (tanh approximation) | gelu_exact (erf; BERT) | the
  # gated swiglu (Llama) | geglu: act(x W_gate) * (x W_up), then W_down.
  m.activation = 'relu'
  m.norm = 'layernorm'  # layernorm | rmsnorm (Llama)
  m.norm_eps = 1e-6
  m.use_bias = True  # biases on the attention and MLP projections (Llama: False)
  m.tie_embeddings = True  # logits from the token table (False: a matrix of their own)
  m.embed_scale = 0.0  # token embeddings times this; 0: sqrt(d_model), or 1 with init='gpt2'
  m.token_types = 0  # > 0: BERT's token-type embeddings (every token of type 0)
  m.embed_norm = False  # True: a norm over the summed embeddings, before the first block (BERT)
  m.dtype = 'float32'  # compute: float32 | bfloat16 | auto (bf16 on GPU/TPU); params stay f32
  # Transformer initialisation: 'default' (flax's, embeddings scaled by sqrt(d))
  # | 'gpt2' (N(0, 0.02), residual outputs / sqrt(2L), unscaled embeddings).
  m.init = 'default'
  # Rematerialisation of each Transformer block in training (layers/transformer.py
  # REMAT): none | block (recompute all but the block's input) | dots_saveable.
  m.remat = 'none'
  # Each Transformer stack as one block under nn.scan (layers/transformer.py):
  # compile time stops growing with depth; parameters are stacked [L, ...]
  # under 'layers' (layers/scan.py converts checkpoints between the layouts).
  m.scan_layers = False
  # model.type=rnn_seq2seq (layers/rnn.py): the cell, and Luong's input feeding
  # (the previous attentional state joins the next decoder input).
  m.rnn_cell = 'lstm'  # lstm | gru
  m.rnn_input_feeding = True
  # model.type=two_stream (layers/fusion.py): each stream its own embeddings
  # and layers until fusion_layer; from there 'early'/'late' run one joint
  # sequence (early: from layer 0), 'bottleneck' exchanges only through
  # fusion_bottlenecks shared tokens (Nagrani et al. 2021). fusion_layer =
  # num_encoder_layers: the streams meet in the classifier only.
  m.fusion = 'bottleneck'  # early | late | bottleneck
  m.fusion_layer = 0
  m.fusion_bottlenecks = 4
  m.num_classes = 0  # two_stream's classifier; 0: the dataset's

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
  # data.TASKS: generated (reverse, copy, sort; the algorithmic tasks of data/algorithmic.py:
  # parity_check, reverse_string, mqar, ...), multi30k, tiny_shakespeare, tfds
  d.task = 'reverse'
  d.tfds_name = ''  # task=tfds: a TFDS catalog name, e.g. wmt14_translate/de-en, lm1b
  d.manual_dir = ''  # raw files of a real corpus; '': the shared corpora (data/shared.py), else downloaded
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
  # Real text: sentencepiece | char | byte | pretrained (model.init_from's own)
  d.tokenizer = 'sentencepiece'
  d.vocab_size = 8000  # sentencepiece: joint source+target vocabulary
  d.spm_model_type = 'unigram'  # unigram | bpe
  d.mlm_rate = 0.15  # model.type=encoder_only: fraction of tokens masked (BERT)
  d.num_symbols = 16  # synthetic tasks ...
  d.num_claims = 8  # two-stream tasks: the claims of stream B (data/two_stream.py)
  d.min_len = 1
  # Generated tasks: the lengths of split test_long, num_eval examples spread
  # evenly over them, its exact-match accuracy also reported per length
  # (long_sequence_accuracy_len<L>); () = uniform in max_len+1..2*max_len.
  d.test_lengths = ()
  d.num_train = 50_000
  d.num_eval = 1_000
  d.seed = 0

  c.eval = e = ml_collections.ConfigDict()
  e.batch_size = 250
  # > 0: each eval batch holds about this many tokens instead of batch_size
  # examples: max(1, batch_tokens // width) rows, width = the LM window (each
  # context of eval.contexts) or a seq2seq split's padded width.
  e.batch_tokens = 0
  # Language models: window lengths at which the validation (and test) split is
  # also scored, as non-overlapping windows; data.max_len always is. Context c's
  # metrics get the suffix _c ('loss_16384'; not '@': TensorBoard tags cannot hold it).
  e.contexts = ()
  # Language models: the logged greedy sample continues the split's first
  # sample_prompt tokens (all of it if shorter) by sample_len tokens (0:
  # data.max_len // 2 and the rest of data.max_len); WORKDIR/sample.txt holds
  # the newest continuation's text (the final evaluation's at the end).
  e.sample_prompt = 0
  e.sample_len = 0
  e.num_examples_to_log = 3
  # Also evaluate (and sample) before the first step, at step 0: a pretrained
  # model as it came, beside the same metrics after training.
  e.at_start = False
  e.final_test = True  # evaluate 'test' (and 'test_long') after training
  e.max_examples = 0  # > 0: evaluate only the first max_examples of each split (quick looks)
  e.beam_size = 1  # the final test's decoding: 1 = greedy (periodic evals are greedy)
  e.beam_alpha = 0.6  # GNMT length penalty
  e.max_decode_len = 0  # 0: target width (token tasks), 1.5 x source + 10 (text)
  # Token tasks' sequence_accuracy: 'decoded' (greedy or beam, then compared)
  # | 'teacher_forced' (every target token the argmax given the true prefix:
  # greedy decoding's exact match, in one parallel pass instead of one step a token).
  e.sequence_accuracy = 'decoded'
  return c


def check(ok: bool, message: str):
  """Raises ConfigError(message) unless ok: the validators' one-liner."""
  if not ok:
    raise ConfigError(message)


def check_choice(name: str, value: Any, valid):
  check(value in valid, f'{name}={value!r} is not valid; valid: {", ".join(map(str, valid))}')


def parent_of(config, path: str):
  """(the ConfigDict holding `path`'s last part, that part): 'model.d_model'
  -> (config.model, 'd_model'). The path must exist (unknown_key_message)."""
  *parents, leaf = path.split('.')
  node = config
  for parent in parents:
    node = node[parent]
  return node, leaf


# Keys that were renamed: the old one is refused naming the new (and, where
# its values changed too, how).
RENAMED = {'model.attention_kwargs.implementation': ('model.attention_kwargs.kernel', ''),
           'model.attention_kwargs.form': (
               'model.attention_kwargs.kernel', " (Shaw's forms are kernels: 'banded' is "
               "'shaw_banded', 'naive' and 'matmul' are 'dense')")}


def unknown_key_message(config, path: str) -> str | None:
  """None when `path` ('model.d_model') names a key of `config`; else the
  message naming the first part that does not exist, the nearest valid key
  and the valid keys beside it."""
  for old, (new, note) in RENAMED.items():
    if path == old or path.startswith(old + '.'):
      return (f'config key {old!r} is {new!r} now{note}: did you mean '
              f'{path.replace(old, new, 1)!r}?')
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
