"""The memory guard's arithmetic: what a run's steps need, what the machine has.

train/loop.py compiles the train step and the eval steps before the first
step and reads XLA's buffer assignment of each (`compiled.memory_analysis()`);
a run whose largest step would not fit stops there (ConfigError, exit 2)
instead of being killed for memory after hours of training. The memory
available is the device's on an accelerator (its allocator's `bytes_limit`),
the host's on CPU (/proc/meminfo MemAvailable, or the cgroup's limit if
lower), or FFL_MEMORY_LIMIT (`2GiB`, `500MiB`, bytes) where it is set.
"""
from __future__ import annotations

import os
import re

from flaxformer_lite.config import ConfigError

LIMIT_ENV = 'FFL_MEMORY_LIMIT'
MEMINFO = '/proc/meminfo'
# cgroup v2, then v1: the limit of the container the process runs in.
CGROUP_LIMITS = ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes')
# cgroup v1 writes "no limit" as the largest page-aligned int64.
_UNLIMITED = 1 << 60
_UNITS = {'': 1, 'b': 1, 'kb': 10**3, 'mb': 10**6, 'gb': 10**9, 'tb': 10**12,
          'k': 2**10, 'm': 2**20, 'g': 2**30, 't': 2**40,
          'kib': 2**10, 'mib': 2**20, 'gib': 2**30, 'tib': 2**40}


def parse_size(text: str) -> int:
  """'2GiB', '500MiB', '1.5GB', '123' -> bytes (int).

  KiB/MiB/GiB/TiB and K/M/G/T are powers of 1024, KB/MB/GB/TB of 1000, no
  unit is bytes; case and spaces do not matter. ValueError otherwise.
  """
  match = re.fullmatch(r'\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*', str(text))
  unit = match and match.group(2).lower()
  if not match or unit not in _UNITS:
    raise ValueError(f'{text!r} is not a size; e.g. 2GiB, 500MiB, 1.5GB or a number of bytes')
  return int(float(match.group(1)) * _UNITS[unit])


def fmt_bytes(n: float) -> str:
  """1536 -> '1.5 KiB'; powers of 1024, one decimal."""
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if abs(n) < 1024:
      return f'{n:.0f} B' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TiB'


def meminfo_available(text: str) -> int | None:
  """/proc/meminfo's text -> MemAvailable in bytes (None if it has no such line)."""
  match = re.search(r'^MemAvailable:\s*(\d+)\s*kB', text, re.MULTILINE)
  return int(match.group(1)) * 1024 if match else None


def cgroup_limit(text: str) -> int | None:
  """A cgroup memory limit file's text ('max', or bytes) -> bytes; None = no limit."""
  text = text.strip()
  if not text.isdigit() or int(text) >= _UNLIMITED:
    return None
  return int(text)


def host_available(meminfo: str = MEMINFO, cgroup_files=CGROUP_LIMITS):
  """(bytes, where from): the smallest of MemAvailable and the cgroup limits
  that can be read; (None, '') when none can."""
  found = []
  readers = [(meminfo, meminfo_available, 'MemAvailable')]
  readers += [(path, cgroup_limit, 'cgroup limit') for path in cgroup_files]
  for path, parse, what in readers:
    try:
      with open(path) as f:
        value = parse(f.read())
    except OSError:
      continue
    if value is not None:
      found.append((value, f'{what}, {path}'))
  return min(found) if found else (None, '')


def available(device, environ=None):
  """(bytes, where from) that one of `device`'s kind may use: FFL_MEMORY_LIMIT
  if set, else an accelerator's bytes_limit, else the host's (host_available).
  ConfigError for an FFL_MEMORY_LIMIT that is not a size."""
  environ = os.environ if environ is None else environ
  if environ.get(LIMIT_ENV):
    try:
      return parse_size(environ[LIMIT_ENV]), LIMIT_ENV
    except ValueError as e:
      raise ConfigError(f'{LIMIT_ENV}: {e}') from None
  if device.platform != 'cpu':
    stats = device.memory_stats() or {}
    if 'bytes_limit' in stats:
      return int(stats['bytes_limit']), f'{device.device_kind} bytes_limit'
  return host_available()


def step_bytes(stats) -> int:
  """Bytes one call of a compiled step holds at its peak, from
  `compiled.memory_analysis()`: its temporaries, arguments and outputs, an
  output that reuses a donated argument's buffer (the train state) counted once."""
  return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
          + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def message(needs: dict[str, int], limit: int, source: str, lower: dict, remat: str) -> str:
  """The error of a run that cannot fit: needs {step: bytes at its peak},
  the limit and where it comes from, lower {config key: value} the settings
  that shrink the steps, remat the model.remat setting."""
  name = max(needs, key=needs.get)
  keys = ', '.join(f'{k} (now {v!r})' for k, v in lower.items())
  recompute = '' if remat == 'block' else (
      f", or set model.remat='block' (now {remat!r}: recomputes activations in the backward)")
  return (f'this run needs about {fmt_bytes(needs[name])} at its peak ({name}) but '
          f'{fmt_bytes(limit)} is available ({source}); it would be killed for memory '
          f'before it ends. Steps: {summary(needs)}. Lower {keys}{recompute}, or set '
          f'{LIMIT_ENV} to the memory this run may really use. Nothing was trained and no '
          'checkpoint was touched.')


def summary(needs: dict[str, int]) -> str:
  """'train step 1.2 GiB, eval step ... 300.0 MiB': each step's peak."""
  return ', '.join(f'{name} {fmt_bytes(n)}' for name, n in needs.items())


def check(needs: dict[str, int], limit: int | None, source: str, lower: dict,
          remat: str) -> str:
  """The start-up line (the largest step's peak against the limit); raises
  ConfigError (`message`) when that peak is above a known limit."""
  if limit is not None and max(needs.values()) > limit:
    raise ConfigError(message(needs, limit, source, lower, remat))
  peak = max(needs.values())
  where = f' of {fmt_bytes(limit)} available ({source})' if limit is not None else \
      ' (memory available unknown)'
  return f'Memory: peak about {fmt_bytes(peak)}{where}; {summary(needs)}'
