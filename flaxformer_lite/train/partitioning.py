"""Data parallelism: one jit over a device mesh (default), FSDP, or jax.pmap.

'jit': the train state is replicated and the global batch sharded over the
  'data' axis of a Mesh of every device (all hosts); XLA inserts the
  gradient all-reduce.
'fsdp': as 'jit', and each parameter and optimizer-state array is also
  sharded over the 'data' axis, along its largest dimension that the device
  count divides (replicated if none does): ZeRO-3 / FSDP, with XLA inserting
  the all-gathers before use and the reduce-scatter of the gradients. Each
  device then holds 1/N of the state.
'pmap': the legacy API, kept as a tested compatibility mode: the state
  carries a leading local-device axis and the step psums its gradient sums
  over the 'data' axis name (steps.train_step).
All three give the same updates for the same global batch. A separate
model (tensor-parallel) axis is not implemented.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MODES = ('jit', 'pmap', 'fsdp')


def padded_rows(rows: int, multiple: int) -> int:
  """The smallest multiple of `multiple` >= rows: a batch's rows after
  padding with weight-0 rows so that it splits evenly (over devices, and
  over gradient-accumulation microbatches)."""
  return -(-rows // multiple) * multiple


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

  def fsdp_sharding(self, x) -> NamedSharding:
    """x's sharding under 'fsdp': its largest dimension that the device count
    divides goes over 'data' (the first such on ties); none: replicated."""
    n, shape = self.mesh.size, np.shape(x)
    dims = [i for i, size in enumerate(shape) if size % n == 0 and size >= n]
    if n == 1 or not dims:
      return self.replicated
    axis = max(dims, key=lambda i: shape[i])
    return NamedSharding(self.mesh, P(*[('data' if i == axis else None)
                                       for i in range(len(shape))]))

  def compile_step(self, step_fn, **kwargs):
    """step_fn(state, batch, rng, **kwargs) -> (state, sums), compiled once;
    the state's buffers are donated."""
    if self.mode == 'jit':
      return jax.jit(functools.partial(step_fn, **kwargs), donate_argnums=(0,))
    if self.mode == 'fsdp':
      def sharded_step(state, batch, rng):
        state, sums = step_fn(state, batch, rng, **kwargs)
        # keep the new state in the layout the old one had
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, self.fsdp_sharding(x)), state), sums
      return jax.jit(sharded_step, donate_argnums=(0,))
    return jax.pmap(functools.partial(step_fn, axis_name='data', **kwargs), axis_name='data',
                    in_axes=(0, 0, None), donate_argnums=(0,))

  def place_state(self, state):
    """A state on one device (or replicated on the mesh) -> this mode's layout."""
    if self.mode == 'jit':
      return jax.device_put(state, self.replicated)
    if self.mode == 'fsdp':
      return jax.tree.map(lambda x: jax.device_put(x, self.fsdp_sharding(x)), state)
    n = jax.local_device_count()  # host copies: pmap shards them at the first call
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n,) + x.shape), state)

  def unplace_state(self, state):
    """This mode's layout -> one copy (for evaluation and checkpoints); jit
    and fsdp states are global arrays already, whatever their sharding."""
    if self.mode in ('jit', 'fsdp'):
      return state
    return jax.device_put(jax.tree.map(lambda x: x[0], state), self.replicated)

  def place_batch(self, batch: dict):
    """This process's rows {k: [rows, ...]} -> the step's input."""
    if self.mode != 'pmap':
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
    return jax.tree.map(lambda x: x[0], sums) if self.mode == 'pmap' else sums


def to_host(x) -> np.ndarray:
  """A (possibly multi-process) global array -> the whole numpy array, on every process."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
