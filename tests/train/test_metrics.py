"""train/metrics.py's formats for the log."""
import pytest

from flaxformer_lite.train import metrics


@pytest.mark.parametrize('steps_per_sec, shown', [
    (8.34, '8.3 steps/s'), (1.0, '1.0 steps/s'),
    # slower than a step a second: the period, never '0.0 steps/s'
    (0.5, '2.0 s/step'), (1 / 80.6, '80.6 s/step'), (1 / 4000, '4000.0 s/step')])
def test_fmt_rate_gives_a_slow_runs_period(steps_per_sec, shown):
  assert metrics.fmt_rate(steps_per_sec) == shown


@pytest.mark.parametrize('seconds, shown', [(0, '0m00s'), (247.9, '4m07s'), (3900, '1h05m')])
def test_fmt_time(seconds, shown):
  assert metrics.fmt_time(seconds) == shown
