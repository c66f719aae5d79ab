"""Orbax checkpoints: train state + data iterator position, async, keep last K."""
from __future__ import annotations

import logging
import os
import shutil

import jax
import orbax.checkpoint as ocp

from flaxformer_lite.layers import scan

log = logging.getLogger('flaxformer_lite')


class CheckpointError(RuntimeError):
  """The workdir has checkpoints but none can be read; main.py exits with code 2."""


class Checkpointer:
  """Saves {'params', 'opt_state', 'step'} and the iterator state under
  workdir/checkpoints/<step>. Orbax writes into a temporary directory and
  renames it when complete, so a killed save never replaces a good one."""

  def __init__(self, workdir: str, keep: int):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict):
    tree = {'params': state.params, 'opt_state': state.opt_state, 'step': state.step}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(tree), data=ocp.args.JsonSave(data_state)))

  def restore(self, state, step: int | None = None):
    """Restores onto `state`'s structure; returns (state, data_state).

    Without `step`, the newest checkpoint that reads back: an unreadable one
    (truncated files, a disk that filled up) gets a warning naming it and is
    moved to workdir/checkpoints_unreadable/<step> (kept, never deleted) once
    an older one has restored, so training can write that step again. If none
    reads back, CheckpointError and nothing is moved.
    """
    candidates = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
    failed = []
    for s in candidates:
      try:
        restored = self._restore(state, s)
      except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds on bad files
        path = os.path.join(self.directory, str(s))
        log.warning('checkpoint %s cannot be restored (%s: %s); trying an older one',
                    path, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else '')
        failed.append((s, path, f'{type(e).__name__}: {str(e)[:300]}'))
        continue
      self._set_aside([s for s, _, _ in failed])
      return restored
    detail = '; '.join(f'{path}: {error}' for _, path, error in failed) or 'none found'
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be restored ({detail}). Nothing was '
        'changed. Move the workdir (or its checkpoints) away to start from scratch, '
        'or repair the files.')

  def _set_aside(self, steps):
    if not steps or jax.process_index() != 0:
      return
    aside = os.path.join(os.path.dirname(self.directory), 'checkpoints_unreadable')
    os.makedirs(aside, exist_ok=True)
    for s in steps:
      dest = os.path.join(aside, str(s))
      while os.path.exists(dest):
        dest += '_'
      shutil.move(os.path.join(self.directory, str(s)), dest)
      log.warning('moved unreadable checkpoint %d to %s', s, dest)
    self.manager.reload()

  def _restore(self, state, step):
    target = {'params': state.params, 'opt_state': state.opt_state, 'step': state.step}
    try:
      tree, data = self._read(jax.tree.map(ocp.utils.to_shape_dtype_struct, target), step)
    except Exception as first:  # noqa: BLE001 - maybe the other layer layout (model.scan_layers)
      scanned = scan.is_stacked(target['params'])
      saved_as = jax.eval_shape(scan.unstack_layers if scanned else scan.stack_layers, target)
      if jax.tree.structure(saved_as) == jax.tree.structure(target):
        raise
      try:
        tree, data = self._read(saved_as, step)
      except Exception:  # noqa: BLE001 - not that either: report the first error
        raise first from None
      log.info('checkpoint %d: layers %s into this model\'s layout', step,
               'stacked' if scanned else 'unstacked')
      tree = (scan.stack_layers if scanned else scan.unstack_layers)(tree)
    return state.replace(**tree), data

  def _read(self, abstract, step):
    """(the saved state read into `abstract`'s structure, the data state)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    return restored['state'], restored['data']

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
