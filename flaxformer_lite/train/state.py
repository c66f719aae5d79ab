"""Train state and optimizer."""
from __future__ import annotations

import flax.linen as nn
import jax
import optax
from flax.training import train_state

from flaxformer_lite.model_types import MODEL_TYPES
from flaxformer_lite.tokens import shift_right
from flaxformer_lite.train import schedules


def create_optimizer(train_config, d_model: int):
  """Adam(b1, b2, eps) on the configured schedule; optional clipping and decoupled
  weight decay (AdamW, on matrices and embeddings as in GPT-2/nanoGPT)."""
  t = train_config
  lr = schedules.create(t, d_model)
  if t.weight_decay:  # matrices and embeddings only, not biases or norm scales
    opt = optax.adamw(lr, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps,
                      weight_decay=t.weight_decay,
                      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
  else:
    opt = optax.adam(lr, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps)
  return optax.chain(optax.clip_by_global_norm(t.grad_clip), opt) if t.grad_clip else opt


def _init_fn(model, config):
  """(rng, example_batch) -> the model's variables, boxed with the logical axes
  the layers give their parameters (nn.with_logical_partitioning). Models with
  one input (LMs, the MLM encoder) see only example_batch['inputs'], the
  two-stream classifier 'inputs' and 'inputs_b'."""
  data = MODEL_TYPES[config.model.type].data
  if data == 'lm':
    return lambda rng, batch: model.init(rng, batch['inputs'])
  if data == 'two_stream':
    return lambda rng, batch: model.init(rng, batch['inputs'], batch['inputs_b'])
  return lambda rng, batch: model.init(rng, batch['inputs'], shift_right(batch['targets']))


def abstract_params(model, config, example_batch):
  """The parameters' shapes and dtypes, boxed with their logical axes (a
  trace of the initialisers; nothing is computed)."""
  return jax.eval_shape(_init_fn(model, config), jax.random.key(0), example_batch)['params']


def param_axes(model, config, example_batch):
  """The parameters' logical axes: a tree like the params of PartitionSpecs of
  logical names (P() where a layer gives none: replicated). Nothing is computed."""
  return nn.get_partition_spec(abstract_params(model, config, example_batch))


def init_params(model, config, example_batch, rng):
  """Parameters (plain arrays) initialised from `example_batch` shapes, then
  overlaid with model.init_from's checkpoint where it is set."""
  batch = {k: example_batch[k] for k in ('inputs', 'inputs_b', 'targets') if k in example_batch}

  def init():
    return nn.unbox(jax.jit(_init_fn(model, config))(rng, batch)['params'])
  if config.model.get('init_from'):
    from flaxformer_lite import pretrained
    # The shapes, not initialised parameters: a checkpoint that has every
    # tensor is then the only copy of the weights while it is put in place.
    return pretrained.init_params(jax.eval_shape(init), config.model.init_from, init=init,
                                  evaluate_only=config.train.num_steps == 0)
  return init()


# Parameters up to this many bytes are initialised on the host (init_device).
HOST_INIT_BYTES = 1 << 30


def init_device(shapes):
  """Where to initialise a train state whose parameters have `shapes`
  (abstract_params): the host's CPU when the default backend is an
  accelerator and they take at most HOST_INIT_BYTES, else None (the default
  device). An accelerator compiles the initialisers
  (a random program per parameter shape, run once) into kernels of its own
  before it runs them; the host's compiler makes light work of them, and the
  values are the same wherever they are drawn (JAX's random bits depend on
  the key alone)."""
  if jax.default_backend() == 'cpu':
    return None
  try:
    host = jax.local_devices(backend='cpu')[0]
  except RuntimeError:  # JAX_PLATFORMS without cpu
    return None
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nn.unbox(shapes)))
  return host if size <= HOST_INIT_BYTES else None


def create(model, config, example_batch, rng) -> train_state.TrainState:
  """The parameters (`init_params`) and the optimizer."""
  params = init_params(model, config, example_batch, rng)
  tx = create_optimizer(config.train, config.model.d_model)
  # One program for the optimizer state, not an eager op (a compile of its own
  # on a GPU) per leaf and shape.
  return train_state.TrainState(step=0, apply_fn=model.apply, params=params, tx=tx,
                                opt_state=jax.jit(tx.init)(params))
