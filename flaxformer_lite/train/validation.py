"""config.train's and config.eval's rules, checked before anything is compiled.

Batch sizes need no arithmetic for the device count: a batch that does not
split over the devices is padded with weight-0 rows (train/loop.py).
"""
from __future__ import annotations

import jax

from flaxformer_lite.config import ConfigError, check, check_choice
from flaxformer_lite.model_types import MODEL_TYPES
from flaxformer_lite.train import partitioning, profiling, schedules
from flaxformer_lite.train.evaluation import sample_lengths


def validate(config) -> None:
  """Raises ConfigError naming the bad value and what would be valid."""
  t = config.train
  check(t.num_steps > 0 or (t.num_steps == 0 and bool(config.model.get('init_from'))),
        f'train.num_steps={t.num_steps} must be > 0, or 0 with model.init_from (evaluate '
        'the checkpoint without training)')
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
  check(e.batch_tokens >= 0,
        f'eval.batch_tokens={e.batch_tokens} must be >= 0 (0 = eval.batch_size examples a batch)')
  check(e.max_examples >= 0, f'eval.max_examples={e.max_examples} must be >= 0 (0 = all)')
  check(e.beam_size >= 1, f'eval.beam_size={e.beam_size} must be >= 1 (1 = greedy)')
  check(e.max_decode_len >= 0, f'eval.max_decode_len={e.max_decode_len} must be >= 0')
  check_choice('eval.sequence_accuracy', e.sequence_accuracy, ('decoded', 'teacher_forced'))
  check(e.sequence_accuracy == 'decoded' or e.beam_size == 1,
        f"eval.sequence_accuracy='teacher_forced' is greedy decoding's exact match; "
        f"eval.beam_size={e.beam_size} needs eval.sequence_accuracy='decoded'")
  _validate_lm_eval(config)


def _validate_lm_eval(config) -> None:
  """eval.contexts (models reading a token stream) and the greedy sample's
  lengths (decoder-only LMs); learned positions must reach both."""
  m, e = config.model, config.eval
  contexts = tuple(e.contexts)
  check(all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in contexts),
        f'eval.contexts={contexts!r} must be window lengths in tokens, ints >= 1, '
        'e.g. (4096, 16384); () = data.max_len only')
  for key in ('sample_prompt', 'sample_len'):
    check(e[key] >= 0, f'eval.{key}={e[key]} must be >= 0 (0 = half of data.max_len)')
  stream = [name for name, t in MODEL_TYPES.items() if t.data == 'lm']
  check(not contexts or m.type in stream,
        f'eval.contexts={contexts!r} scores windows of a token stream; model.type={m.type!r} '
        f'reads sentence pairs. Use eval.contexts=() or model.type in {stream}')
  lm = [name for name, t in MODEL_TYPES.items() if t.objective == 'lm']
  check(not (e.sample_prompt or e.sample_len) or m.type in lm,
        f'eval.sample_prompt={e.sample_prompt} and eval.sample_len={e.sample_len} size the '
        f'greedy sample of a language model; model.type={m.type!r} has none. Set them to 0 '
        f'or use model.type in {lm}')
  if m.positions != 'learned':  # the other positions reach any length
    return
  check(max(contexts, default=0) <= m.max_len,
        f'eval.contexts={contexts!r} has windows longer than model.max_len={m.max_len}, '
        "the reach of model.positions='learned'; use contexts <= model.max_len, or "
        "model.positions='none' with a relative attention variant")
  if m.type in lm:
    prompt, length = sample_lengths(e, config.data.max_len)
    check(prompt + length <= m.max_len,
          f'the greedy sample decodes eval.sample_prompt={e.sample_prompt} + '
          f'eval.sample_len={e.sample_len} (0 = half of data.max_len={config.data.max_len}) '
          f'= {prompt} + {length} tokens, more than model.max_len={m.max_len}, the reach of '
          "model.positions='learned'; shorten them, or use model.positions='none' with a "
          'relative attention variant')
