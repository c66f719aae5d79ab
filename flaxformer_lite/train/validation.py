"""config.train's and config.eval's rules, checked before anything is compiled.

Batch sizes need no arithmetic for the device count: a batch that does not
split over the devices is padded with weight-0 rows (train/loop.py).
"""
from __future__ import annotations

import jax

from flaxformer_lite.config import ConfigError, check, check_choice
from flaxformer_lite.train import partitioning, profiling, schedules


def validate(config) -> None:
  """Raises ConfigError naming the bad value and what would be valid."""
  t = config.train
  check(t.num_steps > 0, f'train.num_steps={t.num_steps} must be > 0')
  check(t.batch_size > 0, f'train.batch_size={t.batch_size} must be > 0')
  check_choice('train.schedule', t.schedule, schedules.SCHEDULES)
  check(t.learning_rate > 0, f'train.learning_rate={t.learning_rate} must be > 0')
  check(t.warmup_steps > 0 or t.schedule == 'constant',
        f'train.warmup_steps={t.warmup_steps} must be > 0 for schedule {t.schedule!r}')
  check(0.0 <= t.label_smoothing < 1.0,
        f'train.label_smoothing={t.label_smoothing} must be in [0, 1)')
  for key in ('log_every', 'eval_every', 'checkpoint_every', 'keep_checkpoints'):
    check(t[key] > 0, f'train.{key}={t[key]} must be > 0')
  check_choice('train.parallel', t.parallel, partitioning.MODES)
  devices = jax.device_count()
  check(t.model_parallel >= 1 and devices % t.model_parallel == 0
        and (t.parallel != 'pmap' or t.model_parallel == 1),
        f'train.model_parallel={t.model_parallel} on {devices} device(s); valid: '
        + ('1 (train.parallel=pmap has no model axis)' if t.parallel == 'pmap' else
           str([m for m in range(1, devices + 1) if devices % m == 0])))
  try:
    profiling.parse(t.profile_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  check(t.grad_accum_steps >= 1, f'train.grad_accum_steps={t.grad_accum_steps} must be >= 1')
  hosts = jax.process_count()  # each process reads batch_size / hosts rows
  check(t.batch_size % hosts == 0,
        f'train.batch_size={t.batch_size} is global and must be divisible by the {hosts} '
        f'processes (hosts); e.g. {hosts * max(1, t.batch_size // hosts)}')
  check(t.batch_tokens >= 0, f'train.batch_tokens={t.batch_tokens} must be >= 0')
  e = config.eval
  check(e.batch_size > 0, f'eval.batch_size={e.batch_size} must be > 0')
  check(e.max_examples >= 0, f'eval.max_examples={e.max_examples} must be >= 0 (0 = all)')
  check(e.beam_size >= 1, f'eval.beam_size={e.beam_size} must be >= 1 (1 = greedy)')
  check(e.max_decode_len >= 0, f'eval.max_decode_len={e.max_decode_len} must be >= 0')
