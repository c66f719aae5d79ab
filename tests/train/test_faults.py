"""Faults made for real: signals to a training process, damaged checkpoint files, NaN losses."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite.train import checkpoints, loop

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# No assertion here reads the greedy decoder's exact match: its teacher-forced
# equal (tests/train/test_evaluation.py) spares each run tracing the decoder.
TINY = ['--config.eval.sequence_accuracy=teacher_forced',
        '--config.model.d_model=16', '--config.model.num_heads=2', '--config.model.mlp_dim=32',
        '--config.model.num_encoder_layers=1', '--config.model.num_decoder_layers=1',
        '--config.data.max_len=5', '--config.data.num_train=256', '--config.data.num_eval=20',
        '--config.train.batch_size=8', '--config.eval.batch_size=10']


def _steps(workdir):
  d = os.path.join(workdir, 'checkpoints')
  return sorted(int(s) for s in os.listdir(d) if s.isdigit()) if os.path.isdir(d) else []


def _start(workdir, tfds_dir, *extra):
  return subprocess.Popen(
      [sys.executable, '-m', 'flaxformer_lite.main', f'--workdir={workdir}',
       f'--config.data.data_dir={tfds_dir}', *TINY, '--config.train.num_steps=100000',
       '--config.train.log_every=5', '--config.train.checkpoint_every=100000',
       '--config.train.eval_every=100000', *extra],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _last_train_step(workdir) -> int:
  path = os.path.join(workdir, 'metrics.jsonl')
  steps = [0]
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:  # a line being written
          continue
        if record['split'] == 'train':
          steps.append(record['step'])
  return max(steps)


def _wait_for_training(proc, workdir, after=0, timeout=240):
  """Returns once metrics.jsonl holds a train point after step `after` (the
  loop is stepping)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f'training exited early: {proc.communicate()[1][-3000:]}')
    if _last_train_step(workdir) > after:
      return
    time.sleep(0.2)
  proc.kill()
  raise AssertionError('training did not log a step in time')


def test_signals_save_a_checkpoint_exit_0_and_the_same_command_resumes(tmp_path, tfds_dir):
  """SIGTERM, then SIGINT to the same command run again (which resumes from
  the SIGTERM's checkpoint, its train step read from the compilation cache):
  each saves a checkpoint at the step it stops and exits 0."""
  workdir, saved = str(tmp_path / 'w'), []
  for signum in (signal.SIGTERM, signal.SIGINT):
    proc = _start(workdir, tfds_dir)
    _wait_for_training(proc, workdir, after=saved[-1] if saved else 0)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert f'Stopped on {signal.Signals(signum).name}' in err and 'Re-run the same command' in err
    if saved:
      assert f'Resumed from {workdir}/checkpoints at step {saved[-1]}' in out, out[-3000:]
      # the same program as the first run's: read back from the persistent cache
      assert 'train step: cache' in out, out[-3000:]
    # no checkpoint_every step was reached: the newest is this signal's
    steps = _steps(workdir)
    assert steps[:-1] == saved and steps[-1] >= (saved[-1] + 1 if saved else 5), (saved, steps)
    saved.append(steps[-1])


def _train_points(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return {r['step']: (r['loss'], r['grad_norm']) for r in rows if r['split'] == 'train'}


def test_kill_9_at_a_random_moment_then_the_same_command_gives_the_same_run(tmp_path, tfds_dir):
  args = [f'--config.data.data_dir={tfds_dir}', *TINY, '--config.train.num_steps=1500',
          '--config.train.log_every=100', '--config.train.checkpoint_every=100',
          '--config.train.eval_every=100000', '--config.eval.final_test=False']
  command = [sys.executable, '-m', 'flaxformer_lite.main', *args]
  # The reference: never killed, and without the periodic checkpoints (saving
  # is most of a step's time here), which must not change the run.
  reference = str(tmp_path / 'reference')
  proc = subprocess.run([*command, f'--workdir={reference}',
                         '--config.train.checkpoint_every=100000'],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert _steps(reference) == [1500]

  workdir = str(tmp_path / 'killed')
  proc = subprocess.Popen([*command, f'--workdir={workdir}'], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _wait_for_training(proc, workdir)
  time.sleep(np.random.default_rng().uniform(0.0, 1.5))  # anywhere: mid-step, mid-save
  proc.kill()
  proc.communicate()
  killed_at = max(_train_points(workdir))
  assert killed_at < 1500, 'the run finished before the kill: make it longer'
  proc = subprocess.run([*command, f'--workdir={workdir}'], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got, want = _train_points(workdir), _train_points(reference)
  assert sorted(got) == sorted(want), (killed_at, sorted(got))
  assert got == want, f'killed after step {killed_at}'  # bitwise: same floats in the JSON


# The nanoGPT recipe's experiment, small, at context 2048: a train step takes
# a good part of a second on 2 CPU cores, an evaluation of the validation
# split several seconds, and the greedy sample of 1024 tokens several more.
LONG = ['--config=experiments/tiny_shakespeare.py', '--config.model.d_model=64',
        '--config.model.num_heads=2', '--config.model.mlp_dim=128',
        '--config.model.num_decoder_layers=2', '--config.model.max_len=2048',
        '--config.data.max_len=2048', '--config.model.dropout_rate=0',
        '--config.train.batch_size=2', '--config.eval.batch_size=2',
        '--config.eval.final_test=False', '--config.train.checkpoint_every=100000']
PHASES = {
    # phase: (overrides, the log line after which the signal is sent)
    'training': (['--config.train.num_steps=100000', '--config.train.log_every=100000',
                  '--config.train.eval_every=100000'], 'first step done'),
    'evaluation': (['--config.train.num_steps=4', '--config.train.log_every=2',
                    '--config.train.eval_every=2', '--config.eval.num_examples_to_log=0'],
                   'step 2/4'),
    'sampling': (['--config.train.num_steps=4', '--config.train.log_every=2',
                  '--config.train.eval_every=2', '--config.eval.max_examples=2',
                  '--config.eval.num_examples_to_log=1'], 'step 2/4'),
}


@pytest.mark.parametrize('phase', list(PHASES))
def test_a_signal_in_each_phase_stops_the_run_within_seconds(
    tmp_path, shared_data, tfds_dir, phase):
  """Through the command line: SIGTERM while the run trains (a step of its
  own, not a queue of them), evaluates, or samples. The message comes when
  the signal does; the run exits 0 within seconds, without finishing the
  phase, with a checkpoint of the steps it trained. The same command resumes
  from it: after training,
  test_signals_save_a_checkpoint_exit_0_and_the_same_command_resumes; after
  an evaluation, at small shapes, the tests of runs stopped in an evaluation
  below, which hold the resumed run to an uninterrupted one."""
  overrides, marker = PHASES[phase]
  workdir = str(tmp_path / 'w')
  command = [sys.executable, '-m', 'flaxformer_lite.main', LONG[0], f'--workdir={workdir}',
             f'--config.data.data_dir={tfds_dir}', *LONG[1:], *overrides]
  env = {**os.environ, 'FFL_SHARED_DATA': shared_data}
  proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if marker in line:
      break
  else:
    raise AssertionError(f'no {marker!r} line: {"".join(lines)[-3000:]}')
  if phase == 'training':
    time.sleep(2)  # a few steps into the run
  sent = time.time()
  proc.send_signal(signal.SIGTERM)
  rest, _ = proc.communicate(timeout=120)
  took = time.time() - sent
  log = ''.join(lines) + rest
  assert proc.returncode == 0, log[-3000:]
  assert 'SIGTERM received' in rest and 'Stopped on SIGTERM' in rest, log[-3000:]
  assert took < 15, f'{took:.1f} s from the signal to the exit: {log[-3000:]}'
  saved = _steps(workdir)
  if phase == 'training':  # (a queue of dispatched steps would take minutes to drain)
    assert saved and f'Stopped on SIGTERM at step {saved[-1]} of 100000' in rest, (saved, log)
  else:
    assert saved == [2], (saved, log[-3000:])
    # the phase did not finish: no evaluation at step 2, no sample written
    assert 'eval at step 2' not in log, log[-3000:]
    assert not os.path.exists(os.path.join(workdir, 'sample.txt'))


def test_second_signal_exits_at_once():
  # A training step here takes ~1 ms, so a second signal to the training loop
  # arrives after it has already saved and left; drive the handler directly
  # in a process that would otherwise keep running.
  code = (
      'import os, signal, time\n'
      'from flaxformer_lite.train.preemption import Preemption\n'
      'with Preemption() as p:\n'
      '  os.kill(os.getpid(), signal.SIGTERM)\n'
      '  time.sleep(0.2)\n'
      '  assert p.requested == "SIGTERM", p.requested\n'
      '  print("first handled", flush=True)\n'
      '  os.kill(os.getpid(), signal.SIGINT)\n'
      '  time.sleep(10)\n'
      'print("not reached")\n')
  proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
  assert proc.stdout == 'first handled\n'
  assert 'SIGINT again: exiting now' in proc.stderr
  # the code the README's list gives (./launch.sh --help's: tests/test_launch.py)
  with open(os.path.join(REPO, 'README.md')) as f:
    readme = ' '.join(f.read().split())
  assert f'{128 + signal.SIGINT} a second SIGINT ({128 + signal.SIGTERM} a second SIGTERM' in readme


def _damage(step_dir):
  """Truncates every array data file of a checkpoint (as a full disk or a killed copy would)."""
  damaged = 0
  for root, _, files in os.walk(os.path.join(step_dir, 'state')):
    for name in files:
      path = os.path.join(root, name)
      if os.path.getsize(path) > 0 and 'metadata' not in name.lower():
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 3)
        damaged += 1
  assert damaged, f'no data files under {step_dir}'


def _train_loss(workdir, step):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [r['loss'] for r in rows if r['split'] == 'train' and r['step'] == step][-1]


def test_unreadable_newest_checkpoint_falls_back_and_is_kept(tiny_config, tmp_path, caplog):
  c = tiny_config  # 20 steps, checkpoints at 10 and 20
  c.eval.final_test = False  # the test splits' decoding plays no part here
  reference = str(tmp_path / 'reference')
  loop.train_and_evaluate(config_lib.from_json(config_lib.to_json(c)), reference)

  # The same run's workdir: a copy of the reference's (training it again gives the same files).
  workdir = str(tmp_path / 'w')
  shutil.copytree(reference, workdir)
  _damage(os.path.join(workdir, 'checkpoints', '20'))
  longer = config_lib.from_json(config_lib.to_json(c))
  longer.train.num_steps = 20  # the same command again
  with caplog.at_level('WARNING', logger='flaxformer_lite'):
    loop.train_and_evaluate(longer, workdir)
  assert 'checkpoints/20 cannot be restored' in caplog.text
  # Resumed from 10 and redid 11..20 exactly as the uninterrupted run did.
  np.testing.assert_allclose(_train_loss(workdir, 20), _train_loss(reference, 20), rtol=1e-6)
  assert _steps(workdir) == [10, 20]
  assert os.path.isdir(os.path.join(workdir, 'checkpoints_unreadable', '20'))  # kept, not deleted


def test_no_readable_checkpoint_exits_2_and_changes_nothing(tiny_config, tmp_path, tfds_dir):
  c = tiny_config
  c.train.num_steps = 10
  workdir = str(tmp_path / 'w')
  loop.train_and_evaluate(c, workdir)
  _damage(os.path.join(workdir, 'checkpoints', '10'))
  before = sorted(os.walk(workdir))
  with pytest.raises(checkpoints.CheckpointError, match='no checkpoint in .* can be restored'):
    loop.train_and_evaluate(config_lib.from_json(config_lib.to_json(c)), workdir)
  assert sorted(os.walk(workdir)) == before


def test_nonfinite_loss_exits_3_naming_the_last_good_checkpoint(tmp_path, tfds_dir):
  # lr 1e30: the first update is finite (Adam steps are ~lr in size), the next loss is not.
  workdir = tmp_path / 'w'
  proc = subprocess.run(
      [sys.executable, '-m', 'flaxformer_lite.main', f'--workdir={workdir}',
       f'--config.data.data_dir={tfds_dir}', *TINY, '--config.train.num_steps=6',
       '--config.train.schedule=constant', '--config.train.learning_rate=1e30',
       '--config.train.log_every=3', '--config.train.checkpoint_every=1'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert 'the last good checkpoint is step 1' in proc.stderr
  assert _steps(str(workdir)) == [1]  # nothing saved after the loss went bad


def test_skip_nonfinite_keeps_training_and_counts_skipped_steps(tiny_config, tmp_path):
  # rsqrt with factor 1e32: the first update is finite (Adam moves each weight
  # by ~lr = 5.6e29), every later loss is not, so steps 2..6 are skipped.
  c = tiny_config
  c.train.num_steps, c.train.log_every, c.train.checkpoint_every = 6, 3, 3
  c.train.schedule, c.train.learning_rate, c.train.warmup_steps = 'rsqrt', 1e32, 10
  c.train.skip_nonfinite = True
  c.eval.final_test = False  # the test splits' decoding plays no part here
  workdir = str(tmp_path / 'w')
  loop.train_and_evaluate(c, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    train = [json.loads(line) for line in f if '"train"' in line]
  assert [r['skipped_steps'] for r in train] == [2, 3]  # step 1 is the only finite one
  assert all(np.isfinite(r['loss']) for r in train)
  # The learning rate logged is the one applied: one update was made, at the
  # optimizer's count 0 (Vaswani et al. eq. 3 with s = 1), not the schedule at
  # the loop's step 3 or 6.
  d, warmup = c.model.d_model, c.train.warmup_steps
  applied = 1e32 * d ** -0.5 * min(1.0, 1.0 * warmup ** -1.5)
  for r in train:
    assert r['learning_rate'] == pytest.approx(applied, rel=1e-6)
  # grad_norm is the mean over the steps that updated: step 1's alone, then none.
  first = config_lib.from_json(config_lib.to_json(c))
  first.train.num_steps, first.train.log_every = 1, 1
  loop.train_and_evaluate(first, str(tmp_path / 'one'))
  with open(os.path.join(str(tmp_path / 'one'), 'metrics.jsonl')) as f:
    step_1 = [json.loads(line) for line in f if '"train"' in line][0]
  assert train[0]['grad_norm'] == pytest.approx(step_1['grad_norm'], rel=1e-6)
  assert 'grad_norm' not in train[1]


def test_unwritable_workdir_exits_2_before_training(tmp_path, tfds_dir):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  proc = subprocess.run(
      [sys.executable, '-m', 'flaxformer_lite.main', f'--workdir={blocker}/run',
       f'--config.data.data_dir={tfds_dir}', *TINY, '--config.train.num_steps=2'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert f'workdir {blocker}/run cannot be written' in proc.stderr
  assert 'Traceback' not in proc.stderr


# The default experiment, tiny, its validation and test splits in batches
# small enough that evaluating each outlasts the signal's way to the run: a
# signal sent when one begins arrives inside it.
FINAL = ['--config.model.d_model=16', '--config.model.num_heads=2', '--config.model.mlp_dim=32',
         '--config.model.num_encoder_layers=1', '--config.model.num_decoder_layers=1',
         '--config.data.max_len=8', '--config.data.num_train=64', '--config.data.num_eval=400',
         '--config.train.batch_size=8', '--config.eval.batch_size=10',
         '--config.train.num_steps=2', '--config.eval.num_examples_to_log=0']
TIMINGS = ('steps_per_sec', 'tokens_per_sec')  # the only values two runs need not share


def _launch(args, workdir, env, marker=None, signum=None):
  """`./launch.sh ARGS --workdir=workdir`; with a marker, `signum` is sent
  once a line holding it is printed. Returns (exit code, the log, seconds
  from the signal to the exit)."""
  proc = subprocess.Popen(['bash', os.path.join(REPO, 'launch.sh'), *args,
                           f'--workdir={workdir}'], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines, sent = [], time.time()
  if marker is not None:
    for line in proc.stdout:
      lines.append(line)
      if marker in line:
        sent = time.time()
        proc.send_signal(signum)
        break
    else:
      raise AssertionError(f'no {marker!r} line: {"".join(lines)[-3000:]}')
  rest, _ = proc.communicate(timeout=300)
  return proc.returncode, ''.join(lines) + rest, time.time() - sent


def _records(workdir):
  """metrics.jsonl's points, in order, without their timings."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in f]


def test_a_run_stopped_in_its_final_evaluation_and_test_ends_as_an_uninterrupted_one(
    tmp_path, tfds_dir):
  """Through ./launch.sh, the default experiment: SIGTERM when the final
  validation begins, then SIGINT to the re-run when its test begins. Each is
  answered within seconds with exit 0, leaving its phase unrecorded; the third
  run does only the test, and metrics.jsonl ends point for point, value for
  value, as the uninterrupted run's."""
  env = {**os.environ, 'FFL_PYTHON': sys.executable, 'TFDS_DATA_DIR': tfds_dir}
  reference, workdir = str(tmp_path / 'reference'), str(tmp_path / 'w')
  code, log, _ = _launch(FINAL, reference, env)
  assert code == 0, log[-3000:]
  assert [r['split'] for r in _records(reference)] == ['train', 'eval', 'test']

  code, log, took = _launch(FINAL, workdir, env, 'step 2/2', signal.SIGTERM)
  assert code == 0 and 'Stopped on SIGTERM at step 2 of 2' in log, log[-3000:]
  assert took < 5, f'{took:.1f} s from the signal to the exit: {log[-3000:]}'
  assert 'eval at step 2' not in log and _steps(workdir) == [2], log[-3000:]
  assert [r['split'] for r in _records(workdir)] == ['train']

  code, log, took = _launch(FINAL, workdir, env, 'eval at step 2 (', signal.SIGINT)
  assert code == 0 and 'Stopped on SIGINT while evaluating at step 2' in log, log[-3000:]
  assert took < 5, f'{took:.1f} s from the signal to the exit: {log[-3000:]}'
  assert 'test (' not in log, log[-3000:]
  assert [r['split'] for r in _records(workdir)] == ['train', 'eval']

  code, log, _ = _launch(FINAL, workdir, env)
  assert code == 0, log[-3000:]
  assert 'eval at step 2 (recorded)' in log and 'test (' in log, log[-3000:]
  assert _records(workdir) == _records(reference)


# The long-context experiment, tiny, evaluated at steps 2 and 4: an
# evaluation scores the validation split at two contexts, in batches small
# enough that it outlasts the signal's way to the run, then samples.
LONG_TINY = ['experiments/tiny_shakespeare_long.py', '--config.model.d_model=16',
              '--config.model.num_heads=2', '--config.model.mlp_dim=32',
              '--config.model.num_decoder_layers=1', '--config.model.max_len=256',
              '--config.data.max_len=64', '--config.train.batch_size=2',
              '--config.train.num_steps=4', '--config.train.log_every=2',
              '--config.train.eval_every=2', '--config.train.checkpoint_every=4',
              '--config.eval.contexts=(128,)', '--config.eval.batch_tokens=256',
              '--config.eval.sample_prompt=32', '--config.eval.sample_len=64']


def test_a_long_context_run_stopped_in_an_evaluation_ends_with_the_same_metrics_and_sample(
    tmp_path, tfds_dir, shared_data):
  """Through ./launch.sh, the long-context experiment: SIGTERM when the
  evaluation at step 2 of 4 begins stops the run within seconds, with a
  checkpoint at step 2 and neither that evaluation recorded nor a sample
  written. The same command again evaluates step 2 first, trains on, and ends
  with metrics.jsonl and sample.txt equal to an uninterrupted run's."""
  env = {**os.environ, 'FFL_PYTHON': sys.executable, 'TFDS_DATA_DIR': tfds_dir,
         'FFL_SHARED_DATA': shared_data}
  reference, workdir = tmp_path / 'reference', tmp_path / 'w'
  code, log, _ = _launch(LONG_TINY, reference, env)
  assert code == 0, log[-3000:]
  order = [(2, 'train'), (2, 'eval'), (4, 'train'), (4, 'eval')]
  assert [(r['step'], r['split']) for r in _records(reference)] == order

  code, log, took = _launch(LONG_TINY, workdir, env, 'step 2/4', signal.SIGTERM)
  assert code == 0 and 'Stopped on SIGTERM at step 2 of 4' in log, log[-3000:]
  assert took < 5, f'{took:.1f} s from the signal to the exit: {log[-3000:]}'
  assert 'eval at step 2' not in log and not (workdir / 'sample.txt').exists(), log[-3000:]
  assert _steps(str(workdir)) == [2]

  code, log, _ = _launch(LONG_TINY, workdir, env)
  assert code == 0, log[-3000:]
  assert f'Resumed from {workdir}/checkpoints at step 2' in log, log[-3000:]
  assert _records(workdir) == _records(reference)
  assert (workdir / 'sample.txt').read_text() == (reference / 'sample.txt').read_text()
