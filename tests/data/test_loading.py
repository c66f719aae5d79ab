"""data.load: independent processes sharing a data dir prepare it one at a time."""
import fcntl
import os
import subprocess
import sys
import time

CHILD = '''
import sys
from flaxformer_lite import config as config_lib
from flaxformer_lite.data import loading
d = config_lib.base_config().data
d.data_dir, d.num_train, d.num_eval = sys.argv[1], 32, 8
print('loading', flush=True)
dataset = loading.load(d)
print('loaded', len(dataset.splits['train']['inputs']), flush=True)
'''


def test_a_second_process_waits_for_the_data_dir_lock(tmp_path):
  data_dir = str(tmp_path / 'tfds')
  os.makedirs(data_dir)
  with open(os.path.join(data_dir, '.flaxformer_lite.lock'), 'a') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing the data
    child = subprocess.Popen([sys.executable, '-c', CHILD, data_dir], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == 'loading'
    time.sleep(1.5)
    assert child.poll() is None  # waiting, and nothing written meanwhile
    assert os.listdir(data_dir) == ['.flaxformer_lite.lock']
    fcntl.flock(lock, fcntl.LOCK_UN)
  out, err = child.communicate(timeout=120)
  assert child.returncode == 0, err[-2000:]
  assert out.split()[-2:] == ['loaded', '32']
