"""Multi-host through jax.distributed, as real processes on 127.0.0.1:
a dead process stops the job; a signal to one process stops both at one step,
with one checkpoint, and the job resumed from it gives the curve of 1 process
with the same 2 devices."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# No assertion here reads the greedy decoder's exact match: its teacher-forced
# equal (tests/train/test_evaluation.py) spares each run tracing the decoder.
TINY = ['--config.eval.sequence_accuracy=teacher_forced',
        '--config.model.d_model=16', '--config.model.num_heads=2', '--config.model.mlp_dim=32',
        '--config.model.num_encoder_layers=1', '--config.model.num_decoder_layers=1',
        '--config.model.dropout_rate=0.0', '--config.data.max_len=5',
        '--config.data.num_train=256', '--config.data.num_eval=20',
        '--config.train.batch_size=8', '--config.eval.batch_size=10',
        '--config.eval.final_test=False', '--config.train.log_every=5',
        '--config.train.eval_every=10', '--config.train.checkpoint_every=10']


def _command(workdir, tfds_dir, *extra):
  return [sys.executable, '-m', 'flaxformer_lite.main', f'--workdir={workdir}',
          f'--config.data.data_dir={tfds_dir}', *TINY, *extra]


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {r['step']: r['loss'] for r in map(json.loads, f) if r['split'] == 'train'}


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith('FFL_')}
  env.update(JAX_PLATFORMS='cpu', **extra)
  return env


def test_a_dead_process_stops_the_others_with_an_error(tfds_dir, tmp_path):
  workdir = str(tmp_path / 'w')
  log = tmp_path / 'stderr.txt'
  with open(log, 'w') as err_file:  # a file, not a pipe: nobody blocks on a full buffer
    proc = subprocess.Popen(_command(workdir, tfds_dir, '--config.train.num_steps=100000',
                                     '--config.train.checkpoint_every=100000',
                                     '--local_processes=2'),
                            cwd=REPO, env=_env(), stderr=err_file, text=True)
  deadline = time.time() + 240
  while time.time() < deadline and not os.path.exists(os.path.join(workdir, 'metrics.jsonl')):
    time.sleep(0.5)
  assert os.path.exists(os.path.join(workdir, 'metrics.jsonl')), log.read_text()[-3000:]
  pids = [int(p) for p in re.findall(r'launch: process \d of 2 is pid (\d+)', log.read_text())]
  assert len(pids) == 2
  os.kill(pids[1], signal.SIGKILL)
  start = time.time()
  try:
    proc.wait(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise AssertionError('the job hung after one of its processes died')
  err = log.read_text()
  assert proc.returncode == 128 + signal.SIGKILL
  assert 'process 1 exited with code 137; stopping the others' in err
  assert time.time() - start < 60
  with pytest.raises(ProcessLookupError):  # the survivor is gone too
    os.kill(pids[0], 0)


def test_a_signal_to_one_process_stops_both_at_one_step_and_resumes_to_the_curve_of_one(tmp_path):
  """README: a signal to any process of a multi-host job stops all of them at
  the same step with a checkpoint. SIGTERM to process 1 only: both exit 0
  (the launcher's code is 0 only when every process's is), both log the stop
  at one step, one complete checkpoint holds that step, and the same command
  resumes from it to the end. The 2-process curve, its steps before the stop
  and after the resume, is the curve of 1 process with the same 2 devices
  (uninterrupted): one run checks both the multi-host step and the resume."""
  workdir, num_steps = str(tmp_path / 'w'), 40
  # Every step logged: the first train record shows both processes inside the
  # loop (each step is a collective), where the signal handler is installed.
  # No periodic checkpoint or evaluation: the stop writes the only checkpoint.
  # A data dir of its own, empty: both processes find the dataset missing, and
  # process 0 alone prepares it (data.load).
  command = _command(workdir, str(tmp_path / 'tfds'), f'--config.train.num_steps={num_steps}',
                     '--config.train.log_every=1', f'--config.train.eval_every={num_steps}',
                     '--config.train.checkpoint_every=100000', '--local_processes=2')
  metrics = os.path.join(workdir, 'metrics.jsonl')
  log = tmp_path / 'stderr.txt'
  with open(log, 'w') as err_file:
    proc = subprocess.Popen(command, cwd=REPO, env=_env(), stderr=err_file, text=True)
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None and not (
      os.path.exists(metrics) and _losses(workdir)):
    time.sleep(0.05)
  pids = [int(p) for p in re.findall(r'launch: process \d of 2 is pid (\d+)', log.read_text())]
  assert len(pids) == 2 and proc.poll() is None, log.read_text()[-3000:]
  os.kill(pids[1], signal.SIGTERM)
  try:
    proc.wait(timeout=120)
  except subprocess.TimeoutExpired:
    for pid in [proc.pid, *pids]:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    raise AssertionError('the job did not stop: ' + log.read_text()[-3000:]) from None
  err = log.read_text()
  assert proc.returncode == 0, err[-3000:]
  stops = re.findall(r'^\S+ (\[1\] )?Stopped on (.+) at step (\d+) of \d+; checkpoint saved '
                     r'in \S+\. Re-run the same command to resume\.$', err, re.M)
  assert sorted((p, reason) for p, reason, _ in stops) == [
      ('', 'a signal to another process'), ('[1] ', 'SIGTERM')], err[-3000:]
  step = int(stops[0][2])
  assert {int(s) for _, _, s in stops} == {step} and 1 <= step < num_steps, stops
  assert err.count('SIGTERM received') == 1  # process 1's; process 0 got no signal
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == [str(step)]
  assert max(_losses(workdir)) == step

  done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert len(re.findall(r'launch: process \d of 2 is pid', done.stderr)) == 2
  assert re.search(rf'Resumed from \S+ at step {step}\n', done.stdout), done.stdout[-3000:]
  assert 'Stopped on' not in done.stderr
  assert sorted(_losses(workdir)) == list(range(1, num_steps + 1))
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints')), key=int) == [
      str(step), str(num_steps)]

  # The reference: 1 process with 2 devices, the same config, never stopped.
  one = str(tmp_path / 'one')
  done = subprocess.run([arg for arg in command if arg != '--local_processes=2'
                         and not arg.startswith('--workdir=')] + [f'--workdir={one}'],
                        cwd=REPO, env=_env(XLA_FLAGS=os.environ.get('XLA_FLAGS', '')
                                 + ' --xla_force_host_platform_device_count=2'),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'over 2 device(s)' in done.stdout and 'launch: process' not in done.stderr
  a, b = _losses(one), _losses(workdir)
  assert sorted(a) == sorted(b) == list(range(1, num_steps + 1))
  for s in a:
    assert b[s] == pytest.approx(a[s], rel=2e-5), (s, step)
