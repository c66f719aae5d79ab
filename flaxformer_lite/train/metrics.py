"""Where metrics go: workdir/metrics.jsonl, TensorBoard event files, the log."""
from __future__ import annotations

import json
import os

import jax
import sacrebleu
from tensorboardX import SummaryWriter


def bleu(hypotheses: list[str], references: list[str]) -> float:
  """Corpus sacreBLEU (13a tokenization, cased) of detokenized text, 0..100."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} hypotheses for {len(references)} references')
  return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


class MetricWriter:
  """One JSON object per point in metrics.jsonl ({'step', 'split', ...}) and a
  TensorBoard scalar '<split>/<name>' for each metric. Only process 0 writes."""

  def __init__(self, workdir: str, resume_step: int = 0):
    self.active = jax.process_index() == 0
    self.path = os.path.join(workdir, 'metrics.jsonl')
    if not self.active:
      return
    _truncate_after(self.path, resume_step)
    self.tb = SummaryWriter(logdir=workdir, flush_secs=10)

  def write(self, step: int, split: str, metrics: dict):
    if not self.active:
      return
    record = {'step': int(step), 'split': split,
              **{k: float(v) for k, v in metrics.items()}}
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    for k, v in metrics.items():
      self.tb.add_scalar(f'{split}/{k}', float(v), int(step))

  def close(self):
    if self.active:
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
