"""Config validation (exit 2 paths) and config.json round trips."""
import os
import re
import runpy
import subprocess
import sys

import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import main
from flaxformer_lite.attention import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD = [
    ('model.type', 'rnn', 'encoder_decoder'),
    ('model.attention', 'nope', 'dot_product'),
    ('model.num_heads', 3, 'does not divide'),
    ('model.num_kv_heads', 3, 'valid: 0 (= num_heads) or [1, 2, 4]'),
    ('model.num_kv_heads', -1, 'valid: 0 (= num_heads) or [1, 2, 4]'),
    ('model.positions', 'rotary_abs', 'sinusoidal'),
    ('model.dtype', 'float16', 'bfloat16'),
    ('model.dropout_rate', 1.0, '[0, 1)'),
    ('train.schedule', 'cosine', 'warmup_cosine'),
    ('train.parallel', 'magic', 'jit'),
    ('train.grad_accum_steps', 0, 'must be >= 1'),
    ('train.profile_steps', '10-15', "'10-15' is not 'START:STOP'"),
    ('train.profile_steps', '5:5', 'needs 0 <= START < STOP'),
    ('train.num_steps', 0, 'num_steps'),
    ('data.task', 'unsort', 'reverse'),
    ('data.min_len', 20, 'min_len <= max_len'),
    ('eval.batch_tokens', -1, 'must be >= 0'),
    ('eval.contexts', (64, 0), 'ints >= 1'),
    ('eval.contexts', (64,), 'reads sentence pairs'),  # the base config translates
    ('eval.sample_prompt', -5, 'must be >= 0'),
    ('eval.sample_len', 100, 'has none'),
    ('model.mask', 'prefx_lm', 'valid: none, prefix_lm'),
    ('model.mask', 'prefix_lm', "applies to model.type in ['decoder_only']"),
]


def _refused(c, key, value, expected):
  """c with key=value fails validation with a message naming the key and `expected`."""
  section, name = key.split('.')
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError) as e:
    main.validate(c)
  assert key in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize('key,value,expected', BAD)
def test_validate_names_bad_value_and_valid_ones(key, value, expected):
  _refused(config_lib.base_config(), key, value, expected)


def test_base_config_is_valid():
  main.validate(config_lib.base_config())


def test_learned_positions_need_room_for_long_split():
  c = config_lib.base_config()
  c.model.positions, c.model.max_len, c.data.max_len = 'learned', 32, 16
  with pytest.raises(config_lib.ConfigError, match='model.max_len=32'):
    main.validate(c)


@pytest.mark.parametrize('key,value', [('contexts', (32, 128)), ('sample_prompt', 60),
                                       ('sample_len', 40)])
def test_learned_positions_must_reach_the_eval_contexts_and_the_sample(key, value):
  c = config_lib.base_config()
  c.model.type, c.data.task, c.data.tokenizer = 'decoder_only', 'tiny_shakespeare', 'char'
  c.model.positions, c.model.max_len, c.data.max_len = 'learned', 64, 64
  main.validate(c)  # the default sample: 32 + 32 tokens
  c.eval[key] = value
  with pytest.raises(config_lib.ConfigError, match=f'eval.{key}=.*model.max_len=64'):
    main.validate(c)
  c.model.positions = 'none'  # no positions: any length
  main.validate(c)


def test_a_registered_mask_is_chosen_by_name_with_its_options_checked():
  c = config_lib.base_config()
  c.model.type, c.data.task, c.data.tokenizer = 'decoder_only', 'tiny_shakespeare', 'char'
  c.model.mask = 'prefix_lm'
  main.validate(c)
  c.model.mask_kwargs.prefix_len = 0
  with pytest.raises(config_lib.ConfigError, match=r'model.mask_kwargs.prefix_len=0; must be'):
    main.validate(c)


def test_every_variant_option_is_declared_and_unset():
  c = config_lib.base_config()
  assert set(c.model.attention_kwargs.keys()) == set(registry.all_kwargs())
  assert all(v is None for v in c.model.attention_kwargs.values())


def test_option_of_another_variant_is_rejected():
  c = config_lib.base_config()
  with c.unlocked():
    c.model.attention_kwargs.max_distance = 4  # not a dot_product option
  with pytest.raises(config_lib.ConfigError, match="max_distance.*kernel="):
    main.validate(c)


def test_json_round_trip_keeps_tuples_and_values():
  c = config_lib.base_config()
  with c.unlocked():
    c.extra = (1, 2, (3, 4))
  back = config_lib.from_json(config_lib.to_json(c))
  assert back.extra == (1, 2, (3, 4))
  assert config_lib.differences(c, back) == []
  assert back.model.d_model == c.model.d_model


def test_differences_ignore_resumable_keys():
  a, b = config_lib.base_config(), config_lib.base_config()
  b.train.num_steps += 100
  b.train.parallel, b.train.grad_accum_steps = 'fsdp', 4  # another device count
  b.model.remat, b.train.profile_steps = 'block', '10:20'
  b.eval.batch_tokens, b.eval.contexts, b.eval.sample_len = 4096, (16384,), 2000  # eval only
  assert config_lib.differences(a, b) == []
  b.model.d_model = 64
  assert config_lib.differences(a, b) == ['model.d_model: 128 -> 64']


@pytest.mark.parametrize('args,expected', [
    (['--config.model.d_modl=3'], "Did you mean 'model.d_model'"),
    (['--config.model.d_model=abc'], 'd_model=abc'),
    (['--config.model.attention=nope'],
     'valid: alibi, bahdanau, cope, deberta, dot_product, fire, hard, kerple, local, '
     'location_sensitive, luong_concat, luong_dot, luong_general, luong_local_m, '
     'luong_local_p, rotary, sandwich, shaw, t5_bias, transformer_xl, xpos\n'),
    (['--config=experiments/missing.py'], 'experiments/missing.py'),
    (['--config.model.attention=luong_local_m',
      '--config.model.attention_kwargs.kernel=chunked'],
     "attention='luong_local_m' does not run on it (its scores need the whole"),
    (['--config.model.attention_kwargs.implementation=chunked'],
     "config key 'model.attention_kwargs.implementation' is 'model.attention_kwargs.kernel' now"),
    (['--config=experiments/two_stream.py', '--config.model.fusion_layer=9'],
     "model.fusion_layer=9 is beyond the model's layers: valid 0..4"),
])
def test_cli_bad_config_exits_2_with_message(args, expected, tmp_path, run_main):
  proc = run_main(*args, f'--workdir={tmp_path}/w')
  assert proc.returncode == 2, proc.stderr
  assert expected in proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not (tmp_path / 'w').exists()  # nothing written before validation


@pytest.mark.parametrize('changes,expected', [
    ({'model.attention': 'location_sensitive'},
     "cannot be used in model.type='encoder_decoder'; it works in: rnn_seq2seq"),
    ({'model.type': 'rnn_seq2seq', 'model.attention': 'shaw'},
     "cannot be used in model.type='rnn_seq2seq'; it works in: encoder_decoder, decoder_only"),
    ({'model.num_heads': 5}, 'does not divide'),
    ({'model.attention_kwargs.dense_max_mib': -1}, 'dense_max_mib=-1'),
])
def test_validate_names_the_variant_model_and_kernel_rules(changes, expected):
  """The rules a command line meets after its keys parse (the command line's
  exit 2 for one of them: test_cli_bad_config_exits_2_with_message)."""
  c = config_lib.base_config()
  for key, value in changes.items():
    node, leaf = config_lib.parent_of(c, key)
    node[leaf] = value
  with pytest.raises(config_lib.ConfigError, match=re.escape(expected)):
    main.validate(c)


def test_cli_variant_option_settable_from_command_line(tmp_path, run_main):
  # A variant option that exists in the registry is accepted from the CLI, and
  # a wrong value for it is a config error naming the valid ones.
  proc = run_main('--config.model.attention_kwargs.kernel=bogus',
                  f'--workdir={tmp_path}/w')
  assert proc.returncode == 2
  assert "kernel='bogus'" in proc.stderr and "'chunked'" in proc.stderr


def _table_rows(text: str, width: int) -> tuple[list[str], dict]:
  """`registry.table(width)` read back: (header names, {name: (models, kernels,
  options, description)}), each column the cells' lines, the description its
  words run together. Asserts the table's shape: a header and a rule that give
  the columns, no line longer than `width`, no cell over its column's edge."""
  lines = text.split('\n')
  assert max(map(len, lines)) <= width, max(lines, key=len)
  rule = lines.index(next(line for line in lines if line.startswith('---')))
  starts = [m.start() for m in re.finditer(r'-+', lines[rule])]
  body = lines[rule + 1:lines.index('')]
  rows = {}
  for line in body:
    if line.startswith('    ') and line[4] != ' ':  # a description line
      rows[name][3].append(line[4:])
      continue
    for start in starts[1:]:
      assert not line[start - 2:start].strip(), line  # nothing in the gaps
    cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
    if cells[0]:
      name = cells[0]
      rows[name] = ([], [], [], [])
    for column, cell in zip(rows[name], cells[1:]):
      if cell:
        column.append(cell)
  header = lines[:rule]
  return header, {k: (m, ' '.join(k_).split(), o, ''.join(''.join(d).split()))
                  for k, (m, k_, o, d) in rows.items()}


@pytest.mark.parametrize('width', [72, 100, 160])
def test_list_attention_table_lists_every_variant_in_aligned_columns(width):
  text = registry.table(width)
  header, rows = _table_rows(text, width)
  assert header[0].split() == ['name', 'models', 'kernels', 'options']
  assert header[1].split() == ['description']
  assert list(rows) == registry.names()  # every registered variant, in order
  footer = ' '.join(text.split('\n\n', 1)[1].split())
  shorthand = {'all': registry.ALL_MODELS, 'transformers': registry.TRANSFORMER_MODELS}
  for name, short in shorthand.items():
    assert f'{name} = {", ".join(short)}' in footer
  for name in ('kernel=', 'chunk_size=', 'dense_max_mib='):
    assert name in footer
  for name, (models, kernels, options, description) in rows.items():
    variant = registry.get(name)
    assert [m for cell in models for m in shorthand.get(cell, (cell,))] == list(variant.models)
    own_kernels = {'shaw': ['shaw_banded', 'shaw_by_lag'], 'local': ['local_blocked']}
    assert kernels == ['dense', *(['chunked'] if variant.chunked else []),
                       *(['pallas'] if registry.pallas_runs(variant) else []),
                       *(['cudnn', 'splash', 'xla'] if variant.plain_product else []),
                       *own_kernels.get(name, [])]
    own = [f'{k}={v!r}' for k, v in variant.kwargs.items()] or ['-']
    assert ''.join(options) == ''.join(own)  # a long option may wrap inside its column
    assert description == ''.join(variant.doc.split())


@pytest.mark.parametrize('columns,width', [('90', 90), ('', 100)])
def test_cli_list_attention_fits_the_terminal(columns, width):
  """The width is the terminal's (COLUMNS stands for it), 100 when there is none.
  Nothing on stderr: a listing starts no JAX backend (whose messages about
  absent accelerators would land there) and runs no variant's check."""
  env = {k: v for k, v in os.environ.items() if k != 'COLUMNS'}
  proc = subprocess.run([sys.executable, '-m', 'flaxformer_lite.main', '--list_attention'],
                        cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=dict(env, COLUMNS=columns) if columns else env)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == registry.table(width) + '\n'
  assert proc.stderr == ''


REAL_BAD = [
    ('data.tokenizer', 'wordpiece', 'sentencepiece'),
    ('data.spm_model_type', 'wordpiece', 'unigram'),
    ('data.overlong', 'wrap', 'truncate'),
    ('data.vocab_size', 4, '>= 16'),
    ('data.mlm_rate', 1.5, '(0, 1)'),
    ('train.batch_tokens', -1, '>= 0'),
    ('eval.beam_size', 0, 'greedy'),
    ('model.init', 'xavier', 'gpt2'),
]


@pytest.mark.parametrize('key,value,expected', REAL_BAD)
def test_validate_real_data_keys(key, value, expected):
  c = config_lib.base_config()
  c.data.task = 'multi30k'
  section, name = key.split('.')
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError) as e:
    main.validate(c)
  assert key in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize('model_type,task', [('decoder_only', 'multi30k'),
                                             ('encoder_only', 'reverse'),
                                             ('encoder_decoder', 'tiny_shakespeare')])
def test_model_type_must_fit_the_data(model_type, task):
  c = config_lib.base_config()
  c.model.type, c.data.task = model_type, task
  with pytest.raises(config_lib.ConfigError, match=f"model.type='{model_type}'.*data.task='{task}'"):
    main.validate(c)


def test_tfds_task_needs_a_name():
  c = config_lib.base_config()
  c.data.task = 'tfds'
  with pytest.raises(config_lib.ConfigError, match='data.tfds_name'):
    main.validate(c)


TYPO_EXPERIMENT = '''
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.d_modle = 256
  return config
'''


def test_unknown_key_is_named_with_the_nearest_valid_one():
  c = config_lib.base_config()
  c.model.d_modle = 256  # an experiment file's typo: base_config() is not locked
  with pytest.raises(config_lib.ConfigError,
                     match=r"unknown config key 'model.d_modle'.*Did you mean 'model.d_model'"):
    main.validate(c)
  c = config_lib.base_config()
  c.trian = {'num_steps': 3}
  with pytest.raises(config_lib.ConfigError, match=r"'trian.num_steps'.*Did you mean 'train'"):
    main.validate(c)


@pytest.mark.parametrize('space', [False, True], ids=['--config=PATH', '--config PATH'])
def test_cli_typo_in_experiment_file_exits_2_either_flag_form(space, tmp_path, run_main):
  path = tmp_path / 'typo.py'
  path.write_text(TYPO_EXPERIMENT)
  flag = ['--config', str(path)] if space else [f'--config={path}']
  proc = run_main(*flag, '--config.train.num_steps=3', f'--workdir={tmp_path}/w')
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "unknown config key 'model.d_modle'" in proc.stderr
  assert "Did you mean 'model.d_model'" in proc.stderr
  assert 'Traceback' not in proc.stderr and 'defined twice' not in proc.stderr
  assert not (tmp_path / 'w').exists()


def test_cli_space_separated_config_path_takes_overrides(tmp_path, run_main):
  proc = run_main('--config', 'experiments/reverse.py', '--config.model.num_heads=5',
                  f'--workdir={tmp_path}/w')
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert 'model.num_heads=5' in proc.stderr and 'defined twice' not in proc.stderr


def _two_stream_config():
  return runpy.run_path(os.path.join(REPO, 'experiments', 'two_stream.py'))['get_config']()


@pytest.mark.parametrize('key,value,expected', [
    ('model.fusion_layer', 5, 'beyond the model\'s layers: valid 0..4'),
    ('model.fusion_layer', -1, 'valid 0..4'),
    ('model.fusion_bottlenecks', 0, 'would exchange nothing'),
    ('model.fusion', 'middle', 'valid: early, late, bottleneck'),
    ('model.num_classes', -2, 'must be >= 0'),
    ('data.num_claims', 0, 'must be >= 1'),
    ('data.num_symbols', 1, 'must be >= 2'),
    ('train.batch_tokens', 4096, 'use train.batch_size'),
])
def test_two_stream_bad_values_are_named(key, value, expected):
  _refused(_two_stream_config(), key, value, expected)


def test_early_fusion_refuses_a_fusion_layer():
  c = _two_stream_config()
  c.model.fusion, c.model.fusion_layer = 'early', 2
  with pytest.raises(config_lib.ConfigError, match="fusion='early' fuses from the first layer"):
    main.validate(c)


@pytest.mark.parametrize('model_type,task,valid', [
    ('two_stream', 'reverse', "['two_stream']"),  # a single-stream task
    ('two_stream', 'tiny_shakespeare', "['two_stream']"),
    ('encoder_decoder', 'presence_claims', "['two_stream']"),
])
def test_two_stream_model_and_task_go_together(model_type, task, valid):
  c = _two_stream_config()
  c.model.type, c.data.task = model_type, task
  with pytest.raises(config_lib.ConfigError) as e:
    main.validate(c)
  message = str(e.value)
  assert f"model.type='{model_type}'" in message and f"data.task='{task}'" in message
  assert ('use model.type in ' + valid in message) == (model_type == 'encoder_decoder')
