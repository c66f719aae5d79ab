"""The paper's learning-rate schedule against its formula, and the optax ones."""
import math

import ml_collections
import pytest

from flaxformer_lite.train import schedules


def test_rsqrt_is_the_papers_formula():
  d, warmup = 512, 4000
  fn = schedules.rsqrt(d, warmup)
  for step in (0, 1, 100, 3999, 4000, 10000):
    s = step + 1
    expected = d ** -0.5 * min(s ** -0.5, s * warmup ** -1.5)
    assert float(fn(step)) == pytest.approx(expected, rel=1e-6)
  # peak at the end of warmup: d^-0.5 * warmup^-0.5
  assert float(fn(warmup - 1)) == pytest.approx((d * warmup) ** -0.5, rel=1e-6)


def _train(schedule, lr=1e-3, warmup=10, total=100, final=0.0):
  return ml_collections.ConfigDict(dict(schedule=schedule, learning_rate=lr,
                                        warmup_steps=warmup, num_steps=total,
                                        final_learning_rate=final))


def test_alternatives_warm_up_to_the_peak_and_decay():
  for name in ('warmup_cosine', 'warmup_linear'):
    fn = schedules.create(_train(name), d_model=64)
    assert float(fn(0)) == 0.0
    assert float(fn(10)) == pytest.approx(1e-3, rel=1e-5)
    assert float(fn(100)) < 1e-5
  cos = schedules.create(_train('warmup_cosine'), 64)
  assert float(cos(55)) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 45 / 90)), rel=1e-4)
  assert float(schedules.create(_train('constant'), 64)(77)) == pytest.approx(1e-3)


def test_cosine_ends_at_the_final_rate_as_nanogpt():
  # nanoGPT's get_lr: min_lr + 0.5 * (1 + cos(pi * progress)) * (lr - min_lr) after warmup.
  fn = schedules.create(_train('warmup_cosine', lr=1e-3, warmup=100, total=2000,
                               final=1e-4), 64)
  for step in (100, 500, 1000, 1999, 2000):
    progress = (step - 100) / 1900
    expected = 1e-4 + 0.5 * (1 + math.cos(math.pi * progress)) * (1e-3 - 1e-4)
    assert float(fn(step)) == pytest.approx(expected, rel=1e-5)
