"""End to end through train_and_evaluate: learning, outputs, resume."""
import glob
import json
import os
import threading

import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite.layers import transformer
from flaxformer_lite.train import loop, metrics


def _train_points(workdir):
  return {r['step']: r for r in metrics.read(workdir) if r['split'] == 'train'}


def test_short_run_learns_and_writes_outputs(tiny_config, tmp_path):
  c = tiny_config
  c.train.num_steps, c.train.log_every = 60, 10
  workdir = str(tmp_path / 'run')
  results = loop.train_and_evaluate(c, workdir)
  points = _train_points(workdir)
  assert sorted(points) == list(range(10, 61, 10))
  assert points[60]['loss'] < 0.9 * points[10]['loss']  # deterministic on CPU
  assert all(np.isfinite(p['loss']) and p['steps_per_sec'] > 0 for p in points.values())
  # tokens_per_sec counts the scored target tokens: per step, batch_size targets of
  # min_len..max_len symbols + EOS.
  for p in points.values():
    per_step = p['tokens_per_sec'] / p['steps_per_sec']
    assert c.train.batch_size * (c.data.min_len + 1) <= per_step + 1e-6
    assert per_step <= c.train.batch_size * (c.data.max_len + 1) + 1e-6
  # a workdir holds config.json, checkpoints, events, metrics.jsonl
  files = os.listdir(workdir)
  assert 'config.json' in files and 'checkpoints' in files and 'metrics.jsonl' in files
  assert any(f.startswith('events.out.tfevents') for f in files)
  saved = config_lib.from_json(open(os.path.join(workdir, 'config.json')).read())
  assert saved.model.vocab_size == 3 + c.data.num_symbols
  assert config_lib.differences(saved, c) == []
  assert 'long_sequence_accuracy' in results['test']
  splits = {r['split'] for r in metrics.read(workdir)}
  assert splits == {'train', 'eval', 'test'}


def test_resume_continues_at_the_right_step_with_the_same_numbers(tiny_config, tmp_path):
  c = tiny_config
  whole = str(tmp_path / 'whole')
  loop.train_and_evaluate(c, whole)  # 20 steps, checkpoints at 10 and 20

  parts = str(tmp_path / 'parts')
  first = config_lib.from_json(config_lib.to_json(c))
  first.train.num_steps = 10
  loop.train_and_evaluate(first, parts)
  assert sorted(_train_points(parts)) == [10]
  again = config_lib.from_json(config_lib.to_json(c))
  again.train.profile_steps = '8:13'  # a resumable change: traces steps 10..12 of this leg
  loop.train_and_evaluate(again, parts)  # same command, longer: resumes from step 10
  traces = glob.glob(os.path.join(parts, 'plugins', 'profile', '*', '*.xplane.pb'))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
  a, b = _train_points(whole), _train_points(parts)
  assert sorted(b) == [10, 20]
  for step in (10, 20):
    np.testing.assert_allclose(b[step]['loss'], a[step]['loss'], rtol=1e-6)
    np.testing.assert_allclose(b[step]['grad_norm'], a[step]['grad_norm'], rtol=1e-6)
  assert sorted(int(s) for s in os.listdir(os.path.join(parts, 'checkpoints'))
                if s.isdigit()) == [10, 20]


def test_resume_with_a_different_model_is_refused(tiny_config, tmp_path):
  workdir = str(tmp_path / 'w')
  tiny_config.train.num_steps = 10
  loop.train_and_evaluate(tiny_config, workdir)
  other = config_lib.from_json(config_lib.to_json(tiny_config))
  other.model.d_model = 64
  try:
    loop.train_and_evaluate(other, workdir)
  except config_lib.ConfigError as e:
    assert 'model.d_model: 32 -> 64' in str(e)
  else:
    raise AssertionError('expected ConfigError')
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['model']['d_model'] == 32  # the saved run is untouched


def test_a_run_resumes_with_its_layers_scanned(tiny_config, tmp_path, caplog, monkeypatch):
  """model.scan_layers turned on between legs: the checkpoint's layers are
  stacked on restore, and the run reaches the losses of an uninterrupted
  unrolled run (no dropout: the layouts draw their masks differently).
  test_checkpoints.py reads each layout into the other.

  Every program of the run is traced in the run's own thread, while only
  XLA's compiles run in threads: flax builds nn.scan's classes while tracing
  and meanwhile empties their base class's dataclass fields, which a second
  thread tracing the same layers would read ('dictionary changed size during
  iteration')."""
  c = tiny_config
  c.train.num_steps, c.train.log_every, c.train.checkpoint_every = 4, 2, 2
  c.eval.final_test, c.model.dropout_rate = False, 0.0
  loop.train_and_evaluate(c, str(tmp_path / 'whole'))
  leg = config_lib.from_json(config_lib.to_json(c))
  leg.train.num_steps = 2
  loop.train_and_evaluate(leg, str(tmp_path / 'parts'))
  leg.model.scan_layers, leg.train.num_steps = True, 4
  traced_in, run_layers = set(), transformer._run_layers

  def recorded(*args, **kwargs):
    traced_in.add(threading.get_ident())
    return run_layers(*args, **kwargs)
  monkeypatch.setattr(transformer, '_run_layers', recorded)
  with caplog.at_level('INFO', logger='flaxformer_lite'):
    loop.train_and_evaluate(leg, str(tmp_path / 'parts'))
  assert traced_in == {threading.get_ident()}
  assert 'checkpoint 2: layers stacked' in caplog.text
  assert 'train step compiled in' in caplog.text and 'eval step' in caplog.text
  kernels = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Attention: ')]
  assert kernels and all(f'{leg.model.attention} on ' in line for line in kernels), kernels
  assert any(' on dense (auto: cpu, scores ' in line for line in kernels), kernels
  a, b = _train_points(str(tmp_path / 'whole')), _train_points(str(tmp_path / 'parts'))
  assert sorted(a) == sorted(b) == [2, 4]
  for step in (2, 4):
    np.testing.assert_allclose(b[step]['loss'], a[step]['loss'], rtol=1e-5)
    np.testing.assert_allclose(b[step]['grad_norm'], a[step]['grad_norm'], rtol=1e-4)


def test_allow_config_change_resumes_with_the_new_values(tiny_config, tmp_path, caplog):
  workdir = str(tmp_path / 'w')
  tiny_config.train.num_steps = 10
  loop.train_and_evaluate(tiny_config, workdir)
  other = config_lib.from_json(config_lib.to_json(tiny_config))
  other.train.learning_rate, other.train.num_steps = 0.5, 20
  with caplog.at_level('WARNING', logger='flaxformer_lite'):
    results = loop.train_and_evaluate(other, workdir, allow_config_change=True)
  assert 'train.learning_rate: 2.0 -> 0.5' in caplog.text
  steps = [r['step'] for r in metrics.read(workdir) if r['split'] == 'train']
  assert steps == [10, 20] and np.isfinite(results['eval']['loss'])  # resumed at 10
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['train']['learning_rate'] == 0.5


def test_rerunning_a_finished_run_writes_no_second_record(tiny_config, tmp_path, caplog):
  c = tiny_config
  c.train.num_steps = 10
  workdir = str(tmp_path / 'run')
  first = loop.train_and_evaluate(c, workdir)
  records = metrics.read(workdir)
  with caplog.at_level('INFO', logger='flaxformer_lite'):
    again = loop.train_and_evaluate(c, workdir)  # the same command once more
  assert (f'Nothing to train: {os.path.abspath(workdir)} is already trained to step 10 '
          '(train.num_steps=10)') in caplog.text
  assert metrics.read(workdir) == records  # nothing appended: one test record, one eval
  assert [r['split'] for r in records].count('test') == 1
  for split in ('eval', 'test'):
    assert again[split] == pytest.approx(first[split])


def test_a_small_state_is_drawn_on_the_host_when_the_default_device_is_an_accelerator(
    tiny_config, monkeypatch):
  """With an accelerator as the default backend, a model whose parameters
  fit in state.HOST_INIT_BYTES is initialised on the host's CPU and then
  placed (the same values: the random bits depend on the key alone); a
  larger one stays on the default device; on a CPU backend nothing changes."""
  import jax
  from flaxformer_lite import models
  from flaxformer_lite.train import partitioning, state as state_lib

  c = tiny_config
  c.model.vocab_size = 3 + c.data.num_symbols
  model = models.build(c.model)
  example = {'inputs': np.ones((1, 6), np.int32), 'targets': np.ones((1, 6), np.int32)}
  parallel = partitioning.Partitioner('jit')
  shapes = state_lib.abstract_params(model, c, example)
  on_default, _ = loop._init_state(c, model, example, parallel)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(on_default.params))
  assert state_lib.init_device(shapes) is None
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert state_lib.init_device(shapes) == jax.local_devices(backend='cpu')[0]
  on_host, _ = loop._init_state(c, model, example, parallel)
  assert all(x.sharding == parallel.replicated for x in jax.tree.leaves(on_host.params))
  for got, want in zip(jax.tree.leaves(on_host), jax.tree.leaves(on_default)):
    np.testing.assert_array_equal(got, want)
  monkeypatch.setattr(state_lib, 'HOST_INIT_BYTES', nbytes - 1)
  assert state_lib.init_device(shapes) is None
  monkeypatch.setattr(state_lib, 'HOST_INIT_BYTES', nbytes)
  assert state_lib.init_device(shapes) is not None


def test_a_run_stopped_inside_a_log_window_logs_the_same_means_when_resumed(
    tiny_config, tmp_path, monkeypatch):
  """Stopped after step 7 of a window 6..10 (the loop told, as by a signal
  to another process, to stop there), the run checkpoints that step; resumed,
  it logs at step 10 the means over steps 6..10, as the uninterrupted run did:
  the checkpoint carries the window's sums."""
  c = tiny_config
  c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 5, 100, 100
  c.eval.final_test = False  # the test splits' decoding plays no part here
  whole = str(tmp_path / 'whole')
  loop.train_and_evaluate(config_lib.from_json(config_lib.to_json(c)), whole)

  parts, calls = str(tmp_path / 'parts'), []

  def stop_after_step_7(requested):
    calls.append(requested)
    return len(calls) == 7
  with monkeypatch.context() as patched:
    patched.setattr(loop.multihost, 'any_process', stop_after_step_7)
    stopped = loop.train_and_evaluate(config_lib.from_json(config_lib.to_json(c)), parts)
  assert stopped['step'] == 7 and sorted(_train_points(parts)) == [5]
  loop.train_and_evaluate(config_lib.from_json(config_lib.to_json(c)), parts)
  timings = ('steps_per_sec', 'tokens_per_sec')
  want, got = _train_points(whole), _train_points(parts)
  assert sorted(got) == sorted(want) == [5, 10, 15, 20]
  for step in want:  # the same floats: the same sums in the same order
    assert ({k: v for k, v in got[step].items() if k not in timings} ==
            {k: v for k, v in want[step].items() if k not in timings}), step


def test_a_signal_before_the_first_step_stops_the_run_with_nothing_saved(
    tiny_config, tmp_path, monkeypatch, caplog):
  """A signal pending when training would begin (here: preemption.check
  raising as it does then) ends the run with a result, not an error."""
  from flaxformer_lite.train import preemption

  def pending():
    raise preemption.Preempted('SIGTERM')
  monkeypatch.setattr(loop.preemption, 'check', pending)
  workdir = tmp_path / 'w'
  with caplog.at_level('WARNING', logger='flaxformer_lite'):
    result = loop.train_and_evaluate(tiny_config, str(workdir))
  assert result == {'preempted': 'SIGTERM', 'step': None}
  assert 'Stopped on SIGTERM before the first step: nothing new to save' in caplog.text
  assert not (workdir / 'checkpoints').exists() or not list((workdir / 'checkpoints').iterdir())
