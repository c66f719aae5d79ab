"""Learning-rate schedules: the paper's, and optax's usual alternatives."""
from __future__ import annotations

import jax.numpy as jnp
import optax

SCHEDULES = ('rsqrt', 'constant', 'warmup_cosine', 'warmup_linear')


def rsqrt(d_model: int, warmup_steps: int, factor: float = 1.0) -> optax.Schedule:
  """Vaswani et al. 2017, eq. 3: factor * d^-0.5 * min(s^-0.5, s * warmup^-1.5).

  s = optimizer step + 1 (the paper counts steps from 1).
  """
  def schedule(count):
    s = jnp.asarray(count, jnp.float32) + 1.0
    return factor * d_model ** -0.5 * jnp.minimum(s ** -0.5, s * warmup_steps ** -1.5)
  return schedule


def create(train_config, d_model: int) -> optax.Schedule:
  """config.train (schedule, learning_rate, warmup_steps, num_steps,
  final_learning_rate: where the decaying schedules end) -> schedule."""
  t = train_config
  name, lr, warmup, total = t.schedule, t.learning_rate, t.warmup_steps, t.num_steps
  if name == 'rsqrt':
    return rsqrt(d_model, warmup, lr)
  if name == 'constant':
    return optax.constant_schedule(lr)
  if name == 'warmup_cosine':
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1),
                                              end_value=t.final_learning_rate)
  if name == 'warmup_linear':
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup),
         optax.linear_schedule(lr, t.final_learning_rate, max(total - warmup, 1))], [warmup])
  raise ValueError(f'train.schedule={name!r}; valid: {", ".join(SCHEDULES)}')
