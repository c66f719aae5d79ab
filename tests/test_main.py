"""The command line: experiment files, flags, the default workdir, several devices."""
import glob
import hashlib
import json
import os
import re
import runpy
import subprocess
import sys

import pytest

from flaxformer_lite import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(glob.glob(os.path.join(REPO, 'experiments', '*.py')))


@pytest.mark.parametrize('path', EXPERIMENTS, ids=os.path.basename)
def test_every_experiment_file_is_valid_and_documents_its_command(path):
  module = runpy.run_path(path)
  main.validate(module['get_config']())
  assert './launch.sh' in module['__doc__'] and 'Expected' in module['__doc__']


# The command line end to end (progress on stdout, no noise, resume) is the
# README's quick start: tests/test_readme.py.


def _forget_flags():
  """Unparses main's flags and removes the flags that config_flags defines
  for each --config.a.b override (parsing one twice in a process would
  define it twice)."""
  main.FLAGS.unparse_flags()
  for name in [name for name in main.FLAGS if name.startswith('config.')]:
    delattr(main.FLAGS, name)


@pytest.fixture
def parse(monkeypatch):
  """parse(*ARGS): main.parse_flags on ARGS in this process, as a fresh one would."""
  monkeypatch.setattr(sys, 'argv', ['main'])  # parse_flags writes it

  def parse_flags(*args):
    _forget_flags()
    return main.parse_flags(['main', *args])
  yield parse_flags
  _forget_flags()


def test_default_workdir_is_one_per_experiment_and_set_of_overrides(parse):
  def workdir(*args):
    parse(*args)
    return main.workdir()

  assert workdir() == os.path.join('workdirs', 'reverse')
  assert workdir('--config=experiments/reverse_rnn.py') == os.path.join('workdirs', 'reverse_rnn')
  shaw = workdir('--config.model.attention=shaw', '--config.model.attention_kwargs.max_distance=8')
  assert re.fullmatch(r'workdirs/reverse-attention=shaw,max_distance=8-[0-9a-f]{6}',
                      shaw.replace(os.sep, '/')), shaw
  assert workdir('--config.model.attention_kwargs.max_distance=8',
                 '--config.model.attention=shaw') == shaw  # the order does not matter
  assert workdir('--config.model.attention=shaw', '--config.model.attention_kwargs.max_distance=8',
                 '--config.seed=0') != shaw  # a seed set, even to its default, is an override
  others = {workdir('--config.model.attention=shaw'),
            workdir('--config.model.attention_kwargs.max_distance=8'),
            workdir('--config.model.attention=shaw', '--config.model.attention_kwargs.max_distance=4'),
            workdir('--config=experiments/reverse_rnn.py', '--config.model.attention=shaw',
                    '--config.model.attention_kwargs.max_distance=8')}
  assert len(others) == 4 and shaw not in others
  assert workdir('--workdir=/tmp/mine', '--config.model.attention=shaw') == '/tmp/mine'


def test_default_workdir_names_the_overrides_and_hashes_them():
  digest = hashlib.sha256(b"data.max_len=64\nmodel.max_len=256\nseed=3").hexdigest()[:6]
  assert main.default_workdir('experiments/reverse.py', {
      'model.max_len': 256, 'data.max_len': 64, 'seed': 3}) == os.path.join(
          'workdirs', f'reverse-data.max_len=64,model.max_len=256,seed=3-{digest}')
  digest = hashlib.sha256(b"data.manual_dir='/d/x'\neval.contexts=(128, 256)").hexdigest()[:6]
  assert main.default_workdir('e.py', {'eval.contexts': (128, 256), 'data.manual_dir': '/d/x'}) \
      == os.path.join('workdirs', f'e-manual_dir=d_x,contexts=128_256-{digest}')
  long = main.default_workdir('e.py', {f'train.option_{i}': 'x' * 20 for i in range(5)})
  readable = os.path.basename(long).split('-')[1]
  assert len(readable) == main.SLUG_CHARS and readable.startswith('option_0=' + 'x' * 20 + ',')


@pytest.mark.parametrize('arg,says,not_said', [
    ('-h', 'unknown flag -h; ./launch.sh --help', 'Override values'),
    ('--foo=1', 'unknown flag --foo; ./launch.sh --help', 'Override values'),
    ('--config.model.d_model=abc', 'Override values must parse as the type', 'unknown flag'),
])
def test_a_bad_flag_exits_2_with_what_applies_to_it(parse, capsys, arg, says, not_said):
  with pytest.raises(SystemExit) as e:
    parse(arg)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith('error: ') and says in err and not_said not in err


def test_a_sweep_grid_given_as_an_experiment_points_to_sweep(parse, capsys):
  with pytest.raises(SystemExit) as e:
    parse('--config=experiments/sweeps/two_stream_fusion.py')
  err = capsys.readouterr().err
  assert e.value.code == 2
  assert err.startswith('error: experiments/sweeps/two_stream_fusion.py is a sweep grid')
  assert './launch.sh sweep experiments/sweeps/two_stream_fusion.py' in err


START_ON_DEVICES = '''
import gc, json, runpy, sys
import jax, numpy as np
from flaxformer_lite import config as config_lib, data, main, models
from flaxformer_lite.train import loop, partitioning, state as state_lib, steps
gc.set_threshold(*main.GC_THRESHOLDS)  # as the command line runs
n = jax.device_count()
lower, out = sys.argv[1] == 'lower', {}
for path in sys.argv[2:]:
  config = runpy.run_path(path)['get_config']()
  main.from_checkpoint(config)  # a pretrained model's architecture, as a run takes it
  main.validate(config)
  with config.unlocked():
    config.model.init_from = ''  # its weights are not read here
  m, t, d = config.model, config.train, config.data
  objective = steps.OBJECTIVES[m.type]
  with config.unlocked():
    m.vocab_size = m.vocab_size or 40  # the data's, once loaded
    m.num_classes = m.num_classes or 3
  width = d.max_len + (objective == 'seq2seq')  # + EOS
  rows = t.batch_tokens // width if t.batch_tokens else t.batch_size
  batch = {k: np.full((rows, width), 5, np.int32) for k in ('inputs', 'targets')}
  if objective == 'classify':  # two streams and a class
    batch.update(inputs_b=np.full((rows, d.num_claims), 5, np.int32),
                 targets=np.full((rows, 1), 1, np.int32))
  parallel = partitioning.Partitioner(t.parallel)
  train_rows = partitioning.padded_rows(rows, jax.local_device_count() * t.grad_accum_steps)
  placed = parallel.place_batch(data.pad_rows(batch, train_rows))
  if lower:
    # One layer of each stack (two streams keep theirs up to the first fused
    # one): the layers repeat, and so do their shardings and the step's ops.
    with config.unlocked():
      m.num_encoder_layers = min(m.num_encoder_layers, m.fusion_layer + 1)
      m.num_decoder_layers = min(m.num_decoder_layers, 1)
    model = models.build(m)
    state = jax.eval_shape(lambda: state_lib.create(model, config, batch, jax.random.key(0)))
    if t.parallel != 'pmap':
      parallel.layout(state, state_lib.param_axes(model, config, batch))
    step = parallel.compile_step(
        steps.train_step, label_smoothing=t.label_smoothing, objective=objective,
        vocab_size=m.vocab_size, grad_accum_steps=t.grad_accum_steps)
    step.lower(state, placed, jax.random.key(1))
  eval_rows = partitioning.padded_rows(config.eval.batch_size, n)
  eval_batch = next(data.eval_batches({k: v[:1] for k, v in batch.items()},
                                      config.eval.batch_size, rows=eval_rows))
  parallel.place_eval_batch(eval_batch)
  out[path] = [rows, train_rows, config.eval.batch_size, eval_rows]
print(json.dumps(out))
'''


@pytest.mark.parametrize('devices', [2, 4, 8])
def test_every_experiment_starts_unchanged_on_several_devices(devices):
  """Each experiment file as shipped, on `devices` CPU devices: its config
  validates, its train batch (padded with weight-0 rows where it does not
  split) and its eval batch are placed on the mesh, and (8 devices) its train
  step lowers, with one layer of each stack. (Training on padded batches =
  unpadded: tests/train/test_parallel.py.)"""
  flags = os.environ.get('XLA_FLAGS', '')  # tests/conftest.py's, kept
  env = dict(os.environ, XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count={devices}',
             JAX_PLATFORMS='cpu')
  lower = 'lower' if devices == 8 else 'place'
  done = subprocess.run([sys.executable, '-c', START_ON_DEVICES, lower, *EXPERIMENTS], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  plans = json.loads(done.stdout.strip().splitlines()[-1])
  assert sorted(plans) == EXPERIMENTS
  for path, (rows, train_rows, eval_size, eval_rows) in plans.items():
    accum = runpy.run_path(path)['get_config']().train.grad_accum_steps
    assert train_rows % (devices * accum) == 0 and 0 <= train_rows - rows < devices * accum
    assert eval_rows % devices == 0 and 0 <= eval_rows - eval_size < devices


def test_import_modules_names_a_users_variant_and_its_options_on_the_command_line(
    parse, tilted_variant):
  from flaxformer_lite.attention import registry
  parse('--config.model.import_modules=tilted_variant', '--config.model.attention=tilted',
        '--config.model.attention_kwargs.tilt=2.0')
  config = main.FLAGS.config
  main.validate(config)
  assert config.model.import_modules == 'tilted_variant'  # config.json records it
  assert registry.resolve_kwargs('tilted', config.model.attention_kwargs) == {'tilt': 2.0}


def test_an_experiment_file_names_a_users_variant_and_sets_its_option(tilted_variant):
  """model.import_modules set by the experiment file rather than the command
  line: its modules are imported before the config's keys are checked, so
  the option the file sets is a key."""
  from flaxformer_lite import config as config_lib
  config = config_lib.base_config()
  config.model.import_modules, config.model.attention = tilted_variant, 'tilted'
  config.model.attention_kwargs.tilt = 2.0
  main.validate(config)


@pytest.mark.parametrize('source, message', [
    (None, "model.import_modules: no module 'absent_module' on the path; valid: names "
           'importable from the checkout or PYTHONPATH'),
    ('def broken(:\n', "model.import_modules: importing 'absent_module' failed: SyntaxError"),
    ('import no_such_dependency\n', "model.import_modules: importing 'absent_module' failed: "
                                     "No module named 'no_such_dependency'"),
], ids=['not found', 'syntax error', 'a missing dependency'])
def test_a_module_that_does_not_import_is_a_config_error_naming_it(
    parse, user_module, capsys, source, message):
  if source is not None:
    user_module('absent_module', source)
  with pytest.raises(SystemExit) as exit_:
    parse('--config.model.import_modules=absent_module', '--config.model.attention=tilted')
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {message}') and 'Traceback' not in err, err
  # set in an experiment file instead: the same error, from the config's validation
  from flaxformer_lite import config as config_lib
  config = config_lib.base_config()
  config.model.import_modules = 'absent_module'
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    main.validate(config)


@pytest.mark.parametrize('body, message', [
    ('def get_config(:\n  return config.base_config()\n',
     'broken.py, line 3: invalid syntax (def get_config(:); an experiment file is Python'),
    ('def get_config():\n  c = config.base_config()\n  c.model.d_model = d_model\n  return c\n',
     "broken.py, line 5: NameError: name 'd_model' is not defined (raised by the experiment "
     'file)'),
], ids=['syntax error', 'raises'])
def test_an_experiment_file_that_does_not_run_exits_2_with_one_line(parse, capsys, tmp_path,
                                                                    body, message):
  path = tmp_path / 'broken.py'
  path.write_text('from flaxformer_lite import config\n\n' + body)
  with pytest.raises(SystemExit) as exit_:
    parse(f'--config={path}')
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {tmp_path}/{message}'), err
  assert len(err.splitlines()) == 1 and 'Traceback' not in err
