"""The memory guard: its arithmetic on hand-computed cases, and a run that
cannot fit stopping with exit 2 before its first step, its checkpoints untouched."""
import os
import subprocess
import sys
import types

import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite.train import loop, memory

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
