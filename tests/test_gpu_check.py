"""benchmarks/gpu_check.sh: its calls fit a lent GPU machine's time by their
budgets, and the whole check runs end to end in its reduced form (--quick),
as a GPU machine runs each call in full."""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'benchmarks'))
import gpu_check  # noqa: E402

REPO = gpu_check.REPO


def test_the_calls_fit_a_lease_and_hold_every_section_once():
  calls = gpu_check.CALLS
  assert 1 <= len(calls) <= 3, calls
  in_calls = [name for sections in calls.values() for name in sections]
  assert sorted(in_calls) == sorted(gpu_check.RUNNERS), in_calls  # each section in one call
  for call, sections in calls.items():  # each call one command on the machine
    assert sum(sections.values()) + gpu_check.CALL_START_S < gpu_check.COMMAND_S, (call, sections)
  total = sum(sum(sections.values()) for sections in calls.values()) + gpu_check.OVERHEAD_S
  assert total < gpu_check.DEVICE_S <= 13 * 60, total


def test_a_command_past_its_deadline_is_stopped_with_its_children_and_its_lines_kept(tmp_path):
  """The sections' one way to run a child: at the deadline the whole process
  group goes (a grandchild holding the output too), and what it printed stays."""
  log, seen = tmp_path / 'log', []
  start = time.time()
  out, stopped, code = gpu_check._run_until(
      ['sh', '-c', 'echo one; sleep 60 & echo two; wait'], str(log), time.time() + 2,
      on_line=lambda line, _: seen.append(line))
  assert stopped and code == -signal.SIGKILL and time.time() - start < 10
  assert out.split() == seen == ['one', 'two']
  # a line can end it early, as the warm recipe run ends at its first step
  out, stopped, _ = gpu_check._run_until(
      ['sh', '-c', 'echo ready; sleep 60'], str(log), time.time() + 30,
      on_line=lambda line, _: line == 'ready')
  assert not stopped and time.time() - start < 20 and out == 'ready\n'


def test_the_table_on_disk_has_every_row_as_it_is_added(tmp_path):
  rows = gpu_check.Rows(str(tmp_path), 'a header', quick=True)
  rows.add('recipe', 'first step (s)', 1.5, 'target <= 30 s')
  assert json.loads((tmp_path / 'results.json').read_text())['rows'] == [
      ['recipe', 'first step (s)', '1.5', 'target <= 30 s']]
  rows.fail('mfu: stopped at the time limit (75 s)')
  assert '- failed: mfu: stopped' in (tmp_path / 'results.md').read_text()
  assert sorted(os.listdir(tmp_path)) == ['results.json', 'results.md']


def test_gpu_check_quick_runs_every_call_end_to_end(tmp_path, shared_data, tfds_dir):
  out = tmp_path / 'gpu'
  proc = subprocess.run(
      ['benchmarks/gpu_check.sh', '--quick', '--call', *map(str, gpu_check.CALLS),
       '--out', str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'FFL_SHARED_DATA': shared_data, 'TFDS_DATA_DIR': tfds_dir})
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
  results = json.loads((out / 'results.json').read_text())
  assert results['quick'] and not results['failed']
  rows = {(section, quantity): value for section, quantity, value, _ in results['rows']}
  sections = {section for section, _ in rows}
  # every section but tests (not with --quick); nanogpt and smollm2 say why they skip
  assert sections == set(gpu_check.SECTIONS) - {'tests'}, sections
  for name in gpu_check.SECTIONS:  # each within its budget
    took = next(line for line in proc.stdout.splitlines() if line.startswith(f'# {name}: '))
    assert int(took.split()[2]) <= gpu_check.BUDGETS[name], took
  # the second run of the recipe found every step it compiles in the cache
  assert float(rows['recipe', 'first step, empty cache (s after launch)']) > 0
  for cache in ('empty', 'warm'):  # the first step's own call, from its log line
    assert 0 < float(rows['recipe', f'  the step itself, {cache} cache (s)']) < float(
        rows['recipe', f'first step, {cache} cache (s after launch)'])
  served = rows['recipe', '  served by the cache']
  assert 'train step' in served and 'eval step' in served and 'greedy sample' in served, served
  # on CPU at n=64, auto takes the dense path
  kernels = [v for (s, q), v in rows.items() if s == 'kernels' and 'attention only' not in q]
  assert kernels and all(v.endswith('auto -> dense') for v in kernels), kernels
  # the Pallas kernel (interpreted here) plain and with the quick schemes, timed beside
  # XLA's attention; each scheme's time over the plain kernel's, with its target if it has one
  [(fused, anchor)] = [(v, t) for s, q, v, t in results['rows']
                       if s == 'kernels' and 'attention only' in q]
  assert 'failed' not in fused, fused
  timed = {cell.split(' (')[0].rsplit(' ', 1)[0] for cell in fused.split(' / ')}
  assert timed == {'pallas', 'xla', *(f'pallas {s}' for s in gpu_check.QUICK_FUSED)}, fused
  assert 'alibi ' in anchor and 'x plain' in anchor and 'shaw: x plain ' in anchor, anchor
  assert '<= 1.5' in anchor, anchor  # Shaw with values: at most 1.5x the plain kernel
  assert {'fwd+bwd: ours / Flax ms', 'MFU'} <= {q for s, q in rows if s in ('mha', 'mfu')}
  assert (out / 'results.md').read_text().count('\n| ') >= len(rows)


def test_failures_logged_as_they_happen_are_counted_by_cause(tmp_path, monkeypatch):
  """The suite's conftest appends each failure (test, phase, the raised line)
  to FFL_FAILURE_LOG; gpu_check's tests section ranks their causes."""
  from tests import conftest

  log = tmp_path / 'failures.txt'
  monkeypatch.setenv('FFL_FAILURE_LOG', str(log))
  raised = 'E   RuntimeError: no GPU kernel for this shape\ntests/a.py:3: RuntimeError'
  for node, when, text in [('tests/a.py::one', 'setup', raised),
                           ('tests/a.py::two', 'setup', raised),
                           ('tests/b.py::three', 'call', 'E   assert 1 == 2\nE    +  where'),
                           ('tests/b.py::passed', 'call', '')]:
    conftest.pytest_runtest_logreport(SimpleNamespace(
        nodeid=node, when=when, failed=node != 'tests/b.py::passed', skipped=False,
        longrepr=text, longreprtext=text))
  assert gpu_check._failure_causes(str(log)) == [
      ('E   RuntimeError: no GPU kernel for this shape', '2 tests, e.g. tests/a.py::one (setup)'),
      ('E   assert 1 == 2', '1 tests, e.g. tests/b.py::three (call)')]
  assert gpu_check._failure_causes(str(tmp_path / 'none.txt')) == []
