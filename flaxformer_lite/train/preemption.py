"""SIGTERM / SIGINT during a run: stop within a step, keep what was trained;
a second signal stops at once.

Preemptible machines (cloud spot VMs, SLURM's --signal, a Ctrl-C) send a
signal and kill some 30 s later. Python runs a signal handler only between
bytecodes of the main thread, which may be inside one long XLA call (a
compile, a queue of train steps, an evaluation). So the signal is read from
a pipe by a watcher thread (`signal.set_wakeup_fd`): the message is logged
when it arrives, and a second signal exits at once (128 + signum, without
saving; the newest complete checkpoint stays as it is, since orbax renames
a checkpoint into place only when it is whole).

The first signal only sets `requested`. The run reads it where it can stop
cleanly: after each train step (the loop keeps one step in flight), and
through `wait`, `check` and `start`, which raise `Preempted` in the
evaluation, the sampler and the compiles while a signal is pending. With
several processes (multihost) these raise nothing: the processes agree to
stop at a train step instead (`multihost.any_process`), since one that left
an evaluation alone would leave the others waiting in its collectives.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import jax

log = logging.getLogger('flaxformer_lite')

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_active: Preemption | None = None


class Preempted(Exception):
  """A signal arrived while the run was evaluating, sampling or compiling."""


class Preemption:
  """Context manager; `requested` is the first signal's name, or None."""

  def __init__(self, signals=SIGNALS):
    self.signals = signals
    self.requested: str | None = None
    self._previous, self._pipe, self._watcher, self._wakeup = {}, None, None, None

  def _arrived(self, signum):
    name = signal.Signals(signum).name
    if self.requested is not None:
      sys.stderr.write(f"\n{name} again: exiting now, without a checkpoint.\n")
      sys.stderr.flush()
      os._exit(128 + signum)
    self.requested = name
    log.warning('%s received: stopping after the current step, keeping every step trained '
                '(send it again to exit at once)', name)

  def _handle(self, signum, frame):
    """Python's handler (main thread, between bytecodes): the watcher has
    already acted on the signal, unless there is none."""
    del frame
    if self._watcher is None:
      self._arrived(signum)

  def _watch(self, read_fd):
    numbers = {int(s) for s in self.signals}
    while data := os.read(read_fd, 64):
      for signum in data:
        if signum in numbers:
          self._arrived(signum)
    os.close(read_fd)

  def __enter__(self):
    global _active
    # Python delivers signals to the main thread only; elsewhere (a test
    # runner's worker thread) leave the handlers alone.
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
      read_fd, write_fd = os.pipe()
      os.set_blocking(write_fd, False)
      try:
        self._wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
      except ValueError:  # not the main interpreter
        os.close(read_fd)
        os.close(write_fd)
      else:
        self._pipe = write_fd
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                                         name='preemption')
        self._watcher.start()
      _active = self
    return self

  def __exit__(self, *exc):
    global _active
    if self._pipe is not None:
      signal.set_wakeup_fd(self._wakeup)
      os.close(self._pipe)  # the watcher reads the end of the pipe and stops
      self._watcher.join(timeout=5)
      self._pipe = self._watcher = None
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
    if _active is self:
      _active = None
    return False


def _pending() -> str | None:
  """The signal to act on here: None with no Preemption active, or with
  several processes."""
  if _active is None or _active.requested is None or jax.process_count() > 1:
    return None
  return _active.requested


def check() -> None:
  """Preempted if a signal is pending."""
  if (name := _pending()) is not None:
    raise Preempted(name)


def wait(tree):
  """Blocks until every array in `tree` is computed; returns `tree`. Raises
  Preempted as soon as a signal is pending (the computation goes on in the
  background)."""
  for leaf in jax.tree.leaves(tree):
    ready, pause = getattr(leaf, 'is_ready', None), 0.001
    while ready is not None and not ready():
      check()
      time.sleep(pause)
      pause = min(2 * pause, 0.05)
  check()
  return tree


class Pending:
  """fn(*args) running in a thread of its own (`start`)."""

  def __init__(self, fn, *args):
    self._done, self._value, self._error = threading.Event(), None, None

    def run():
      try:
        self._value = fn(*args)
      except BaseException as e:  # noqa: BLE001  (re-raised by result())
        self._error = e
      finally:
        self._done.set()
    # A daemon: a run that stops mid-compile does not wait for the compile.
    threading.Thread(target=run, daemon=True, name='compile').start()

  def result(self):
    """Its value (its exception re-raised); Preempted as soon as a signal is
    pending, without waiting for it."""
    while not self._done.wait(timeout=0.05):
      check()
    if self._error is not None:
      raise self._error
    return self._value


def start(fn, *args) -> Pending:
  return Pending(fn, *args)
