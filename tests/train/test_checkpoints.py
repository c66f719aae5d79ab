"""Checkpoints across the two layer layouts (model.scan_layers): a state saved
in one reads back into a model of the other, its layers stacked or unstacked."""
import jax
import numpy as np
import pytest

from flaxformer_lite import models
from flaxformer_lite.layers import scan
from flaxformer_lite.train import checkpoints, state as state_lib


def _state(tiny_config, scanned, seed):
  c = tiny_config
  c.model.vocab_size, c.model.scan_layers = 19, scanned
  batch = {'inputs': np.ones((2, 6), np.int32), 'targets': np.ones((2, 6), np.int32)}
  state = state_lib.create(models.build(c.model), c, batch, jax.random.key(seed))
  # a state that has moved: the moments are not their zero init
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed + 1), p.shape), state.params)
  return state.apply_gradients(grads=grads)


@pytest.mark.parametrize('saved_scanned', [False, True])
def test_a_checkpoint_reads_back_into_the_other_layout(tiny_config, tmp_path, saved_scanned):
  saved = _state(tiny_config, saved_scanned, seed=0)
  target = _state(tiny_config, not saved_scanned, seed=3)  # other weights, other layout
  ckpt = checkpoints.Checkpointer(str(tmp_path), keep=2)
  ckpt.save(1, saved, {'position': 7})
  ckpt.manager.wait_until_finished()
  restored, data = ckpt.restore(target)
  ckpt.close()
  convert = scan.unstack_layers if saved_scanned else scan.stack_layers
  expected = convert({'params': saved.params, 'opt_state': saved.opt_state})
  got = {'params': restored.params, 'opt_state': restored.opt_state}
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  assert int(restored.step) == 1 and data == {'position': 7}
  assert scan.is_stacked(restored.params) == (not saved_scanned)
