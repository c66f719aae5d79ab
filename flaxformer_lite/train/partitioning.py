"""Data parallelism: one jit over a device mesh (default) or jax.pmap.

'jit': the train state is replicated and the global batch sharded over the
  'data' axis of a Mesh of every device (all hosts); XLA inserts the
  gradient all-reduce. The mesh has one axis today; a model/FSDP axis would
  be a second one here.
'pmap': the legacy API, kept as a tested compatibility mode: the state
  carries a leading local-device axis and the step psums its gradient sums
  over the 'data' axis name (steps.train_step).
Both give the same updates for the same global batch.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MODES = ('jit', 'pmap')


class DataParallel:
  """Where the state and batches live, and how the step is compiled."""

  def __init__(self, mode: str):
    if mode not in MODES:
      raise ValueError(f'train.parallel={mode!r}; valid: {", ".join(MODES)}')
    self.mode = mode
    self.mesh = jax.make_mesh((jax.device_count(),), ('data',),
                              axis_types=(jax.sharding.AxisType.Auto,))
    self.batch_sharding = NamedSharding(self.mesh, P('data'))
    self.replicated = NamedSharding(self.mesh, P())

  def compile_step(self, step_fn, **kwargs):
    """step_fn(state, batch, rng, **kwargs) -> (state, sums), compiled once;
    the state's buffers are donated."""
    if self.mode == 'jit':
      return jax.jit(functools.partial(step_fn, **kwargs), donate_argnums=(0,))
    return jax.pmap(functools.partial(step_fn, axis_name='data', **kwargs), axis_name='data',
                    in_axes=(0, 0, None), donate_argnums=(0,))

  def place_state(self, state):
    """A state on one device (or replicated on the mesh) -> this mode's layout."""
    if self.mode == 'jit':
      return jax.device_put(state, self.replicated)
    n = jax.local_device_count()  # host copies: pmap shards them at the first call
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n,) + x.shape), state)

  def unplace_state(self, state):
    """This mode's layout -> one copy (for evaluation and checkpoints)."""
    if self.mode == 'jit':
      return state
    return jax.device_put(jax.tree.map(lambda x: x[0], state), self.replicated)

  def place_batch(self, batch: dict):
    """This process's rows {k: [rows, ...]} -> the step's input."""
    if self.mode == 'jit':
      return jax.make_array_from_process_local_data(self.batch_sharding, batch)
    n = jax.local_device_count()
    return {k: np.reshape(v, (n, -1) + v.shape[1:]) for k, v in batch.items()}

  def place_eval_batch(self, batch: dict):
    """A global evaluation batch (the same on every process) -> sharded over
    the mesh, each process contributing its own rows."""
    count, index = jax.process_count(), jax.process_index()
    rows = next(iter(batch.values())).shape[0] // count
    local = {k: v[index * rows:(index + 1) * rows] for k, v in batch.items()}
    return jax.make_array_from_process_local_data(self.batch_sharding, local)

  def unplace_sums(self, sums):
    """The step's metric sums -> one copy (pmap: identical on every device)."""
    return sums if self.mode == 'jit' else jax.tree.map(lambda x: x[0], sums)


def to_host(x) -> np.ndarray:
  """A (possibly multi-process) global array -> the whole numpy array, on every process."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
