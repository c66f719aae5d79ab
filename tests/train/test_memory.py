"""The memory guard: its arithmetic on hand-computed cases, the host's
memory measured as steps of different sizes run under each malloc setting,
and a run that cannot fit stopping with exit 2 before its first step, its
checkpoints untouched."""
import json
import os
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite.train import loop, memory, preemption

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize('text,expected', [
    ('2GiB', 2 * GiB), ('500MiB', 500 * MiB), ('1.5GB', 1_500_000_000), ('123', 123),
    (' 4 kib ', 4096), ('2G', 2 * GiB), ('3mb', 3_000_000), ('1TiB', 2**40), ('7B', 7)])
def test_parse_size(text, expected):
  assert memory.parse_size(text) == expected


@pytest.mark.parametrize('text', ['lots', '-1GiB', '2 GiBs', '', 'GiB', '1e9'])
def test_parse_size_refuses_what_is_not_a_size(text):
  with pytest.raises(ValueError, match='not a size'):
    memory.parse_size(text)


def test_fmt_bytes():
  assert memory.fmt_bytes(512) == '512 B'
  assert memory.fmt_bytes(1536) == '1.5 KiB'
  assert memory.fmt_bytes(3 * GiB + 512 * MiB) == '3.5 GiB'


def test_meminfo_and_cgroup_texts():
  meminfo = 'MemTotal:       24576000 kB\nMemFree:  1000 kB\nMemAvailable:   8388608 kB\n'
  assert memory.meminfo_available(meminfo) == 8 * GiB
  assert memory.meminfo_available('MemTotal: 1 kB\n') is None
  assert memory.cgroup_limit('max\n') is None  # cgroup v2: no limit
  assert memory.cgroup_limit('9223372036854771712\n') is None  # v1: no limit
  assert memory.cgroup_limit('4294967296\n') == 4 * GiB


def _files(tmp_path, meminfo_kib, cgroup_v2=None, cgroup_v1=None):
  """Fake /proc/meminfo and cgroup limit files; a None limit file does not exist."""
  meminfo = tmp_path / 'meminfo'
  meminfo.write_text(f'MemTotal: 99999999 kB\nMemAvailable: {meminfo_kib} kB\n')
  cgroups = []
  for name, text in (('memory.max', cgroup_v2), ('memory.limit_in_bytes', cgroup_v1)):
    path = tmp_path / name
    if text is not None:
      path.write_text(text)
    cgroups.append(str(path))
  return str(meminfo), cgroups


def test_host_available_is_the_smaller_of_meminfo_and_the_cgroup_limit(tmp_path):
  meminfo, cgroups = _files(tmp_path, 8 * 2**20, cgroup_v2=f'{4 * GiB}\n')
  assert memory.host_available(meminfo, cgroups) == (4 * GiB, f'cgroup limit, {cgroups[0]}')
  meminfo, cgroups = _files(tmp_path, 2 * 2**20, cgroup_v2=f'{4 * GiB}\n')
  assert memory.host_available(meminfo, cgroups) == (2 * GiB, f'MemAvailable, {meminfo}')
  meminfo, cgroups = _files(tmp_path, 8 * 2**20, cgroup_v2='max\n',
                            cgroup_v1=f'{3 * GiB}\n')
  assert memory.host_available(meminfo, cgroups)[0] == 3 * GiB
  os.remove(meminfo)
  assert memory.host_available(meminfo, cgroups)[0] == 3 * GiB
  assert memory.host_available(meminfo, []) == (None, '')


def test_available_prefers_the_environment_then_the_accelerator(monkeypatch):
  gpu = types.SimpleNamespace(platform='gpu', device_kind='H100',
                              memory_stats=lambda: {'bytes_limit': 60 * GiB})
  assert memory.available(gpu, {'FFL_MEMORY_LIMIT': '2GiB'}) == (2 * GiB, 'FFL_MEMORY_LIMIT')
  assert memory.available(gpu, {}) == (60 * GiB, 'H100 bytes_limit')
  cpu = types.SimpleNamespace(platform='cpu', memory_stats=lambda: None)
  # the host's figure (fixed here: MemAvailable moves while other tests run)
  monkeypatch.setattr(memory, 'host_available', lambda *a: (5 * GiB, 'MemAvailable, here'))
  assert memory.available(cpu, {}) == (5 * GiB, 'MemAvailable, here')
  with pytest.raises(config_lib.ConfigError, match="FFL_MEMORY_LIMIT: 'much' is not a size"):
    memory.available(cpu, {'FFL_MEMORY_LIMIT': 'much'})


def test_step_bytes_counts_a_donated_buffer_once():
  stats = types.SimpleNamespace(temp_size_in_bytes=100, argument_size_in_bytes=50,
                                output_size_in_bytes=30, alias_size_in_bytes=20)
  assert memory.step_bytes(stats) == 160


def test_check_logs_a_run_that_fits_and_refuses_one_that_does_not():
  needs = {'train step, batch 8x16': 3 * MiB, 'eval step, batch 4x64': 5 * MiB}
  lower, remat = {'train.batch_size': 8, 'eval.batch_tokens': 256, 'data.max_len': 16}, 'none'
  line = memory.check(needs, 6 * MiB, 'MemAvailable', lower, remat)
  assert line.startswith('Memory: peak about 5.0 MiB of 6.0 MiB available (MemAvailable)')
  assert 'train step, batch 8x16 3.0 MiB' in line
  assert memory.check(needs, None, '', lower, remat).startswith('Memory: peak about 5.0 MiB')
  with pytest.raises(config_lib.ConfigError) as e:
    memory.check(needs, 4 * MiB, 'FFL_MEMORY_LIMIT', lower, remat)
  text = str(e.value)
  assert 'about 5.0 MiB at its peak (eval step, batch 4x64)' in text
  assert '4.0 MiB is available (FFL_MEMORY_LIMIT)' in text
  for option in ('train.batch_size (now 8)', 'eval.batch_tokens (now 256)',
                 'data.max_len (now 16)', "model.remat='block' (now 'none'"):
    assert option in text
  assert 'model.remat' not in memory.message(needs, 4 * MiB, '', lower, 'block')


def test_the_peak_adds_the_other_steps_kept_temp_buffers():
  needs = {'train step': 3 * MiB, 'eval step': 5 * MiB, 'sample': 1 * MiB}
  kept = {'train step': 2 * MiB, 'eval step': 4 * MiB, 'sample': MiB // 2}
  assert memory.peak(needs) == (5 * MiB, 'eval step')
  total, what = memory.peak(needs, kept)  # 5 + 2 + 0.5: the eval step's own buffer once
  assert total == 7.5 * MiB and what.startswith('eval step, plus 2.5 MiB of the other steps')
  lower, remat = {'train.batch_size': 8}, 'block'
  assert memory.check(needs, 8 * MiB, 'here', lower, remat, kept).startswith(
      'Memory: peak about 7.5 MiB of 8.0 MiB available (here)')
  with pytest.raises(config_lib.ConfigError, match=r'about 7\.5 MiB at its peak \(eval step, '
                     r'plus 2\.5 MiB'):
    memory.check(needs, 7 * MiB, 'here', lower, remat, kept)
  assert memory.heap_keeps_temps({'MALLOC_MMAP_THRESHOLD_': str(4 * GiB)})
  for environ in ({}, {'MALLOC_MMAP_THRESHOLD_': str(1 * MiB)}, {'MALLOC_MMAP_THRESHOLD_': 'x'}):
    assert not memory.heap_keeps_temps(environ)
    assert memory.kept_by_heap(kept, environ) is None
  # A buffer at or above the threshold is mapped and returned: kept, the one below.
  environ = {'MALLOC_MMAP_THRESHOLD_': str(64 * MiB)}
  assert memory.kept_by_heap({'a': 64 * MiB, 'b': 63 * MiB}, environ) == {'b': 63 * MiB}
  assert memory.kept_by_heap({'a': 64 * MiB}, environ) is None


def test_the_host_estimate_adds_what_the_process_holds_beside_its_steps(tmp_path):
  """By hand: steps of 4 and 2 GiB whose temp buffers (2 and 1 GiB) the heap
  keeps; the process holds 3 GiB before its first step, 1 GiB of it the
  state the steps count as arguments; a checkpoint copies 1 GiB. Peak:
  4 (train) + 1 (eval's kept buffer) + (3 - 1) + 1 = 8 GiB."""
  status = tmp_path / 'status'
  status.write_text('Name:\tpython\nVmHWM:\t 4000 kB\nVmRSS:\t 3145728 kB\n')
  rss = memory.process_rss(str(status))
  assert rss == 3 * GiB and memory.process_rss(str(tmp_path / 'none')) is None
  host = memory.host_terms(rss, state=1 * GiB, saved=1 * GiB)
  assert sorted(host.values()) == [1 * GiB, 2 * GiB]
  needs, kept = {'train step': 4 * GiB, 'eval step': 2 * GiB}, {'train step': 2 * GiB,
                                                                 'eval step': 1 * GiB}
  lower = {'train.batch_size': 8}
  line = memory.check(needs, 8 * GiB, 'here', lower, 'block', kept, host)
  assert line.startswith('Memory: peak about 8.0 GiB of 8.0 GiB available (here)'), line
  assert "a checkpoint's host copy of the state 1.0 GiB" in line
  with pytest.raises(config_lib.ConfigError) as e:
    memory.check(needs, 8 * GiB - 1, 'here', lower, 'block', kept, host)
  assert 'needs about 8.0 GiB at its peak (train step, plus 1.0 GiB of the other' in str(e.value)
  assert 'held before the first step (interpreter, JAX, data, weights as loaded) 2.0' in str(e.value)


def test_the_estimate_before_loading_counts_each_copy_of_the_weights():
  """By hand: 0.25 GiB of process, 0.5 GiB of parameters, 1 GiB of Adam
  moments, a checkpoint's copy of both (1.5), the pretrained tensors as
  read (0.5): 3.75 GiB."""
  terms = memory.before_loading(GiB // 4, GiB // 2, GiB, pretrained=True)
  assert sum(terms.values()) == 3.75 * GiB
  assert sum(memory.before_loading(GiB // 4, GiB // 2, GiB, pretrained=False).values()) == \
      3.25 * GiB
  lower = {'model.init_from': 'smollm2'}
  assert memory.check_before_loading(terms, 4 * GiB, 'here', lower).startswith(
      'Memory: at least 3.8 GiB of 4.0 GiB available (here) before the steps')
  assert memory.check_before_loading(terms, None, '', lower) is None
  with pytest.raises(config_lib.ConfigError, match=r"at least 3\.8 GiB .* but 3\.5 GiB is "
                     r"available \(here\).* Lower model\.init_from \(now 'smollm2'\)"):
    memory.check_before_loading(terms, 3.5 * GiB, 'here', lower)


def test_launch_refuses_a_run_above_the_limit_before_reading_data(tmp_path):
  """Through ./launch.sh, a run whose shapes alone exceed FFL_MEMORY_LIMIT
  exits 2 naming the limit before any data is read: a new workdir is never
  made, and an existing one (a saved checkpoint, metrics) is left as it was."""
  kept = tmp_path / 'kept'
  (kept / 'checkpoints' / '5').mkdir(parents=True)
  (kept / 'checkpoints' / '5' / 'state').write_bytes(b'saved')
  (kept / 'metrics.jsonl').write_text('{"step": 5}\n')
  before = {p: p.read_bytes() for p in kept.rglob('*') if p.is_file()}
  env = dict(os.environ, FFL_PYTHON=sys.executable, FFL_MEMORY_LIMIT='100MiB')
  for workdir in (tmp_path / 'new', kept):
    done = subprocess.run(
        ['bash', 'launch.sh', '--config.model.vocab_size=20', '--config.model.d_model=16',
         '--config.model.num_heads=2', '--config.model.mlp_dim=32', f'--workdir={workdir}'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert '100.0 MiB is available (FFL_MEMORY_LIMIT)' in done.stderr, done.stderr[-3000:]
    assert 'Lower model.d_model (now 16)' in done.stderr and 'data:' not in done.stdout
  assert not (tmp_path / 'new').exists()
  assert {p: p.read_bytes() for p in kept.rglob('*') if p.is_file()} == before


# What the child processes below share: their peak resident memory (VmHWM).
_HWM = """
import json, jax, jax.numpy as jnp
from flaxformer_lite.train import loop, memory
def hwm():
  return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
"""
OTHER_ALLOCATIONS = 16 * MiB  # the runtime's own, beside the steps' buffers
LAUNCH_MALLOC = dict(MALLOC_ARENA_MAX='1', MALLOC_MMAP_THRESHOLD_=str(GiB),
                     MALLOC_TRIM_THRESHOLD_=str(8 * GiB))  # launch.sh's settings


def _child(script, **malloc):
  """The JSON that `script` (after _HWM) prints last, run in a fresh process
  with XLA's default optimisation (the suite's -O0 makes its work several
  times slower) and glibc's malloc settings `malloc` alone."""
  environ = {k: v for k, v in os.environ.items()
             if k != 'XLA_FLAGS' and not k.startswith('MALLOC_')}
  done = subprocess.run([sys.executable, '-c', _HWM + script], cwd=REPO,
                        env=dict(environ, **malloc), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


# A child process compiles three steps whose temp buffers are their only
# large allocations (a sort of a cumulative sum: XLA assigns both), runs
# each once, smallest first, keeping their outputs (1 MiB each) as a run
# keeps its state and metrics, and reports the growth of its peak resident
# memory (VmHWM) over the three calls.
_STEPS = """
def step(rows):
  def f(seed):
    x = jnp.sin(seed + jnp.arange(rows * 1024, dtype=jnp.float32)).reshape(rows, 1024)
    y = jnp.sort(jnp.cumsum(x, axis=0), axis=1)
    return y[::2][:256] * y[1::2][:256]
  return jax.jit(f).lower(jnp.float32(0)).compile()
steps = {f'{rows} rows': step(rows) for rows in (4096, 8192, 12288)}
stats = {name: c.memory_analysis() for name, c in steps.items()}
start = hwm()
outputs = [jax.block_until_ready(c(jnp.float32(1))) for c in steps.values()]
print(json.dumps({'growth': hwm() - start,
                  'needs': {k: memory.step_bytes(s) for k, s in stats.items()},
                  'kept': {k: s.temp_size_in_bytes for k, s in stats.items()}}))
"""


def test_the_peak_bounds_the_measured_growth_under_each_malloc_setting():
  """Under launch.sh's malloc settings a step's freed buffer stays in the
  process, and a larger step cannot reuse it while a later allocation sits
  above it: the process outgrows its largest step (by one, two or all of the
  smaller buffers, from run to run), and memory.peak, which adds them all,
  bounds it. Under glibc's defaults each buffer is mapped and returned: the
  largest step is the peak."""
  for malloc in (LAUNCH_MALLOC, {}):
    got = _child(_STEPS, **malloc)
    largest = max(got['needs'].values())
    assert min(got['kept'].values()) > 2 * OTHER_ALLOCATIONS, got  # the buffers dominate
    if memory.heap_keeps_temps(malloc):
      estimate = memory.peak(got['needs'], got['kept'])[0]
      assert largest + OTHER_ALLOCATIONS < got['growth'] <= estimate + OTHER_ALLOCATIONS, got
    else:
      assert got['growth'] <= largest + OTHER_ALLOCATIONS, got


# A step whose intermediates XLA:CPU hands to a library fusion (two products
# with a tanh between them): the child reports what its buffer assignment
# says, what the guard's analysis says, and how far the one call grows the
# process (VmHWM; its argument is allocated before).
_FUSED = """
x = jnp.full((4096, 4096), 1e-3, jnp.float32)
lowered = jax.jit(lambda x: jnp.sum(jnp.tanh(jnp.tanh(x @ x) @ x))).lower(x)
compiled = lowered.compile()
temp = lambda s: s.temp_size_in_bytes + s.output_size_in_bytes
assigned, guarded = temp(compiled.memory_analysis()), temp(loop._analysis(lowered, compiled, 1))
start = hwm()
jax.block_until_ready(compiled(x))
print(json.dumps({'assigned': assigned, 'guarded': guarded, 'growth': hwm() - start}))
"""


def test_the_guard_counts_the_buffers_of_library_fusions():
  """XLA's assignment of the default compilation leaves out the library
  fusions' buffers (the process grows past it); the guard's analysis,
  which also reads the step compiled without them, bounds the growth."""
  got = _child(_FUSED, **LAUNCH_MALLOC)
  assert got['growth'] > got['assigned'] + OTHER_ALLOCATIONS, got
  assert got['growth'] <= got['guarded'] + OTHER_ALLOCATIONS, got


def test_a_run_that_cannot_fit_exits_2_before_training_and_keeps_its_checkpoints(
    tiny_config, tmp_path):
  """A run to step 10, then the same experiment resumed to step 20 under a
  limit it cannot fit: exit 2 with the estimate and what to lower, no step
  trained, checkpoints and metrics.jsonl as they were."""
  experiment = tmp_path / 'tiny.py'
  experiment.write_text('from flaxformer_lite import config\n\n\ndef get_config():\n'
                        f'  return config.from_json({config_lib.to_json(tiny_config)!r})\n')
  workdir = tmp_path / 'run'
  tiny_config.train.num_steps = 10
  loop.train_and_evaluate(tiny_config, str(workdir))

  def snapshot():
    files = sorted(p for p in workdir.rglob('*') if p.is_file() and p.name != 'config.json')
    return {str(p.relative_to(workdir)): (p.stat().st_mtime_ns, p.read_bytes()) for p in files}

  before = snapshot()
  assert any(name.startswith('checkpoints/10/') for name in before)
  proc = subprocess.run(
      [sys.executable, '-m', 'flaxformer_lite.main', f'--config={experiment}',
       f'--workdir={workdir}', '--config.train.num_steps=20'],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, FFL_MEMORY_LIMIT='64KiB'))
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'Resumed from' in proc.stdout and 'step 20/20' not in proc.stdout
  error = proc.stderr[proc.stderr.index('error: '):]
  assert 'this run needs about' in error and '64.0 KiB is available (FFL_MEMORY_LIMIT)' in error
  for option in ('train.batch_size (now 16)', 'eval.batch_size (now 20)', 'data.max_len (now 6)',
                 "model.remat='block'"):
    assert option in error
  assert snapshot() == before


def test_a_new_run_that_cannot_fit_leaves_no_workdir(tiny_config, tmp_path, monkeypatch):
  """Refused before its first step, a new run takes back what it wrote
  (config.json, an empty checkpoints/), and the folder it made; a folder the
  user made stays, empty."""
  monkeypatch.setenv('FFL_MEMORY_LIMIT', '64KiB')
  made = tmp_path / 'made_by_the_user'
  made.mkdir()
  for workdir in (tmp_path / 'new', made):
    with pytest.raises(config_lib.ConfigError, match='64.0 KiB is available'):
      loop.train_and_evaluate(config_lib.from_json(config_lib.to_json(tiny_config)),
                              str(workdir))
  assert not (tmp_path / 'new').exists()
  assert made.is_dir() and not list(made.iterdir())


def test_a_signal_during_the_guards_second_compile_stops_the_run(monkeypatch):
  """The guard's compile without library fusions (a step near the limit: here
  any, against 1 byte) answers a pending signal as the run's other compiles
  do, instead of when it ends (here: never, within the test)."""
  compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(jnp.ones((64, 64), jnp.float32)).compile()
  unending = types.SimpleNamespace(compile=lambda options: threading.Event().wait(60))
  monkeypatch.setattr(preemption, '_active', types.SimpleNamespace(requested='SIGTERM'))
  with pytest.raises(preemption.Preempted, match='SIGTERM'):
    loop._analysis(unending, compiled, 1)
