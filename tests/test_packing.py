"""Packed sequences (data.pack): several examples per row, each as if alone.

The reference for every variant is the same model applied to each example on
its own row; a packed row must give each example exactly those logits and
loss. The packing itself is checked by unpacking it with its segment ids.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import config as config_lib
from flaxformer_lite import main
from flaxformer_lite import models
from flaxformer_lite.attention import registry
from flaxformer_lite.data import pipeline
from flaxformer_lite.data import validation as data_validation
from flaxformer_lite.train import losses, steps

V, L = 13, 24
# Source and target lengths of five examples (EOS included); packed in this
# order into rows of L by first fit: [0, 1, 2], [3, 4] (3's source would
# overflow row 0, and 4's too).
LENGTHS = [(5, 7), (9, 4), (6, 8), (11, 10), (7, 9)]


def _examples(lengths=LENGTHS, width=12, seed=0):
  rng = np.random.default_rng(seed)
  arrays = {k: np.zeros((len(lengths), width), np.int32) for k in ('inputs', 'targets')}
  for i, pair in enumerate(lengths):
    for k, n in zip(('inputs', 'targets'), pair):
      arrays[k][i, :n - 1] = rng.integers(3, V, size=n - 1)
      arrays[k][i, n - 1] = models.EOS_ID
  return arrays


def _unpack(packed):
  """{(row, segment): {'inputs', 'targets', positions}} read back from segment ids."""
  out = {}
  for r in range(len(packed['inputs'])):
    for k in ('inputs', 'targets'):
      seg = packed[f'{k}_segmentation'][r]
      for s in set(seg[seg > 0].tolist()):
        where = seg == s
        out.setdefault((r, s), {})[k] = packed[k][r][where]
        out[(r, s)][f'{k}_positions'] = packed[f'{k}_positions'][r][where]
  return out


def test_pack_examples_keeps_each_example_whole_in_order():
  arrays = _examples()
  packed = pipeline.pack_examples(arrays, [0, 1, 2, 3, 4], L)
  assert packed['inputs'].shape == (2, L)
  pieces = _unpack(packed)
  assert sorted(pieces) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
  for (r, s), i in zip(sorted(pieces), [0, 1, 2, 3, 4]):
    for k, n in zip(('inputs', 'targets'), LENGTHS[i]):
      np.testing.assert_array_equal(pieces[(r, s)][k], arrays[k][i, :n])
      np.testing.assert_array_equal(pieces[(r, s)][f'{k}_positions'], np.arange(n))
  # Segments are contiguous and in order, padding only at the end of a row.
  for k in ('inputs', 'targets'):
    for row, seg in zip(packed[k], packed[f'{k}_segmentation']):
      used = int(np.sum(seg > 0))
      assert np.all(seg[:used] > 0) and np.all(np.diff(seg[:used]) >= 0)
      np.testing.assert_array_equal(row > 0, seg > 0)


def _first_fit_reference(lengths, order, length, open_rows):
  """First fit written as the plain loop: rows as lists of (source, target) sums."""
  rows, fill = [], []
  for i in order:
    src, tgt = lengths[i]
    for r in range(max(0, len(rows) - open_rows), len(rows)):
      if fill[r][0] + src <= length and fill[r][1] + tgt <= length:
        break
    else:
      r = len(rows)
      rows.append([])
      fill.append([0, 0])
    rows[r].append(i)
    fill[r][0] += src
    fill[r][1] += tgt
  return rows


def test_pack_examples_fills_an_earlier_row_first():
  # Row 0 takes 0 and 1; 2 (source 10) opens row 1; 3 (3, 3) still fits row 0.
  lengths = [(8, 8), (9, 4), (10, 6), (3, 3)]
  packed = pipeline.pack_examples(_examples(lengths), [0, 1, 2, 3], 20)
  np.testing.assert_array_equal(packed['inputs_segmentation'][:, :20].max(axis=1), [3, 1])
  np.testing.assert_array_equal(packed['targets'][0, 12:15], _examples(lengths)['targets'][3, :3])
  # With one open row (next fit) 3 joins row 1 instead.
  packed = pipeline.pack_examples(_examples(lengths), [0, 1, 2, 3], 20, open_rows=1)
  np.testing.assert_array_equal(packed['inputs_segmentation'].max(axis=1), [2, 2])


@pytest.mark.parametrize('open_rows', [1, 3, 64])
def test_pack_examples_matches_the_first_fit_loop(open_rows):
  rng = np.random.default_rng(open_rows)
  lengths = [(int(a), int(b)) for a, b in rng.integers(2, 12, (60, 2))]
  arrays = _examples(lengths)
  order = rng.permutation(60)
  packed = pipeline.pack_examples(arrays, order, L, open_rows=open_rows)
  want = _first_fit_reference(lengths, order, L, open_rows)
  assert len(packed['inputs']) == len(want)
  for r, members in enumerate(want):
    for s, i in enumerate(members, 1):
      for k, n in zip(('inputs', 'targets'), lengths[i]):
        where = packed[f'{k}_segmentation'][r] == s
        np.testing.assert_array_equal(packed[k][r][where], arrays[k][i, :n])
        np.testing.assert_array_equal(packed[f'{k}_positions'][r][where], np.arange(n))


def test_packed_batches_hold_every_example_once_per_epoch_and_resume():
  lengths = [(int(a), int(b)) for a, b in np.random.default_rng(1).integers(2, 12, (40, 2))]
  arrays = _examples(lengths)
  arrays['inputs'][:, 0] = 100 + np.arange(40)  # each example's id, read back below
  it = pipeline.PackedBatches(arrays, length=L, batch_size=3, seed=7)
  seen = []
  while it.epoch == 0:
    state = it.get_state()
    batch = next(it)
    if it.epoch:
      break
    for p in _unpack(batch).values():
      i = int(p['inputs'][0]) - 100
      seen.append(i)
      for k, n in zip(('inputs', 'targets'), lengths[i]):
        np.testing.assert_array_equal(p[k], arrays[k][i, :n])
  assert len(seen) == len(set(seen))
  # Only the ragged tail (fewer than 3 rows) is left for the next epoch.
  unseen = sorted(set(range(40)) - set(seen))
  for s in (0, 1):
    assert sum(lengths[i][s] for i in unseen) <= 2 * L
  again = pipeline.PackedBatches(arrays, length=L, batch_size=3, seed=7)
  again.set_state(state)
  it.set_state(state)
  for a, b in zip((next(it), next(it)), (next(again), next(again))):
    for k in pipeline.PACKED_FEATURES:
      np.testing.assert_array_equal(a[k], b[k])


def test_shift_right_starts_each_segment_with_bos():
  targets = jnp.asarray([[5, 6, 2, 7, 2, 0]])
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0]])
  got = models.shift_right(targets, segmentation=segments)
  np.testing.assert_array_equal(np.asarray(got), [[1, 5, 6, 1, 7, 1]])


# Every Transformer variant a packed run may use (the config refuses the others):
# on the chunked kernel where it has one (its per-block segment masks and
# positions), else dense; and dot_product dense, the dense kernel's segment mask.
CASES = [(name, 'chunked' if registry.get(name).chunked else 'dense')
         for name in registry.names()
         if 'encoder_decoder' in registry.get(name).models and name not in data_validation.PACK_REFUSED]
CASES.append(('dot_product', 'dense'))


@pytest.mark.parametrize('name,implementation', CASES, ids=[f'{n}-{i}' for n, i in CASES])
def test_a_packed_row_gives_each_example_its_own_logits_and_loss(name, implementation,
                                                                small_options):
  positions = 'learned' if name == 'dot_product' and implementation == 'dense' else 'sinusoidal'
  # Blocks of 5 straddle the segments.
  options = small_options(name, kernel=implementation, chunk_size=5)
  cfg = dict(type='encoder_decoder', vocab_size=V, d_model=16, num_heads=2, num_kv_heads=0,
             num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32, dropout_rate=0.0,
             attention_dropout_rate=0.0, attention=name, attention_kwargs=options,
             positions=positions, max_len=L, pre_ln=True, activation='relu', dtype='float32')
  model = models.build(cfg)
  arrays = _examples(width=L)
  packed = pipeline.pack_examples(arrays, [0, 1, 2, 3, 4], L)
  # Each example alone on its row, described as a row of one segment: the same
  # arrays as the packed batch, so one compilation serves both.
  alone = dict(arrays)
  for k in ('inputs', 'targets'):
    alone[f'{k}_segmentation'] = (arrays[k] > 0).astype(np.int32)
    alone[f'{k}_positions'] = np.where(arrays[k] > 0, np.arange(L), 0).astype(np.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), arrays['inputs'][:1],
                          models.shift_right(arrays['targets'][:1]))['params']
  rng = np.random.default_rng(1)  # random parameters: no init to compile
  params = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype), shapes)
  fwd = jax.jit(lambda p, batch: steps.forward(model.apply, p, batch, objective='seq2seq'))
  got, want = fwd(params, packed), fwd(params, alone)
  pieces = sorted(_unpack(packed))
  for (r, s), i in zip(pieces, range(5)):
    where = np.asarray(packed['targets_segmentation'][r] == s)
    np.testing.assert_allclose(np.asarray(got[0][r][where]),
                               np.asarray(want[0][i, :LENGTHS[i][1]]), rtol=2e-5, atol=2e-5,
                               err_msg=f'example {i}')
  # The loss counts each real token once: packed and one-per-row sums agree.
  m_packed, m_alone = (losses.token_metrics(*out, 0.1) for out in (got, want))
  assert float(m_packed['tokens']) == sum(b for _, b in LENGTHS) == float(m_alone['tokens'])
  np.testing.assert_allclose(float(m_packed['loss']), float(m_alone['loss']), rtol=1e-5)


@pytest.mark.parametrize('key,value,expected', [
    ('model.type', 'decoder_only', 'one token stream'),
    ('model.type', 'rnn_seq2seq', 'recurrent encoder'),
    ('model.attention', 'luong_local_p', 'spans the whole row'),
])
def test_pack_with_what_cannot_be_packed_is_a_config_error(key, value, expected):
  c = config_lib.base_config()
  c.data.pack = True
  section, name = key.split('.')
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=expected) as e:
    main.validate(c)
  assert 'data.pack' in str(e.value)


def test_packed_training_runs_through_the_loop_and_scores_every_target(tiny_config, tmp_path):
  from flaxformer_lite.train import loop, metrics
  c = tiny_config
  c.data.pack = True
  c.train.num_steps, c.train.log_every = 20, 10
  results = loop.train_and_evaluate(c, str(tmp_path / 'run'))
  train = [r for r in metrics.read(str(tmp_path / 'run')) if r['split'] == 'train']
  assert train[-1]['loss'] < train[0]['loss']
  # Targets are min_len..max_len symbols + EOS (4.5 on average here); a packed row
  # of max_len + 1 = 7 slots holds more than one example's worth.
  one_per_row = c.train.batch_size * ((c.data.min_len + c.data.max_len) / 2 + 1)
  per_step = sum(r['tokens_per_sec'] / r['steps_per_sec'] for r in train) / len(train)
  assert per_step > 1.2 * one_per_row
  assert np.isfinite(results['test']['loss'])
