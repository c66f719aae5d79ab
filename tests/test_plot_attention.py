"""plot_attention: PNGs from a trained workdir, the weights it plots, exit 2."""
import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import models, plot_attention
from flaxformer_lite.layers import scan
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
  assert proc.stderr == ''  # no library's notices either (tfds's custom-config warning)
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


def test_a_decoder_only_model_attends_over_its_own_input(tfds_dir, tmp_path):
  """A language model's params and config without a workdir: causal maps,
  both axes its input tokens, labels and subplot titles as given."""
  c = _tiny(tfds_dir)
  c.model.type, c.model.num_encoder_layers, c.model.vocab_size = 'decoder_only', 0, 9
  inputs = np.array([5, 3, 4, 2, 7])
  shapes = jax.eval_shape(models.build(c.model).init, jax.random.key(0),
                          inputs[None])['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), shapes)
  (a,) = plot_attention.attention_maps(c, params, inputs, label=lambda t: 'abcdefghi'[t])
  assert (a.path, a.query_axis, a.key_axis) == ('decoder/layer_0/self_attention', 'input',
                                                'input')
  assert a.weights.shape == (2, 5, 5) and a.queries == a.keys == list('fdech')
  np.testing.assert_allclose(a.weights.sum(-1), 1.0, atol=1e-5)
  assert np.all(a.weights[:, np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0)
  a.heads = ['layer 0 head 0', 'layer 0 head 1']
  (png,) = plot_attention.plot([a], str(tmp_path), 'lm')
  with open(png, 'rb') as f:
    assert f.read(8) == PNG_MAGIC


def test_a_scanned_model_gives_the_unrolled_maps(tfds_dir):
  """model.scan_layers sows [L, ...] under `layers`: the maps, their paths and
  labels are the unrolled model's, with its weights stacked."""
  c = _tiny(tfds_dir)
  c.model.num_decoder_layers, c.model.vocab_size = 2, 9
  inputs, decoded = np.array([5, 3, 4, 2]), np.array([4, 3, 2])
  shapes = nn.unbox(jax.eval_shape(models.build(c.model).init, jax.random.key(0),
                                   inputs[None], decoded[None])['params'])
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), shapes)
  want = plot_attention.attention_maps(c, params, inputs, decoded)
  c.model.scan_layers = True
  got = plot_attention.attention_maps(c, scan.stack_layers(params), inputs, decoded)
  assert [m.path for m in got] == [m.path for m in want]
  assert len(want) == 6  # 2 encoder self, 2 decoder self, 2 cross
  for a, b in zip(got, want):
    assert (a.queries, a.keys, a.query_axis, a.key_axis) == (b.queries, b.keys, b.query_axis,
                                                             b.key_axis)
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-5, atol=1e-6, err_msg=a.path)


def test_a_workdir_without_a_run_exits_2(tmp_path, tfds_dir):
  empty = tmp_path / 'empty'
  empty.mkdir()
  proc = _plot_cli(f'--workdir={empty}')
  assert proc.returncode == 2
  assert 'error:' in proc.stderr and 'config.json' in proc.stderr
  assert 'Traceback' not in proc.stderr
  assert os.listdir(empty) == []  # nothing created

  config_only = tmp_path / 'config_only'
  config_only.mkdir()
  (config_only / 'config.json').write_text(config_lib.to_json(_tiny(tfds_dir)))
  with pytest.raises(plot_attention.UsageError, match='no checkpoints'):
    plot_attention.load_run(str(config_only))
  assert os.listdir(config_only) == ['config.json']


def test_a_window_is_a_slice_of_at_most_max_window_input_tokens():
  ids = np.arange(10)
  whole, note = plot_attention.select_window(ids, None, max_window=16)
  np.testing.assert_array_equal(whole, ids)
  assert note == ''
  first, note = plot_attention.select_window(ids, None, max_window=4)
  np.testing.assert_array_equal(first, ids[:4])
  assert note == '  input tokens 0:4 of 10'
  np.testing.assert_array_equal(plot_attention.select_window(ids, (3, 7), 4)[0], ids[3:7])
  np.testing.assert_array_equal(plot_attention.select_window(ids, (8, 12), 4)[0], ids[8:])
  with pytest.raises(plot_attention.UsageError,
                     match=r'--window=2:7 asks for 5 tokens.*at most 4.*--window=2:6'):
    plot_attention.select_window(ids, (2, 7), 4)
  with pytest.raises(plot_attention.UsageError, match='--window=10:12 starts past'):
    plot_attention.select_window(ids, (10, 12), 4)
  assert plot_attention.parse_window('3:7') == (3, 7)
  for bad in ('7:3', '3:3', '7', 'a:b', '-1:4', '1:2:3'):
    with pytest.raises(plot_attention.UsageError, match='is not START:STOP'):
      plot_attention.parse_window(bad)


def test_only_the_window_goes_through_the_model(workdir, run, tmp_path, monkeypatch):
  split = run.dataset.splits['test']['inputs']
  example = next(i for i, ids in enumerate(split) if len(plot_attention.trim(ids)) >= 4)
  inputs = plot_attention.trim(split[example])
  seen = {}
  real_plot = plot_attention.plot

  def plot(maps, out_dir, title, notes=None):
    seen.update(maps={m.path: m for m in maps}, title=title)
    return real_plot(maps, out_dir, title, notes)

  monkeypatch.setattr(plot_attention, 'plot', plot)
  pngs = plot_attention.plot_run(workdir, 'test', example, str(tmp_path), window=(1, 3),
                                 max_window=2)
  assert len(pngs) == 4
  assert f'input tokens 1:3 of {len(inputs)}' in seen['title']
  encoder = seen['maps']['encoder/layer_0/self_attention']
  assert encoder.weights.shape == (2, 2, 2)
  assert encoder.keys == [str(int(t)) for t in inputs[1:3]]
  _, n, m = seen['maps']['decoder/layer_0/cross_attention'].weights.shape
  assert n <= 2 and m == 2  # the decoded output stops at max_window tokens too


def test_long_axes_keep_the_figure_readable(tmp_path):
  """Past LABELLED_TOKENS an axis gets index ticks and the figure stops growing."""
  n = 4 * plot_attention.LABELLED_TOKENS
  weights = np.full((2, n, n), 1.0 / n, np.float32)
  labels = [str(i) for i in range(n)]
  a = plot_attention.AttentionMap('encoder/layer_0/self_attention', weights, labels, labels,
                                  'input', 'input')
  (png,) = plot_attention.plot([a], str(tmp_path), 'long')
  with open(png, 'rb') as f:
    header = f.read(24)
  assert header[:8] == PNG_MAGIC
  width, height = int.from_bytes(header[16:20], 'big'), int.from_bytes(header[20:24], 'big')
  # dpi 100: two heads of at most 8 inches, a margin and the colour bar
  assert width <= 100 * (1.5 + 2 * 8.0) and height <= 100 * (1.0 + 0.8 + 8.0), (width, height)


def test_many_heads_wrap_into_rows_that_fit_a_page(tmp_path):
  """Four labelled 64-token heads: a 2 x 2 grid, not one row 4 heads wide."""
  n = plot_attention.LABELLED_TOKENS
  weights = np.full((4, n, n), 1.0 / n, np.float32)
  labels = [f't{i}' for i in range(n)]
  a = plot_attention.AttentionMap('attention_heads', weights, labels, labels, 'input', 'input')
  (png,) = plot_attention.plot([a], str(tmp_path), 'heads')
  with open(png, 'rb') as f:
    header = f.read(24)
  width, height = int.from_bytes(header[16:20], 'big'), int.from_bytes(header[20:24], 'big')
  assert width <= 100 * (1.5 + 2 * 8.0) and height <= 100 * (1.0 + 2 * (0.8 + 8.0))
  assert 0.5 < width / height < 2.0, (width, height)


def test_a_window_wider_than_the_bound_exits_2_before_loading(tmp_path):
  proc = _plot_cli(f'--workdir={tmp_path}', '--window=0:5000')
  assert proc.returncode == 2
  assert '--window=0:5000 asks for 5000 tokens' in proc.stderr
  assert f'at most {plot_attention.MAX_WINDOW}' in proc.stderr
  assert 'Traceback' not in proc.stderr
