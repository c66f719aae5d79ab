"""Metrics: step sums to means, sacreBLEU, and where they go (workdir/metrics.jsonl,
TensorBoard event files).

sacrebleu and tensorboardX are imported where they are used: a run of a
synthetic task needs neither, and without tensorboardX it writes
metrics.jsonl alone (a machine that came with JAX may lack it)."""
from __future__ import annotations

import functools
import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger('flaxformer_lite')


add_sums = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))


def summarise(sums) -> dict:
  """Metric sums -> means: loss, nll, perplexity, accuracy (and mean grad_norm sums)."""
  tokens = max(float(sums['tokens']), 1.0)
  out = {'loss': float(sums['loss']) / tokens, 'nll': float(sums['nll']) / tokens,
         'accuracy': float(sums['correct']) / tokens}
  out['perplexity'] = float(np.exp(min(out['nll'], 50.0)))
  if 'grad_norm' in sums:
    out['grad_norm'] = float(sums['grad_norm'])
  return out


def fmt_time(seconds: float) -> str:
  """'1h05m' or '4m07s': the log's and the sweep's durations."""
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else \
      f'{seconds // 60}m{seconds % 60:02d}s'


def fmt_rate(steps_per_sec: float) -> str:
  """'8.3 steps/s'; below one step a second the period, '12.4 s/step', so
  that a slow run's speed never reads '0.0 steps/s'."""
  if steps_per_sec >= 1:
    return f'{steps_per_sec:.1f} steps/s'
  return f'{1 / steps_per_sec:.1f} s/step'


def bleu(hypotheses: list[str], references: list[str]) -> float:
  """Corpus sacreBLEU (13a tokenization, cased) of detokenized text, 0..100."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} hypotheses for {len(references)} references')
  import sacrebleu
  return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


@functools.cache
def _summary_writer_class():
  """tensorboardX's SummaryWriter; None, said once, where it is not installed."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    log.warning("TensorBoard event files are not written: this Python lacks tensorboardX "
                "(%s -m pip install 'tensorboardX>=2.6' adds it); metrics.jsonl holds every "
                "point", sys.executable)
    return None
  return SummaryWriter


class MetricWriter:
  """One JSON object per point in metrics.jsonl ({'step', 'split', ...}) and a
  TensorBoard scalar '<split>/<name>' for each metric (with tensorboardX
  installed). Only process 0 writes."""

  def __init__(self, workdir: str, resume_step: int = 0):
    self.active = jax.process_index() == 0
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb = None
    if not self.active:
      return
    _truncate_after(self.path, resume_step)
    writer = _summary_writer_class()
    if writer is not None:
      self.tb = writer(logdir=workdir, flush_secs=10)

  def write(self, step: int, split: str, metrics: dict):
    if not self.active:
      return
    record = {'step': int(step), 'split': split,
              **{k: float(v) for k, v in metrics.items()}}
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    if self.tb is not None:
      for k, v in metrics.items():
        self.tb.add_scalar(f'{split}/{k}', float(v), int(step))

  def close(self):
    if self.tb is not None:
      self.tb.close()


def _truncate_after(path: str, step: int):
  """Drops points logged after `step`: a resumed run logs them again."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = [line for line in f if line.strip() and json.loads(line)['step'] <= step]
  with open(path, 'w') as f:
    f.writelines(lines)


def read(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]
