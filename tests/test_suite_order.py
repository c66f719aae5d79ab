"""The suite's own machinery (tests/conftest.py): its order for pytest-xdist,
checked against xdist's own work-stealing scheduler (what each worker is
handed first), and FFL_TEST_CPU_LOG's seconds against those a test burned."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests import conftest

worksteal = pytest.importorskip('xdist.scheduler.worksteal')


def _items():
  """A collection shaped like the suite's: light files around the slow ones
  and the shared compilations, in pytest's (alphabetical) order."""
  items = []
  for path in ('tests/attention/test_a.py', *conftest.SHARED_FIRST, 'tests/layers/test_b.py',
               *sorted(conftest.SLOW_FIRST), 'tests/test_c.py', 'tests/train/test_d.py'):
    for i in range(7):
      fixtures = ['trained'] if path in conftest.SHARED_FIRST and i % 2 else []
      items.append(SimpleNamespace(nodeid=f'{path}::test_{i}', fixturenames=fixtures))
  return items


class _Node:
  def __init__(self, name):
    self.gateway, self.shutting_down, self.got = SimpleNamespace(id=name), False, []

  def send_runtest_some(self, indices):
    self.got += indices


@pytest.mark.parametrize('workers', [2, 3, 4])
def test_each_worker_starts_on_slow_files_and_one_gets_the_shared_compilations(workers):
  items = _items()
  order = conftest._dealt(sorted(items, key=conftest._order), workers)
  assert sorted(i.nodeid for i in order) == sorted(i.nodeid for i in items)

  config = SimpleNamespace(getvalue=lambda name: [f'{workers}*popen'] if name == 'tx' else None)
  scheduler = worksteal.WorkStealingScheduling(config)
  nodes = [_Node(f'gw{i}') for i in range(workers)]
  ids = [i.nodeid for i in order]
  for node in nodes:
    scheduler.add_node(node)
    scheduler.add_node_collection(node, ids)
  scheduler.schedule()
  handed = [[order[i] for i in node.got] for node in nodes]
  assert sum(map(len, handed)) == len(order)

  def path(item):
    return item.nodeid.split('::')[0]
  # the first worker: the shared compilations first, those using a fixture
  # together, then the others of their files
  shared = [i for i in items if path(i) in conftest.SHARED_FIRST]
  first = handed[0][:len(shared)]
  assert {i.nodeid for i in first} == {i.nodeid for i in shared}
  assert [path(i) for i in first] == sorted(map(path, first), key=conftest.SHARED_FIRST.index)
  for worker, tests in enumerate(handed):
    kinds = ['shared' if path(i) in conftest.SHARED_FIRST else
             'slow' if path(i) in conftest.SLOW_FIRST else 'light' for i in tests]
    # every worker starts on slow (or shared) tests; no light test before them
    assert kinds[0] != 'light' and 'light' not in kinds[:kinds.count('shared') +
                                                        kinds.count('slow')], (worker, kinds)
  # a slow file runs whole on one worker, its tests in their order; the
  # heaviest files go to different workers
  owner = {}
  for worker, tests in enumerate(handed):
    for i in tests:
      if path(i) in conftest.SLOW_FIRST:
        assert owner.setdefault(path(i), worker) == worker, path(i)
  for path_ in conftest.SLOW_FIRST:
    mine = [i.nodeid for i in handed[owner[path_]] if path(i) == path_]
    assert mine == [f'{path_}::test_{k}' for k in range(7)]
  heaviest = conftest.SLOW_FIRST[:workers - 1]
  assert len({owner[p] for p in heaviest}) == len(heaviest)
  assert 0 not in {owner[p] for p in heaviest}  # not behind the shared compilations


BUSY = '''
import subprocess, sys, time


def burn(seconds):
  start = time.process_time()
  while time.process_time() - start < seconds:
    pass


def test_busy():
  burn(0.4)
  child = subprocess.run([sys.executable, '-c',
                          'import time\\nstart = time.process_time()\\n'
                          'while time.process_time() - start < 0.6: pass\\n'
                          'print(time.process_time())'],
                         capture_output=True, text=True, check=True)
  with open(sys.argv[0] + '.child', 'w') as f:
    f.write(child.stdout)
'''


def test_the_cpu_log_counts_a_test_and_its_subprocesses(tmp_path):
  """FFL_TEST_CPU_LOG: one line per test, its own CPU seconds and its
  subprocesses', against the seconds each burned (time.process_time)."""
  test = tmp_path / 'test_busy.py'
  test.write_text(BUSY.replace("sys.argv[0] + '.child'", repr(str(tmp_path / 'child.txt'))))
  log = tmp_path / 'cpu.txt'
  done = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                         '-p', 'tests.conftest', str(test), '--rootdir', str(tmp_path)],
                        cwd=conftest.REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, 'FFL_TEST_CPU_LOG': str(log)})
  assert done.returncode == 0, done.stdout[-2000:]
  [line] = log.read_text().splitlines()
  total, own, children, nodeid = line.split(' ', 3)
  assert nodeid.endswith('test_busy.py::test_busy')
  child = float((tmp_path / 'child.txt').read_text())
  assert 0.4 <= float(own) < 1.5
  # the child's start-up on top; the log keeps hundredths
  assert child - 0.005 <= float(children) < child + 1.0
  assert float(total) == pytest.approx(float(own) + float(children), abs=0.011)
