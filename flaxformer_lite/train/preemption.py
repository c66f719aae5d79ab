"""SIGTERM / SIGINT during training: checkpoint, then stop; a second signal stops at once.

Preemptible machines (cloud spot VMs, SLURM's --signal, a Ctrl-C) send a
signal before they kill. The first one only sets a flag that the training
loop reads after each step, so the checkpoint it then writes holds a complete
step. A second signal means "now": the process exits with 128 + signum
without saving (the newest complete checkpoint stays as it is, since orbax
renames a checkpoint into place only when it is whole).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger('flaxformer_lite')

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """Context manager; `requested` is the first signal's name, or None."""

  def __init__(self, signals=SIGNALS):
    self.signals = signals
    self.requested: str | None = None
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.requested is not None:
      sys.stderr.write(f"\n{name} again: exiting now, without a checkpoint.\n")
      sys.stderr.flush()
      os._exit(128 + signum)
    self.requested = name
    log.warning('%s received: saving a checkpoint after this step, then stopping '
                '(send it again to exit at once)', name)

  def __enter__(self):
    # Python delivers signals to the main thread only; elsewhere (a test
    # runner's worker thread) leave the handlers alone.
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
    return False
