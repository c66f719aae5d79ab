"""benchmarks/gpu_check.sh end to end in its reduced form (--quick), as a GPU
machine runs it in full: every section runs and lands in one table."""
import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_quick_runs_every_section_and_writes_its_table(tmp_path, shared_data, tfds_dir):
  out = tmp_path / 'gpu'
  proc = subprocess.run(
      ['benchmarks/gpu_check.sh', '--quick', '--out', str(out), '--budget', '400'],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'FFL_SHARED_DATA': shared_data, 'TFDS_DATA_DIR': tfds_dir})
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
  results = json.loads((out / 'results.json').read_text())
  assert results['quick'] and not results['failed']
  rows = {(section, quantity): value for section, quantity, value, _ in results['rows']}
  sections = {section for section, _ in rows}
  assert {'compile', 'recipe', 'kernels', 'mfu', 'mha'} <= sections, sections
  # the recipe's programs compiled under the project's XLA settings, with a step time
  compiled = [v for (s, _), v in rows.items() if s == 'compile']
  assert len(compiled) == 1 and all(float(v.split('; ')[1]) > 0 for v in compiled), compiled
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
  # the Pallas kernel (interpreted here) timed beside XLA's attention
  fused = [v for (s, q), v in rows.items() if s == 'kernels' and 'attention only' in q]
  assert len(fused) == 1 and all(f'{k} ' in fused[0] for k in ('pallas', 'pallas alibi', 'xla'))
  assert 'failed' not in fused[0], fused
  assert (out / 'results.md').read_text().count('\n| ') >= len(rows)


def test_failures_logged_as_they_happen_are_counted_by_cause(tmp_path, monkeypatch):
  """The suite's conftest appends each failure (test, phase, the raised line)
  to FFL_FAILURE_LOG; gpu_check's tests section ranks their causes."""
  import sys
  from types import SimpleNamespace

  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import gpu_check
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
