"""Orbax checkpoints: train state + data iterator position, async, keep last K."""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


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
    """Restores onto `state`'s structure; returns (state, data_state)."""
    step = self.latest_step() if step is None else step
    target = {'params': state.params, 'opt_state': state.opt_state, 'step': state.step}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    tree = restored['state']
    state = state.replace(params=tree['params'], opt_state=tree['opt_state'],
                          step=tree['step'])
    return state, restored['data']

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
