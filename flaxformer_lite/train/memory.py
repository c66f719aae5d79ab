"""The memory guard's arithmetic: what a run's steps need, what the machine has.

train/loop.py compiles the train step and the eval steps before the first
step and reads XLA's buffer assignment of each (`compiled.memory_analysis()`);
a run whose peak would not fit stops there (ConfigError, exit 2) instead
of being killed for memory after hours of training. The peak is the largest
step's, plus the other steps' temp buffers on a host whose heap keeps them
(`heap_keeps_temps`: under launch.sh's malloc settings). On CPU a step
near the limit is also compiled without the library fusions whose buffers
XLA's assignment leaves out (WITHOUT_LIBRARY_FUSIONS), and the larger
estimate kept. On CPU the steps share the host with the rest of the process:
what it holds before its first step (its resident memory: the interpreter,
JAX, the data, the weights as loaded) and a checkpoint's host copy of the
state are added (`host_terms`). Before any data or weights are read, a run
whose parameters, optimizer state and their copies alone would not fit stops
(`before_loading`). The memory available is the device's on an accelerator (its
allocator's `bytes_limit`), the host's on CPU (/proc/meminfo MemAvailable,
or the cgroup's limit if lower), or FFL_MEMORY_LIMIT (`2GiB`, `500MiB`,
bytes) where it is set.
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


# glibc's malloc serves a block below its mmap threshold from its heap, and
# keeps it there once freed for a later request that fits. launch.sh raises
# the threshold (XLA:CPU's temp buffers are then not faulted in afresh at
# every call), so each step's temp buffer stays in the process after the
# step, and a larger step cannot reuse a smaller one's while a later block
# sits above it: the process grows past its largest step, by as much as the
# other steps' temp buffers (tests/train/test_memory.py measures it).
# glibc's own threshold rises to at most 32 MiB on 64-bit systems; above that
# the setting is someone's choice.
GLIBC_MAX_MMAP_THRESHOLD = 32 * 2**20


def heap_keeps_temps(environ=None) -> bool:
  """Whether the steps' temp buffers stay in this process after each step
  (above): MALLOC_MMAP_THRESHOLD_ set above glibc's own largest."""
  value = (os.environ if environ is None else environ).get('MALLOC_MMAP_THRESHOLD_', '')
  return value.isdigit() and int(value) > GLIBC_MAX_MMAP_THRESHOLD


def kept_by_heap(temps: dict[str, int], environ=None) -> dict[str, int] | None:
  """{step: bytes} of the steps' temp buffers `temps` {step: bytes} that the
  heap keeps (heap_keeps_temps): those below MALLOC_MMAP_THRESHOLD_, since
  glibc maps a larger block and returns it on free. None where it keeps none."""
  if not heap_keeps_temps(environ):
    return None
  threshold = int((os.environ if environ is None else environ)['MALLOC_MMAP_THRESHOLD_'])
  return {step: n for step, n in temps.items() if n < threshold} or None


# XLA:CPU hands chains of operations to a library (YNNPACK, XNNPACK) whose
# buffers its buffer assignment does not see: a step can use more than
# memory_analysis() says (tests/train/test_memory.py measures one). Compiled
# without those fusions, the same step's assignment counts those buffers.
WITHOUT_LIBRARY_FUSIONS = {'xla_cpu_experimental_ynn_fusion_type': '',
                           'xla_cpu_use_xnnpack': False}


def process_rss(status: str = '/proc/self/status') -> int | None:
  """Bytes this process holds in memory now (VmRSS); None where the file
  cannot be read (not Linux)."""
  try:
    with open(status) as f:
      match = re.search(r'^VmRSS:\s*(\d+)\s*kB', f.read(), re.MULTILINE)
  except OSError:
    return None
  return int(match.group(1)) * 1024 if match else None


def host_terms(rss: int, state: int, saved: int) -> dict[str, int]:
  """{what: bytes} a CPU run holds beside its steps' peaks, all on the host.

  rss: what the process holds now, before its first step: the interpreter,
    JAX, the data, the weights as loaded and converted, the train state
    placed. The steps' peaks count the state again (their arguments), so
    the rest is rss - state.
  state: the train state's bytes (parameters and optimizer moments) the
    steps' peaks hold as arguments.
  saved: the host copy of the state a checkpoint makes while it is written,
    which overlaps the next step (orbax's asynchronous save).
  """
  terms = {'held before the first step (interpreter, JAX, data, weights as loaded)':
           max(rss - state, 0), "a checkpoint's host copy of the state": saved}
  return {what: n for what, n in terms.items() if n}


def before_loading(rss: int, params: int, optimizer: int, pretrained: bool) -> dict[str, int]:
  """{what: bytes} a run will hold at least, known before its data and
  weights are read: the process now (`rss`), the parameters (`params`,
  bytes), the optimizer's moments (`optimizer`, bytes), a checkpoint's host
  copy of both, and, loading a pretrained checkpoint, its tensors as read
  and converted (one more copy of the parameters) while they are put in
  place. The steps' activations come on top (`check` after compiling)."""
  terms = {'the process now (interpreter, JAX)': rss, 'parameters': params,
           'optimizer state': optimizer, "a checkpoint's host copy": params + optimizer}
  if pretrained:
    terms['the pretrained tensors as read, while put in place'] = params
  return {what: n for what, n in terms.items() if n}


def step_bytes(stats) -> int:
  """Bytes one call of a compiled step holds at its peak, from
  `compiled.memory_analysis()`: its temporaries, arguments and outputs, an
  output that reuses a donated argument's buffer (the train state) counted once."""
  return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
          + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def peak(needs: dict[str, int], kept: dict[str, int] | None = None) -> tuple[int, str]:
  """(bytes, what they are) of the run's peak: the largest of `needs` {step:
  bytes at its peak}, plus the other steps' temp buffers `kept` {step:
  bytes}, which the caller passes where the heap keeps them
  (heap_keeps_temps) and leaves None elsewhere."""
  name = max(needs, key=needs.get)
  others = sum(n for step, n in (kept or {}).items() if step != name)
  if not others:
    return needs[name], name
  return needs[name] + others, (f"{name}, plus {fmt_bytes(others)} of the other steps' temp "
                                'buffers, which the heap keeps (MALLOC_MMAP_THRESHOLD_)')


def message(needs: dict[str, int], limit: int, source: str, lower: dict, remat: str,
            kept: dict[str, int] | None = None, host: dict[str, int] | None = None) -> str:
  """The error of a run that cannot fit: needs {step: bytes at its peak},
  kept (`peak`), host (`check`), the limit and where it comes from, lower
  {config key: value} the settings that shrink the steps, remat the
  model.remat setting."""
  total, what = peak(needs, kept)
  if host:
    total += sum(host.values())
    what += ', plus ' + summary(host)
  keys = ', '.join(f'{k} (now {v!r})' for k, v in lower.items())
  recompute = '' if remat == 'block' else (
      f", or set model.remat='block' (now {remat!r}: recomputes activations in the backward)")
  return (f'this run needs about {fmt_bytes(total)} at its peak ({what}) but '
          f'{fmt_bytes(limit)} is available ({source}); it would be killed for memory '
          f'before it ends. Steps: {summary(needs)}. Lower {keys}{recompute}, or set '
          f'{LIMIT_ENV} to the memory this run may really use. Nothing was trained and no '
          'checkpoint was touched.')


def summary(needs: dict[str, int]) -> str:
  """'train step 1.2 GiB, eval step ... 300.0 MiB': each step's peak."""
  return ', '.join(f'{name} {fmt_bytes(n)}' for name, n in needs.items())


def check(needs: dict[str, int], limit: int | None, source: str, lower: dict,
          remat: str, kept: dict[str, int] | None = None,
          host: dict[str, int] | None = None) -> str:
  """The start-up line (the run's `peak`, plus the `host` terms {what:
  bytes} it holds beside its steps (`host_terms`), against the limit);
  raises ConfigError (`message`) when that is above a known limit."""
  total = peak(needs, kept)[0] + sum((host or {}).values())
  if limit is not None and total > limit:
    raise ConfigError(message(needs, limit, source, lower, remat, kept, host))
  where = f' of {fmt_bytes(limit)} available ({source})' if limit is not None else \
      ' (memory available unknown)'
  return f'Memory: peak about {fmt_bytes(total)}{where}; {summary({**needs, **(host or {})})}'


def check_before_loading(terms: dict[str, int], limit: int | None, source: str,
                         lower: dict) -> str | None:
  """ConfigError when the bytes a run will hold at least (`before_loading`'s
  terms) are above a known limit, naming them and the `lower` {config key:
  value} that shrink them; else the log line (None without a limit)."""
  total = sum(terms.values())
  if limit is None:
    return None
  keys = ', '.join(f'{k} (now {v!r})' for k, v in lower.items())
  if total > limit:
    raise ConfigError(
        f'this run needs at least {fmt_bytes(total)} ({summary(terms)}) before its steps, '
        f'but {fmt_bytes(limit)} is available ({source}); it would be killed for memory. '
        f'Lower {keys}, or set {LIMIT_ENV} to the memory this run may really use. Nothing '
        'was loaded or trained and no checkpoint was touched.')
  return (f'Memory: at least {fmt_bytes(total)} of {fmt_bytes(limit)} available ({source}) '
          f'before the steps; {summary(terms)}')
