"""Shared fixtures: a tiny experiment config, a per-session TFDS data dir, and
attention dropout's keep mask one weight at a time."""
import contextlib
import gc
import importlib
import importlib.util
import os
import subprocess
import sys

# The suite's programs are small: LLVM's optimisation of the code XLA:CPU
# generates for them costs more time than it saves (a quarter of the suite's
# CPU time; its expensive passes alone, 5-10% of a compile-bound test's), and
# XLA:CPU's MLIR fusion emitters take about twice the compile time of its
# elemental IR emitters for the same fused HLO.
# Subprocesses inherit it; those that set XLA_FLAGS append to it. With a GPU
# or TPU plugin installed (and not JAX_PLATFORMS=cpu) the suite runs on the
# accelerator, under XLA's own flags: these are tuned for XLA:CPU.
_ACCELERATOR = os.environ.get('JAX_PLATFORMS', '') != 'cpu' and any(
    importlib.util.find_spec(name) is not None for name in ('jax_plugins', 'libtpu'))
for _flag in ('--xla_backend_optimization_level=0', '--xla_llvm_disable_expensive_passes=true',
              '--xla_cpu_use_fusion_emitters=false'):
  if not _ACCELERATOR and _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The tests hold float32 results to float64 references; a GPU's default
# float32 matmul (TF32, 10 bits of mantissa) would fail them for the
# platform's rounding, not for the code's math.
if _ACCELERATOR:
  jax.config.update('jax_default_matmul_precision', 'highest')

from flaxformer_lite import compilation, config as config_lib
from flaxformer_lite.attention import registry
from flaxformer_lite import main as main_lib
from flaxformer_lite.data import corpora, shared

gc.set_threshold(*main_lib.GC_THRESHOLDS)  # as the command line runs (main.py says why)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='session', autouse=True)
def compilation_cache(tmp_path_factory):
  """Tests that train the same tiny model several times compile it once,
  subprocesses (the CLI and fault tests) included: they inherit the cache
  through the environment. pytest-xdist's workers share one cache (JAX's
  cache key includes the cache's path, so separate folders never share)."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    base = base.parent  # the run's folder, above each worker's own
  cache = os.path.join(str(base), 'jax_cache')
  os.environ.update({compilation.ENV: cache, 'JAX_COMPILATION_CACHE_DIR': cache})
  compilation.enable_cache()


SHARED_DATA, _LOOKED_AT = shared.find(REPO)
_SKIPPED_FOR_DATA: list[str] = []
_NOT_FOUND = 'the real corpora (multi30k/, tiny_shakespeare/) were not found'


def require_shared_data() -> str:
  """The shared corpora folder. Missing: the test skips (one summary line at
  the end names the skipped tests and where the data was looked for), and on
  CI (CI=true) it fails instead."""
  if SHARED_DATA is None:
    message = (f'{_NOT_FOUND} in {" or ".join(_LOOKED_AT)}; set FFL_SHARED_DATA to the '
               'folder holding them')
    if os.environ.get('CI') == 'true':
      pytest.fail(message)
    pytest.skip(message)
  return SHARED_DATA


def require_tfds():
  """tensorflow_datasets, which the real corpora and the synthetic tasks' TFDS
  builder are read through (without it the synthetic tasks are generated in
  memory). Missing: the test skips; on CI (CI=true) it fails instead."""
  try:
    return importlib.import_module('tensorflow_datasets')
  except ImportError:
    message = ('tensorflow_datasets is not installed; '
               f'pip install {corpora.TFDS_REQUIREMENTS} adds it')
    if os.environ.get('CI') == 'true':
      pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope='session')
def tfds():
  """The tensorflow_datasets module (require_tfds)."""
  return require_tfds()


@pytest.fixture(scope='session')
def shared_data():
  """../shared/data (or $FFL_SHARED_DATA): the real corpora (require_shared_data),
  which the builders read through TFDS (require_tfds)."""
  require_tfds()
  return require_shared_data()


@pytest.fixture(scope='session')
def shared_raw_files():
  """The same folder, for a test that reads its raw files itself (no TFDS)."""
  return require_shared_data()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """FFL_TEST_CPU_LOG=FILE: each test's CPU seconds (setup, call and teardown;
  this process's and its finished subprocesses'), a line each: where the
  suite's time goes, apart from the waiting that wall-clock durations add
  when several workers share the cores."""
  path = os.environ.get('FFL_TEST_CPU_LOG')
  if not path:
    yield
    return
  import resource
  def cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime
  own, children = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
  yield
  own, children = cpu(resource.RUSAGE_SELF) - own, cpu(resource.RUSAGE_CHILDREN) - children
  with open(path, 'a') as f:
    f.write(f'{own + children:.2f} {own:.2f} {children:.2f} {item.nodeid}\n')


def pytest_runtest_logreport(report):
  if report.skipped and _NOT_FOUND in str(report.longrepr):
    _SKIPPED_FOR_DATA.append(report.nodeid)
  # FFL_FAILURE_LOG=FILE: each failure's test and last line, as it happens
  # (benchmarks/gpu_check.py reads it when its time runs out mid-suite).
  if report.failed and os.environ.get('FFL_FAILURE_LOG'):
    lines = [line for line in report.longreprtext.splitlines() if line.strip()]
    raised = [line for line in lines if line.startswith('E ')]
    with open(os.environ['FFL_FAILURE_LOG'], 'a') as f:
      f.write(f'{report.nodeid} ({report.when}): {(raised[:1] or lines[-1:] or ["?"])[0][:300]}\n')


def pytest_terminal_summary(terminalreporter):
  if _SKIPPED_FOR_DATA:
    terminalreporter.write_line(
        f'SKIPPED {len(_SKIPPED_FOR_DATA)} tests that need the real corpora: not found in '
        f'{" or ".join(_LOOKED_AT)}; set FFL_SHARED_DATA=/path/to/shared/data to run them '
        f'(CI=true makes them fail instead).', yellow=True, bold=True)


@pytest.fixture(scope='session')
def tfds_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('tfds'))


@pytest.fixture
def tiny_config(tfds_dir):
  """A config that trains in seconds: reverse, lengths 1..6, 2+2 layers of d=32."""
  c = config_lib.base_config()
  c.model.d_model, c.model.num_heads, c.model.mlp_dim = 32, 4, 64
  c.model.num_encoder_layers = c.model.num_decoder_layers = 1
  c.model.max_len = 64
  c.train.num_steps, c.train.batch_size, c.train.warmup_steps = 20, 16, 10
  c.train.learning_rate = 2.0
  c.train.log_every = c.train.eval_every = c.train.checkpoint_every = 10
  c.data.max_len, c.data.num_symbols = 6, 6
  c.data.num_train, c.data.num_eval = 512, 40
  c.data.data_dir = tfds_dir
  c.eval.batch_size, c.eval.num_examples_to_log = 20, 0
  return c


@pytest.fixture
def run_main():
  """run_main(*ARGS) runs `python -m flaxformer_lite.main ARGS` in the repo."""
  def run(*args, timeout=300):
    return subprocess.run([sys.executable, '-m', 'flaxformer_lite.main', *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
  return run


# The files whose tests train in subprocesses or on real data, heaviest first
# (CPU seconds: FFL_TEST_CPU_LOG): with several workers (launch.sh test runs
# pytest-xdist) they start first, and the short tests fill the gaps, instead
# of one worker finishing a long test alone at the end.
SLOW_FIRST = ('tests/train/test_parallel.py', 'tests/train/test_faults.py', 'tests/test_readme.py',
              'tests/train/test_multihost.py', 'tests/test_gpu_check.py',
              'tests/test_real_data.py', 'tests/train/test_loop.py', 'tests/test_pretrained.py',
              'tests/test_packing.py', 'tests/test_two_stream.py', 'tests/train/test_memory.py',
              'tests/test_plot_attention.py', 'tests/test_main.py', 'tests/test_sweep.py',
              'tests/train/test_evaluation.py', 'tests/train/test_checkpoints.py',
              'tests/test_decoding.py', 'tests/layers/test_transformer.py')
# The tests that share one large module-scoped compilation (these fixtures),
# together on one worker, so that each fixture is built once.
SHARED_COMPILATIONS = ('trained', 'cases')
SHARED_FIRST = ('tests/test_chunked_models.py', 'tests/attention/kernels/test_blockwise.py')


def _order(item):
  path = item.nodeid.split('::')[0]
  if path in SHARED_FIRST:
    shares = any(f in item.fixturenames for f in SHARED_COMPILATIONS)
    return (0, SHARED_FIRST.index(path), not shares)
  return (1, SLOW_FIRST.index(path)) if path in SLOW_FIRST else (2,)


def _dealt(items, workers: int) -> list:
  """`items` reordered for pytest-xdist's work stealing, which hands worker i
  the i-th of `workers` consecutive slices of the queue, then lets an idle
  worker take the tail of the longest queue: the shared compilations head
  the first slice, the slow files (whole, their tests in order) head the
  slices in turn, the rest fills them in order. In one slice, the slow files
  would run one after another on one worker, the last ones at the suite's end."""
  sizes, left = [], len(items)
  for i in range(workers):  # xdist's split: len(pending) // nodes remaining
    sizes.append(left // (workers - i))
    left -= sizes[-1]
  groups = {0: [], 1: {}, 2: []}
  for item in items:
    rank = _order(item)[0]
    if rank == 1:
      groups[1].setdefault(item.nodeid.split('::')[0], []).append(item)
    else:
      groups[rank].append(item)
  heads = [list(groups[0])] + [[] for _ in range(workers - 1)]
  for i, tests in enumerate(groups[1].values()):
    heads[(i + 1) % workers] += tests
  rest, order = iter(groups[2]), []
  for head, size in zip(heads, sizes):
    order += head + [item for _, item in zip(range(size - len(head)), rest)]
  return order + list(rest)


def pytest_collection_modifyitems(items):
  items.sort(key=_order)
  workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '0'))
  if workers > 1:
    items[:] = _dealt(items, workers)


def pytest_runtest_teardown(item, nextitem):
  """JAX's caches emptied between test files: what they hold of each
  lowering keeps MLIR objects alive, and each new lowering (an op run
  eagerly for the first time, a jit's first call) slows with their number:
  up to twice as slow after a few thousand (benchmarks/lowering_cache.py).
  A file's tests share their ops; the next file starts over (the persistent
  compilation cache still saves the compiles)."""
  if nextitem is None or nextitem.module is not item.module:
    jax.clear_caches()


@pytest.fixture(scope='session')
def counting_chunked_attend():
  """counting_chunked_attend(calls): a context in which each call of
  blockwise.attend first appends 1 to the list `calls`. Traced inside it, a
  chunked form shows that it ran the block kernel, not a dense fallback."""
  from flaxformer_lite.attention.kernels import blockwise

  @contextlib.contextmanager
  def counting(calls):
    attend = blockwise.attend

    def counted(*args, **kwargs):
      calls.append(1)
      return attend(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(blockwise, 'attend', counted)
      yield

  return counting


# Windows, clipping and bucket ranges shorter than a dozen tokens, so that every
# variant's position logic is at work on short test sequences.
SMALL_ATTENTION_OPTIONS = {'window': 3, 'half_window': 3, 'max_distance': 3, 'num_buckets': 8,
                           'bucket_max_distance': 5, 'position_buckets': 4,
                           'max_relative_positions': 6}


@pytest.fixture
def small_options():
  """small_options(name, **extra) -> the variant's attention_kwargs with
  SMALL_ATTENTION_OPTIONS for the options it has, and `extra`."""
  from flaxformer_lite.attention import registry

  def options(name, **extra):
    defaults = registry.get(name).kwargs
    return {**{k: v for k, v in SMALL_ATTENTION_OPTIONS.items() if k in defaults}, **extra}
  return options


def _fmix32(x: int) -> int:
  """MurmurHash3's 32-bit finaliser on a python int (the published constants)."""
  x ^= x >> 16
  x = (x * 0x85EBCA6B) & 0xFFFFFFFF
  x ^= x >> 13
  x = (x * 0xC2B2AE35) & 0xFFFFFFFF
  return x ^ (x >> 16)


def _loop_keep(seed: int, rate: float, b: int, h: int, n: int, m: int):
  """bool [b, h, n, m]: attention dropout's keep bit of each weight, one at a
  time in python integers (the hash that dropout.py documents)."""
  keep = np.zeros((b, h, n, m), bool)
  for bi in range(b):
    for hi in range(h):
      head = _fmix32(seed ^ _fmix32((bi * h + hi + 0x9E3779B9) & 0xFFFFFFFF))
      for i in range(n):
        row = _fmix32((head + i * 0x9E3779B1) & 0xFFFFFFFF)
        for j in range(m):
          word = _fmix32(row ^ ((j * 0x85EBCA77) & 0xFFFFFFFF))
          keep[bi, hi, i, j] = word >= min(round(rate * 2**32), 2**32 - 1)
  return keep


@pytest.fixture
def loop_keep():
  """loop_keep(seed, rate, b, h, n, m) -> bool [b, h, n, m]: dropout's keep mask."""
  return _loop_keep


# A user's module, outside the package: a variant with an option of its own.
TILTED = '''
import dataclasses
import jax.numpy as jnp
from flaxformer_lite.attention import registry, scheme


@dataclasses.dataclass(frozen=True)
class Options:
  tilt: float = 0.5

  def __post_init__(self):
    registry.check_positive(self, 'tilt')


def terms(num_heads, *, tilt):
  return scheme.Terms(
      score=lambda s, b, h, q_pos, k_pos, tables: s - tilt * jnp.abs(q_pos - k_pos),
      additive=True)


registry.register(registry.AttentionVariant(name='tilted', terms=terms, options=Options,
                                            doc='s - tilt |i - j|'))
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  """user_module(NAME, SOURCE): a module importable by NAME, forgotten afterwards
  (with the variants it registers)."""
  monkeypatch.syspath_prepend(str(tmp_path))
  names = []

  def write(name, source):
    (tmp_path / f'{name}.py').write_text(source)
    names.append(name)
  before = set(registry.names())
  yield write
  for name in set(registry.names()) - before:
    registry._REGISTRY.pop(name)  # pylint: disable=protected-access
  for name in names:
    sys.modules.pop(name, None)


@pytest.fixture
def tilted_variant(user_module) -> str:
  """The name of a user's module that registers the variant 'tilted' (option
  `tilt`)."""
  user_module('tilted_variant', TILTED)
  return 'tilted_variant'
