"""plot_attention: PNGs from a trained workdir, the weights it plots, exit 2."""
import functools
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import models, plot_attention
from flaxformer_lite.train import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _tiny(tfds_dir):
  """tests/conftest.py's tiny sizes, smaller still: 2 encoder + 1 decoder layers."""
  c = config_lib.base_config()
  c.model.d_model, c.model.num_heads, c.model.mlp_dim = 16, 2, 32
  c.model.num_encoder_layers, c.model.num_decoder_layers = 2, 1
  c.model.max_len = 64
  c.train.num_steps, c.train.batch_size, c.train.warmup_steps = 3, 8, 10
  c.train.log_every = c.train.eval_every = c.train.checkpoint_every = 3
  c.data.max_len, c.data.num_symbols = 5, 6
  c.data.num_train, c.data.num_eval = 64, 10
  c.data.data_dir = tfds_dir
  c.eval.batch_size, c.eval.num_examples_to_log, c.eval.final_test = 10, 0, False
  return c


@pytest.fixture(scope='module')
def workdir(tfds_dir, tmp_path_factory):
  """A workdir of a tiny encoder-decoder trained for 3 steps."""
  path = str(tmp_path_factory.mktemp('plot') / 'run')
  loop.train_and_evaluate(_tiny(tfds_dir), path)
  return path


@pytest.fixture(scope='module')
def run(workdir):
  return plot_attention.load_run(workdir)


def _plot_cli(*args):
  """The command line, sharing this session's compilation cache (conftest.py):
  it compiles what the tests before it compiled in-process."""
  env = {**os.environ,
         'JAX_COMPILATION_CACHE_DIR': jax.config.jax_compilation_cache_dir or '',
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
         'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0'}
  return subprocess.run([sys.executable, '-m', 'flaxformer_lite.plot_attention', *args],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _recomputed(params, x_q, x_kv, head):
  """softmax(q.k / sqrt(d)) for one head, from the layer's own kernels, in float64.

  x_q [n, f], x_kv [m, f] -> [n, m].
  """
  def project(name, x):
    p = params[name]
    return (np.einsum('nf,fhd->nhd', x, np.asarray(p['kernel'], np.float64))
            + np.asarray(p['bias'], np.float64))[:, head]
  q, k = project('query', x_q), project('key', x_kv)
  return _softmax(q @ k.T / np.sqrt(q.shape[-1]))


def test_plotted_weights_are_masked_softmax_rows_of_the_layers_own_projections(run):
  assert run.step == 3
  inputs = plot_attention.trim(run.dataset.splits['test']['inputs'][1])
  decoded = plot_attention.greedy_decode(run.config, run.params, inputs, 6)
  maps = {m.path: m for m in plot_attention.attention_maps(run.config, run.params,
                                                           inputs, decoded)}
  m, n = len(inputs), len(decoded)
  shapes = {'encoder/layer_0/self_attention': (2, m, m),
            'encoder/layer_1/self_attention': (2, m, m),
            'decoder/layer_0/self_attention': (2, n, n),
            'decoder/layer_0/cross_attention': (2, n, m)}
  assert {p: a.weights.shape for p, a in maps.items()} == shapes
  for a in maps.values():
    np.testing.assert_allclose(a.weights.sum(-1), 1.0, atol=1e-5)
    assert (len(a.queries), len(a.keys)) == a.weights.shape[1:]
  causal = maps['decoder/layer_0/self_attention']
  above = np.triu_indices(n, 1)  # keys after the query: masked
  assert np.all(causal.weights[:, above[0], above[1]] == 0)
  names = {0: '<pad>', 1: '<s>', 2: '</s>'}
  assert causal.queries == [names.get(int(t), str(int(t))) for t in decoded]
  assert causal.keys == ['<s>'] + causal.queries[:-1]

  # The attention layers' inputs are the pre-LN outputs; read them back.
  model = models.build(run.config.model)
  forward = jax.jit(functools.partial(
      model.apply, capture_intermediates=lambda mdl, _: isinstance(mdl, nn.LayerNorm),
      mutable=['intermediates']))
  _, state = forward({'params': run.params}, inputs[None], models.shift_right(decoded[None]))
  seen = jax.tree.map(lambda x: np.asarray(x[0][0], np.float64), state['intermediates'],
                      is_leaf=lambda x: isinstance(x, tuple))
  enc_in = seen['encoder']['layer_1']['attention_block']['norm']['__call__']
  np.testing.assert_allclose(
      maps['encoder/layer_1/self_attention'].weights[1],
      _recomputed(run.params['encoder']['layer_1']['self_attention'], enc_in, enc_in, 1),
      atol=1e-5)
  cross_in = seen['decoder']['layer_0']['cross_attention_block']['norm']['__call__']
  encoded = seen['encoder']['final_norm']['__call__']
  np.testing.assert_allclose(
      maps['decoder/layer_0/cross_attention'].weights[0],
      _recomputed(run.params['decoder']['layer_0']['cross_attention'], cross_in, encoded, 0),
      atol=1e-5)


def test_command_line_writes_one_png_per_attention_layer(workdir):
  """The example of the test above: its compilations are in the cache."""
  out = os.path.join(workdir, 'maps')
  proc = _plot_cli(f'--workdir={workdir}', '--split=test', '--example=1', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  want = ['decoder.layer_0.cross_attention.png', 'decoder.layer_0.self_attention.png',
          'encoder.layer_0.self_attention.png', 'encoder.layer_1.self_attention.png']
  assert sorted(os.listdir(out)) == want
  assert sorted(proc.stdout.split()) == [os.path.join(out, name) for name in want]
  for name in want:
    with open(os.path.join(out, name), 'rb') as f:
      assert f.read(8) == PNG_MAGIC


def test_rnn_decoder_weights_are_found_by_walking_the_intermediates(tfds_dir, tmp_path):
  c = _tiny(tfds_dir)
  c.model.type, c.model.num_encoder_layers, c.model.vocab_size = 'rnn_seq2seq', 1, 9
  inputs, decoded = np.array([5, 3, 4, 2]), np.array([4, 3, 2])
  shapes = jax.eval_shape(models.build(c.model).init, jax.random.key(0), inputs[None],
                          decoded[None])['params']
  rng = np.random.default_rng(0)  # random parameters: no init to compile
  params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), shapes)
  (a,) = plot_attention.attention_maps(c, params, inputs, decoded)
  assert (a.path, a.query_axis, a.key_axis) == ('decoder', 'output', 'input')
  assert a.weights.shape == (2, 3, 4)
  np.testing.assert_allclose(a.weights.sum(-1), 1.0, atol=1e-5)
  (png,) = plot_attention.plot([a], str(tmp_path), 'rnn')
  with open(png, 'rb') as f:
    assert f.read(8) == PNG_MAGIC


def test_a_workdir_without_a_run_exits_2(tmp_path, workdir):
  empty = tmp_path / 'empty'
  empty.mkdir()
  proc = _plot_cli(f'--workdir={empty}')
  assert proc.returncode == 2
  assert 'error:' in proc.stderr and 'config.json' in proc.stderr
  assert 'Traceback' not in proc.stderr
  assert os.listdir(empty) == []  # nothing created

  config_only = tmp_path / 'config_only'
  config_only.mkdir()
  shutil.copy(os.path.join(workdir, 'config.json'), config_only)
  with pytest.raises(plot_attention.UsageError, match='no checkpoints'):
    plot_attention.load_run(str(config_only))
  assert os.listdir(config_only) == ['config.json']
