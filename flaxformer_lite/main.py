"""Entry point: `python -m flaxformer_lite.main --config=EXP.py [--workdir=DIR] [--config.a.b=v]`.

Progress goes to stdout, warnings and errors to stderr. Exit codes: 0 done;
2 bad flag, config or data (nothing compiled, nothing saved overwritten);
3 non-finite loss (the last good checkpoint is kept); after SIGINT or SIGTERM
0 (train/preemption.py), 128 + its number (130, 143) for a second signal.
`./launch.sh --help` describes the commands and flags.
"""
from __future__ import annotations

import ast
import gc
import hashlib
import logging as std_logging
import os
import re
import runpy
import shutil
import sys
import traceback
from typing import Any, Mapping

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from flaxformer_lite import config as config_lib
from flaxformer_lite.attention import registry

FLAGS = flags.FLAGS
DEFAULT_EXPERIMENT = 'experiments/reverse.py'
# No default here: a default is loaded (with the overrides) at import time.
config_flags.DEFINE_config_file('config', None,
                                f'Experiment file (get_config() -> ConfigDict); '
                                f'default {DEFAULT_EXPERIMENT}.',
                                lock_config=True)
flags.DEFINE_string('workdir', None,
                    'Checkpoints, metrics.jsonl, TensorBoard events, config.json; re-running '
                    'on it resumes. Default: workdirs/<experiment name> without --config '
                    'overrides, else workdirs/<experiment name>-<key=value of each override, '
                    'keys shortened>-<6 hex digits of the sha256 of the sorted overrides>: '
                    'the same command finds its own run, and other overrides never share it.')
flags.DEFINE_bool('list_attention', False,
                  'Print a table of the attention variants (models, kernels, options, '
                  'description) and exit.')
flags.DEFINE_integer('local_processes', 0,
                     'Run as this many JAX processes on 127.0.0.1 (a multi-host job on one '
                     'machine; train/multihost.py).')
flags.DEFINE_bool('multihost', False,
                  'Call jax.distributed.initialize() first, letting JAX detect the cluster '
                  '(TPU pod slice with --worker=all, SLURM).')
flags.DEFINE_bool('allow_config_change', False,
                  'Resume a workdir whose config.json differs from this config in values '
                  'that change the model or data (the differences are logged).')


def validate(config) -> None:
  """Every rule on the config, once, before anything is compiled or written:
  model.import_modules imported (their variants and options join the
  registry), its keys (typos), then each module's own (raises
  config.ConfigError)."""
  from flaxformer_lite import models  # imported here: --list_attention stays fast
  from flaxformer_lite.data import validation as data_validation
  from flaxformer_lite.train import validation as train_validation
  config_lib.import_modules(config.model.get('import_modules', ''))
  config_lib.check_keys(config)
  models.validate(config.model)
  train_validation.validate(config)
  data_validation.validate(config)


def from_checkpoint(config, keep=()) -> list[str]:
  """With model.init_from, config.model's architecture becomes the
  checkpoint's (pretrained.architecture: its sizes, blocks and attention
  variant), except the keys in `keep` ('model.attention', ...: those set on
  the command line). Returns the lines for the log: what changed, what was kept."""
  if not config.model.init_from:
    return []
  from flaxformer_lite import pretrained
  path = pretrained.resolve(config.model.init_from)
  if not os.path.exists(path):
    raise config_lib.ConfigError(f'model.init_from={path!r} does not exist; give a Hugging '
                                 'Face-style checkpoint directory, a GGUF file or one of '
                                 f'{", ".join(pretrained.MODELS)} (fetched into '
                                 f'{pretrained.cache_dir()})')
  changed, kept = [], []
  with config.unlocked():
    config.model.init_from = path
    checkpoint = pretrained.architecture(path)
    if 'model.attention' in keep:  # another variant: none of the checkpoint's options
      checkpoint = {k: v for k, v in checkpoint.items() if not k.startswith('attention_kwargs.')}
    for key, value in checkpoint.items():
      node, leaf = config_lib.parent_of(config.model, key)
      if f'model.{key}' in keep:
        kept.append(key)
      elif node[leaf] != value:
        changed.append(f'{key}={value!r}')
        node[leaf] = value
  lines = [f'init_from: the architecture of {path}: {", ".join(changed)}'] if changed else []
  return lines + ([f'init_from: kept from the command line: {", ".join(kept)}'] if kept else [])


def _fail(message: str, code: int = 2):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(code)


# Longest readable part of a default workdir's name; the hash keeps longer
# override lists apart.
SLUG_CHARS = 60


def _short_keys(keys) -> dict[str, str]:
  """{dotted key: its shortest dotted suffix no other key of `keys` ends with}:
  'model.attention_kwargs.max_distance' -> 'max_distance', but 'data.max_len'
  and 'model.max_len' together stay whole."""
  out = {}
  for key in keys:
    parts = key.split('.')
    for n in range(1, len(parts) + 1):
      suffix = '.'.join(parts[-n:])
      if not any(k != key and (k == suffix or k.endswith('.' + suffix)) for k in keys):
        break
    out[key] = suffix
  return out


def _slug(value) -> str:
  """An override's value as file-name characters: '(128, 256)' -> '128_256'."""
  return re.sub(r'[^A-Za-z0-9._+-]+', '_', str(value)).strip('_') or '_'


def default_workdir(experiment: str, overrides: Mapping[str, Any]) -> str:
  """workdirs/NAME for experiment file NAME.py without overrides, else
  workdirs/NAME-KEY=VALUE,...-HASH: the overrides sorted by key, each key
  shortened to the end that tells it from the others (`_short_keys`), the
  list cut at SLUG_CHARS; HASH the first 6 hex digits of the sha256 of the
  sorted `key=value` overrides, which keeps apart names the cut or the
  shortening would merge. One set of overrides, one workdir, in any order."""
  name = os.path.splitext(os.path.basename(experiment))[0]
  if not overrides:
    return os.path.join('workdirs', name)
  text = '\n'.join(sorted(f'{key}={value!r}' for key, value in overrides.items()))
  short = _short_keys(list(overrides))
  readable = ','.join(f'{short[k]}={_slug(overrides[k])}' for k in sorted(overrides))
  digest = hashlib.sha256(text.encode()).hexdigest()[:6]
  return os.path.join('workdirs', f'{name}-{readable[:SLUG_CHARS]}-{digest}')


def workdir() -> str:
  """--workdir, else the default for the parsed experiment and overrides."""
  return FLAGS.workdir or default_workdir(
      _experiment_path(sys.argv), config_flags.get_override_values(FLAGS['config']))


def _experiment_path(argv) -> str:
  for arg in argv[1:]:
    if arg.startswith('--config='):
      return arg.split('=', 1)[1].split(':', 1)[0]
  return DEFAULT_EXPERIMENT


def _explain_override(argv) -> str | None:
  """Names the first --config.a.b override whose key does not exist."""
  try:
    base = runpy.run_path(_experiment_path(argv))['get_config']()
  except Exception:  # the experiment file itself is broken: reported elsewhere
    return None
  for arg in argv[1:]:
    if arg.startswith('--config.'):
      message = config_lib.unknown_key_message(base, arg[len('--config.'):].split('=', 1)[0])
      if message:
        return message
  return None


def _join_config_path(argv) -> list[str]:
  """`--config PATH` (absl accepts a space) -> `--config=PATH`, the form the
  rest of this module reads."""
  out, i = [argv[0]], 1
  while i < len(argv):
    if argv[i] == '--config' and i + 1 < len(argv):
      out.append(f'--config={argv[i + 1]}')
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def _top_level_functions(path: str) -> set[str]:
  """The names of the functions a Python file defines at its top level (none
  if it cannot be read); SyntaxError if it does not parse."""
  try:
    with open(path) as f:
      source = f.read()
  except (OSError, ValueError):
    return set()
  tree = ast.parse(source, path)
  return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def _syntax_message(path: str, e: SyntaxError) -> str:
  """'PATH, line N: MESSAGE: THE LINE' for an experiment file that does not parse."""
  text = (e.text or '').strip()
  return (f'{path}, line {e.lineno}: {e.msg}{f" ({text})" if text else ""}; an experiment file '
          'is Python that defines get_config() (README, "Writing an experiment")')


def _raised_in(e: BaseException, path: str) -> str | None:
  """'PATH, line N: TYPE: MESSAGE' when the innermost frame of `e` in the file
  `path` is there (the experiment's own code raised it); else None."""
  here = os.path.abspath(path)
  lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
           if os.path.abspath(f.filename) == here]
  if not lines:
    return None
  return f'{path}, line {lines[-1]}: {type(e).__name__}: {e} (raised by the experiment file)'


def parse_flags(argv):
  """absl flag parsing that reports every bad flag as one message and exit 2."""
  argv = _join_config_path(argv)
  if not any(a.startswith('--config=') for a in argv[1:]):
    argv = [argv[0], f'--config={DEFAULT_EXPERIMENT}', *argv[1:]]
  sys.argv[:] = argv  # main() and the local multi-process launcher read it
  experiment = _experiment_path(argv)
  if not os.path.isfile(experiment):
    _fail(f'experiment file {experiment!r} not found; experiments: '
          f'{", ".join(sorted(os.listdir("experiments"))) if os.path.isdir("experiments") else "?"}')
  try:
    defined = _top_level_functions(experiment)
  except SyntaxError as e:
    _fail(_syntax_message(experiment, e))
  if 'get_sweep' in defined and 'get_config' not in defined:
    _fail(f'{experiment} is a sweep grid (get_sweep()), not an experiment; run it with '
          f'./launch.sh sweep {experiment} (./launch.sh sweep --help)')
  # The command line's modules before the experiment's base_config(): the
  # options of the variants they register become keys that overrides can set.
  for arg in argv[1:]:
    if arg.startswith('--config.model.import_modules='):
      try:
        config_lib.import_modules(arg.split('=', 1)[1])
      except config_lib.ConfigError as e:
        _fail(str(e))
  try:
    rest = FLAGS(argv)
  except flags.UnrecognizedFlagError as e:
    given = next((a.split('=', 1)[0] for a in argv[1:]
                  if a.lstrip('-').split('=', 1)[0] == e.flagname), f'--{e.flagname}')
    _fail(f'unknown flag {given}; ./launch.sh --help lists the commands and flags')
  except flags.Error as e:
    if str(e).startswith('flag --config.'):
      _fail(f'{e}. Override values must parse as the type of the key they replace.')
    _fail(f'{e} (./launch.sh --help lists the flags)')
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    _fail(_raised_in(e, experiment) or _explain_override(argv) or f'bad --config override: {e}')
  except Exception as e:  # noqa: BLE001  (anything else the experiment's code raises)
    if (message := _raised_in(e, experiment)) is None:
      raise
    _fail(message)
  if len(rest) > 1:
    _fail(f'unexpected arguments {rest[1:]}; flags look like --workdir=DIR or '
          '--config.model.attention=NAME')
  if not isinstance(FLAGS.config, ConfigDict):
    _fail(f'could not load a config from {experiment!r}: it needs a get_config() '
          'returning an ml_collections.ConfigDict')
  return rest


def _quiet_libraries():
  """Other libraries (jax, orbax, tfds) at WARNING, set before JAX starts its
  backends: on a host without a TPU, JAX logs at INFO that libtpu.so is
  missing."""
  logging.set_verbosity(logging.WARNING)


def _setup_logging(process_index: int = 0):
  """Our progress (INFO) on stdout, our warnings on stderr, for process 0;
  the other processes warn only."""
  log = std_logging.getLogger('flaxformer_lite')
  prefix = f'[{process_index}] ' if process_index else ''
  formatter = std_logging.Formatter(f'%(asctime)s {prefix}%(message)s', '%H:%M:%S')
  progress = std_logging.StreamHandler(sys.stdout)
  progress.addFilter(lambda record: record.levelno < std_logging.WARNING)
  problems = std_logging.StreamHandler(sys.stderr)
  problems.setLevel(std_logging.WARNING)
  for handler in (progress, problems):
    handler.setFormatter(formatter)
    log.addHandler(handler)
  log.setLevel(std_logging.INFO if process_index == 0 else std_logging.WARNING)
  log.propagate = False


def main(argv):
  del argv
  if FLAGS.list_attention:
    print(registry.table(shutil.get_terminal_size((100, 24)).columns))
    return
  _quiet_libraries()
  from flaxformer_lite import compilation
  compilation.set_xla_flags()  # before the backend starts
  from flaxformer_lite.train import multihost
  if FLAGS.local_processes > 1 and not os.environ.get('FFL_PROCESS_ID'):
    sys.exit(multihost.launch_local(
        FLAGS.local_processes,
        [a for a in sys.argv[1:] if not a.startswith('--local_processes')]))
  multihost.initialize(auto=FLAGS.multihost)
  import jax
  _setup_logging(jax.process_index())
  cache = compilation.enable_cache()
  # Imported late: --list_attention stays fast.
  from flaxformer_lite import data, pretrained
  from flaxformer_lite.train import checkpoints, loop

  config = FLAGS.config
  run_dir = workdir()
  try:
    checkpoint_lines = from_checkpoint(config, keep=set(config_lib.flatten(
        config_flags.get_override_values(FLAGS['config']))))
    validate(config)
    log = std_logging.getLogger('flaxformer_lite')
    log.info('workdir: %s', os.path.abspath(run_dir))
    log.info('compilation cache: %s', cache or f'off ({compilation.ENV}=off)')
    for line in checkpoint_lines:
      log.info('%s', line)
    results = loop.train_and_evaluate(config, run_dir,
                                      allow_config_change=FLAGS.allow_config_change)
    if results.get('preempted'):
      # What was trained is saved; an evaluation or a compile the signal cut
      # short may still be running in XLA's threads, and a normal exit would
      # wait for it.
      for handler in std_logging.getLogger().handlers + log.handlers:
        handler.flush()
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(0)
  except (config_lib.ConfigError, checkpoints.CheckpointError, data.DataError,
          pretrained.PretrainedError) as e:
    _fail(str(e), 2)
  except loop.NonFiniteLossError as e:
    _fail(str(e), 3)


# CPython's cyclic collector at its default thresholds (700, 10, 10) runs every
# few hundred new container objects, and tracing, lowering and the Python side
# of compiling a model create millions of them, freed by reference counting
# all the same. Collecting less often takes that share of a run's start off;
# cycles are still collected. (The test suite's workers use it too.)
GC_THRESHOLDS = (50_000, 20, 10)


def run():
  gc.set_threshold(*GC_THRESHOLDS)
  app.run(main, flags_parser=parse_flags)


if __name__ == '__main__':
  run()
