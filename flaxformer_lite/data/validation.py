"""config.data's rules, and what the data asks of the model (its type, its
positions' reach, packing), checked before anything is loaded or built."""
from __future__ import annotations

from flaxformer_lite.config import ConfigError, check, check_choice
from flaxformer_lite.data import algorithmic, corpora, synthetic, tokenizers, two_stream
from flaxformer_lite.data.corpora import DataError
from flaxformer_lite.data.loading import BUILDER_NAMES, OVERLONG, REAL_TASKS, TASKS
from flaxformer_lite.model_types import MODEL_TYPES

# Variants whose output for one example depends on the whole row, not its segment.
PACK_REFUSED = {
    'luong_local_p': 'its predicted position p_i = S sigmoid(.) spans the whole row '
                     '(S = the row length), not the example',
    'luong_local_m': 'its window centre p_i (the query index, clipped to the number of '
                     'keys it sees) is a place in the row, not in the example',
    'fire': "its normaliser psi(max(L, i)) reads the query's position i in the row, not in "
            'the example (the kernels take positions as the row\'s offsets)'}

# The data each model type trains on.
OBJECTIVE_KIND = {name: t.data for name, t in MODEL_TYPES.items()}


def task_kind(data_config) -> str | None:
  """'seq2seq' | 'lm' | 'two_stream' for a task, None when only the data can
  tell (tfds)."""
  task = data_config.task
  if task == 'tiny_shakespeare':
    return 'lm'
  if task in two_stream.TASKS:
    return 'two_stream'
  if task == 'tfds':
    return None
  return 'seq2seq'


def check_dataset(config, kind: str):
  """After loading: the model type fits the data (tfds catalog names)."""
  objective = OBJECTIVE_KIND[config.model.type]
  check(kind == objective,
        f'model.type={config.model.type!r} trains on {objective} data but '
        f'data.tfds_name={config.data.tfds_name!r} is {kind} data')


def validate(config) -> None:
  """Raises ConfigError naming the bad value and what would be valid."""
  m, t, d = config.model, config.train, config.data
  check_choice('data.task', d.task, TASKS)
  check(d.max_len >= 1, f'data.max_len={d.max_len} must be >= 1')
  if d.pack:
    check(m.type == 'encoder_decoder',
          f'data.pack=True packs translation pairs for model.type=encoder_decoder; '
          f'model.type={m.type!r} ' + ('reads a row with a recurrent encoder, across its examples'
                                       if m.type == 'rnn_seq2seq' else
                                       'trains on one token stream, which has no padding'))
    check(m.attention not in PACK_REFUSED,
          f'data.pack=True with model.attention={m.attention!r}: ' + PACK_REFUSED.get(
              m.attention, '') + '; valid: every other variant')
    check(not m.get('randomized_positions', 0),
          'data.pack=True with model.randomized_positions: a packed row gives each example '
          'its own positions from 0; use one or the other')
  kind = task_kind(d)
  objective = OBJECTIVE_KIND[m.type]
  check(kind is None or kind == objective,
        f'model.type={m.type!r} trains on {objective} data but data.task={d.task!r} is '
        f'{kind} data; use model.type in '
        f'{[k for k, v in OBJECTIVE_KIND.items() if v == kind]} for it')
  if d.task in REAL_TASKS:
    check(d.task != 'tfds' or bool(d.tfds_name),
          'data.task=tfds needs data.tfds_name, e.g. wmt14_translate/de-en or lm1b')
    check_choice('data.tokenizer', d.tokenizer, tokenizers.TOKENIZERS)
    check(d.tokenizer != 'pretrained' or bool(m.get('init_from')),
          "data.tokenizer='pretrained' is the tokenizer of model.init_from's checkpoint; set "
          'model.init_from')
    check_choice('data.spm_model_type', d.spm_model_type, ('unigram', 'bpe'))
    check(d.vocab_size >= 16, f'data.vocab_size={d.vocab_size} must be >= 16')
    check_choice('data.overlong', d.overlong, OVERLONG)
    if d.manual_dir and d.task in BUILDER_NAMES:
      try:
        corpora.check_manual_dir(BUILDER_NAMES[d.task], d.manual_dir)
      except DataError as e:
        raise ConfigError(f'data.manual_dir: {e}') from None
  check(0.0 < d.mlm_rate < 1.0, f'data.mlm_rate={d.mlm_rate} must be in (0, 1)')
  if d.task in REAL_TASKS and kind != 'lm':
    check(m.positions != 'learned' or m.max_len >= d.max_len + 1,
          f'model.max_len={m.max_len} is shorter than data.max_len + EOS ({d.max_len + 1})')
  if kind == 'lm':
    check(m.positions != 'learned' or m.max_len >= d.max_len,
          f'model.max_len={m.max_len} is shorter than the context data.max_len={d.max_len}')
  generated = d.task in TASKS and d.task not in REAL_TASKS  # one or two streams
  if generated:
    check(d.num_train >= t.batch_size,
          f'data.num_train={d.num_train} is smaller than train.batch_size={t.batch_size}')
  if kind == 'two_stream':
    _validate_two_stream(config)
  elif generated:
    check(1 <= d.min_len <= d.max_len,
          f'data.min_len={d.min_len} and data.max_len={d.max_len} need 1 <= min_len <= max_len')
    check(d.num_symbols >= 1, f'data.num_symbols={d.num_symbols} must be >= 1')
    test_lengths = tuple(d.get('test_lengths', ()))
    check(all(isinstance(n, int) and n >= 1 for n in test_lengths),
          f'data.test_lengths={test_lengths} must be lengths >= 1, e.g. (50, 100, 200)')
    check(d.num_eval >= len(test_lengths),
          f'data.num_eval={d.num_eval} is fewer than one example per data.test_lengths '
          f'({len(test_lengths)} lengths)')
    reach = algorithmic.TASKS[d.task].max_length if d.task in algorithmic.TASKS else None
    check(reach is None or max((d.max_len, *test_lengths)) <= reach,
          f'data.task={d.task!r} has lengths up to {reach}; data.max_len={d.max_len} and '
          f'data.test_lengths={test_lengths} go beyond')
    longest = synthetic.longest(d)
    check(m.positions != 'learned' or m.max_len >= longest,
          f'model.max_len={m.max_len} is shorter than the longest sequence ({longest} tokens '
          f'of data.task={d.task!r}, split test_long, + EOS); set model.max_len >= {longest}')


def _validate_two_stream(config) -> None:
  """A two-stream task: n = data.max_len symbols of k = data.num_symbols in
  stream A, m = data.num_claims claims in stream B."""
  m, t, d = config.model, config.train, config.data
  check(d.num_symbols >= 2, f'data.num_symbols={d.num_symbols} must be >= 2 for '
        f'data.task={d.task!r}: a false claim names another symbol')
  check(d.max_len >= 2, f'data.max_len={d.max_len} (stream A) must be >= 2 for '
        f'data.task={d.task!r}')
  check(d.num_claims >= 1, f'data.num_claims={d.num_claims} (stream B) must be >= 1')
  check(d.num_eval >= 1, f'data.num_eval={d.num_eval} must be >= 1')
  check(not t.batch_tokens, f'train.batch_tokens={t.batch_tokens} groups rows of similar '
        f'length; data.task={d.task!r} has rows of one length: use train.batch_size '
        '(train.batch_tokens=0)')
  longest = max(d.max_len, d.num_claims)
  check(m.positions != 'learned' or m.max_len >= longest,
        f'model.max_len={m.max_len} is shorter than the longer stream ({longest} tokens); '
        f'set model.max_len >= {longest}')
