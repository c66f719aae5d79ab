"""Parallelism through JAX: one jit over a (data, model) device mesh, or jax.pmap.

The mesh has every device (all hosts): train.model_parallel = M devices on
the 'model' axis, the rest on 'data'. The global batch is sharded over 'data'.
Parameters carry logical axis names from their layers
(nn.with_logical_partitioning), and LOGICAL_RULES maps them onto the mesh:
with M > 1 attention heads and MLP hidden units are sharded over 'model'
(Megatron-style, Shoeybi et al. 2019), and XLA inserts the collectives.
'jit': everything else is replicated; XLA inserts the gradient all-reduce
  over 'data'.
'fsdp': as 'jit', and each parameter and optimizer-state array is also
  sharded over 'data', along its largest dimension that is not sharded yet
  and that the data axis divides (replicated if none does): ZeRO-3 / FSDP,
  with XLA inserting the all-gathers before use and the reduce-scatter of
  the gradients.
'pmap': the legacy API, kept as a tested compatibility mode (no model axis):
  the state carries a leading local-device axis and the step psums its
  gradient sums over the 'data' axis name (steps.train_step).
All of them give the same updates for the same global batch.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from flaxformer_lite.data import pipeline

MODES = ('jit', 'pmap', 'fsdp')

# Logical axis -> mesh axis (None: replicated). A dimension that its mesh axis
# does not divide stays whole (e.g. 2 key/value heads on a model axis of 4).
LOGICAL_RULES = (
    ('heads', 'model'),  # query heads: q/k/v projections by output, 'out' by input, per-head tables
    ('kv_heads', 'model'),  # key/value heads (grouped-query attention)
    ('mlp', 'model'),  # MLP hidden units: wi by output, wo by input
    ('embed', None),  # d_model
    ('kv', None),  # the head dimension
    ('relative', None),  # rows indexed by distance or bucket (Shaw, T5, DeBERTa tables)
    # A scanned stack's layer axis (model.scan_layers): each step of the scan
    # slices one layer, so this axis stays whole on every device, under fsdp too.
    ('layers', None),
)
WHOLE = ('layers',)  # logical axes that fsdp does not shard either


def padded_rows(rows: int, multiple: int) -> int:
  """The smallest multiple of `multiple` >= rows: a batch's rows after
  padding with weight-0 rows so that it splits evenly (over devices, and
  over gradient-accumulation microbatches)."""
  return -(-rows // multiple) * multiple


class Partitioner:
  """Where the state and batches live on the (data, model) mesh, and how the
  step is compiled (jit, fsdp or pmap)."""

  def __init__(self, mode: str, model_parallel: int = 1):
    if mode not in MODES:
      raise ValueError(f'train.parallel={mode!r}; valid: {", ".join(MODES)}')
    n = jax.device_count()
    if model_parallel < 1 or n % model_parallel or (mode == 'pmap' and model_parallel > 1):
      raise ValueError(f'train.model_parallel={model_parallel} on {n} devices; valid: '
                       + ('1 (pmap has no model axis)' if mode == 'pmap' else
                          str([m for m in range(1, n + 1) if n % m == 0])))
    self.mode = mode
    auto = jax.sharding.AxisType.Auto
    self.mesh = jax.make_mesh((n // model_parallel, model_parallel), ('data', 'model'),
                              axis_types=(auto, auto))
    self.batch_sharding = NamedSharding(self.mesh, P('data'))
    self.replicated = NamedSharding(self.mesh, P())
    self.state_shardings = None  # set by layout()

  def param_sharding(self, shape, logical=()) -> NamedSharding:
    """A parameter's sharding from its logical axes (LOGICAL_RULES; missing
    names: replicated); under 'fsdp' its largest dimension not sharded yet
    that the data axis divides also goes over 'data' (the first on ties; never
    a WHOLE axis)."""
    rules = dict(LOGICAL_RULES)
    logical = tuple(logical) + (None,) * (len(shape) - len(logical))
    spec = []
    for size, name in zip(shape, logical):
      axis = rules.get(name)
      spec.append(axis if axis and self.mesh.shape[axis] > 1
                  and size % self.mesh.shape[axis] == 0 else None)
    data = self.mesh.shape['data']
    if self.mode == 'fsdp' and data > 1:
      free = [i for i, size in enumerate(shape)
              if spec[i] is None and logical[i] not in WHOLE and size % data == 0
              and size >= data]
      if free:
        spec[max(free, key=lambda i: shape[i])] = 'data'
    return NamedSharding(self.mesh, P(*spec))

  def layout(self, state, param_axes):
    """Fixes where the state lives: each parameter by param_axes (the tree
    train.state.param_axes gives), the optimizer's moments like their
    parameters, its counters replicated. Returns the state's shardings."""
    params = jax.tree.map(lambda x, axes: self.param_sharding(np.shape(x), axes),
                          state.params, param_axes)
    opt_state = optax.tree_map_params(
        state.tx, lambda _, sharding: sharding, state.opt_state, params,
        transform_non_params=lambda x: self.param_sharding(np.shape(x)))
    self.state_shardings = state.replace(step=self.replicated, params=params,
                                         opt_state=opt_state)
    return self.state_shardings

  def compile_step(self, step_fn, **kwargs):
    """step_fn(state, batch, rng, **kwargs) -> (state, sums), compiled once;
    the state's buffers are donated."""
    if self.mode in ('jit', 'fsdp'):
      def sharded_step(state, batch, rng):
        state, sums = step_fn(state, batch, rng, **kwargs)
        # keep the new state in the layout the old one had
        return jax.lax.with_sharding_constraint(state, self.state_shardings), sums
      sharded_step.__name__ = sharded_step.__qualname__ = step_fn.__name__  # jit's logs name it
      return jax.jit(sharded_step, donate_argnums=(0,))
    return jax.pmap(functools.partial(step_fn, axis_name='data', **kwargs), axis_name='data',
                    in_axes=(0, 0, None), donate_argnums=(0,))

  def place_state(self, state):
    """A state on one device (or replicated on the mesh) -> this mode's
    layout (jit, fsdp: the one layout() fixed)."""
    if self.mode in ('jit', 'fsdp'):
      return jax.device_put(state, self.state_shardings)
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
    local = {k: pipeline.process_share(v, jax.process_index(), jax.process_count())
             for k, v in batch.items()}
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
