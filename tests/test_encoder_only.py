"""EncoderOnly (BERT-style masked LM): bidirectionality, padding, the MLM head."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite import models
from flaxformer_lite.attention import registry
from flaxformer_lite.data import masking

BASE = dict(type='encoder_only', vocab_size=13, d_model=16, num_heads=2,
            num_encoder_layers=2, num_decoder_layers=0, mlp_dim=32, dropout_rate=0.0,
            attention_dropout_rate=0.0, attention='dot_product', attention_kwargs={},
            positions='sinusoidal', max_len=32, pre_ln=True, activation='gelu',
            dtype='float32')
# Example 0 padded after 4 tokens.
IDS = jnp.asarray([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12]], jnp.int32)
REAL = np.asarray(IDS) > models.PAD_ID  # [2, 6]
ENCODER_VARIANTS = [n for n in registry.names() if 'encoder_only' in registry.get(n).models]

# As in test_models.py: everything runs op by op (no jit) with parameters drawn
# with numpy from the shapes `init` would create, so that the per-op
# compilations are shared by all configurations.


@functools.lru_cache(maxsize=None)
def _setup(attention='dot_product', pre_ln=True):
  """(model, random params: non-zero biases, LayerNorm scales away from 1)."""
  model = models.build(dict(BASE, attention=attention, pre_ln=pre_ln))
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), IDS)['params']
  rng = np.random.default_rng(ENCODER_VARIANTS.index(attention) + 100 * pre_ln)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    x = rng.normal(size=leaf.shape)
    if name.endswith("['scale']"):
      x = 1.0 + 0.2 * x
    elif name.endswith("['bias']"):
      x = 0.1 * x
    elif name.endswith("['kernel']"):
      x = x / np.sqrt(leaf.shape[0])
    elif name.endswith("['embedding']"):
      x = x / np.sqrt(leaf.shape[-1])
    else:
      x = 0.1 * x
    return jnp.asarray(x, leaf.dtype)

  return model, jax.tree_util.tree_map_with_path(draw, shapes)


def _logits(attention, ids, pre_ln=True, params=None):
  model, default = _setup(attention, pre_ln)
  return np.asarray(model.apply({'params': params or default}, ids))


def test_build_and_shape():
  model, params = _setup()
  assert isinstance(model, models.EncoderOnly)
  assert set(params) == {'embed', 'encoder', 'mlm_dense', 'mlm_norm', 'mlm_bias'}
  assert params['mlm_bias'].shape == (BASE['vocab_size'],)
  logits = _logits('dot_product', IDS)
  assert logits.shape == (2, 6, BASE['vocab_size']) and logits.dtype == np.float32
  assert np.isfinite(logits).all()


@pytest.mark.parametrize('pre_ln', [True, False], ids=['preln', 'postln'])
def test_bidirectional_later_token_changes_earlier_logits(pre_ln):
  want = _logits('dot_product', IDS, pre_ln)
  later = IDS.at[:, 3].set(9)  # example 0: 6 -> 9; example 1: 10 -> 9
  got = _logits('dot_product', later, pre_ln)
  for pos in range(3):  # every earlier position sees it (a causal LM would not)
    assert not np.allclose(got[:, pos], want[:, pos], atol=1e-4), pos
  earlier = IDS.at[:, 0].set(9)
  got = _logits('dot_product', earlier, pre_ln)
  assert not np.allclose(got[:, 3], want[:, 3], atol=1e-4)


@pytest.mark.parametrize('attention', ['dot_product', 't5_bias'])
def test_appended_padding_does_not_change_logits(attention):
  want = _logits(attention, IDS)
  got = _logits(attention, jnp.pad(IDS, ((0, 0), (0, 3))))
  assert got.shape == (2, 9, BASE['vocab_size'])
  np.testing.assert_allclose(got[:, :6][REAL], want[REAL], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('attention', ENCODER_VARIANTS)
def test_every_encoder_variant_is_bidirectional_and_ignores_pad(attention):
  """Every variant the registry allows here (one input shape, to keep the
  op-by-op compilations few): an earlier position sees a later token, and
  real positions never see what PAD embeds to (only the tied softmax
  column of the PAD id itself may change)."""
  _, params = _setup(attention)
  want = _logits(attention, IDS)
  assert want.shape == (2, 6, BASE['vocab_size']) and np.isfinite(want).all()
  got = _logits(attention, IDS.at[:, 3].set(9))
  assert not np.allclose(got[:, :3], want[:, :3], atol=1e-4)
  table = params['embed']['embedding']
  other = {**params, 'embed': {'embedding': table.at[0].set(5.0 * table[1])}}
  got = _logits(attention, IDS, params=other)
  np.testing.assert_allclose(got[REAL][:, 1:], want[REAL][:, 1:], atol=1e-5, rtol=1e-5)


def test_mlm_head_by_hand():
  """logits = LN(gelu(h W + b)) E^T + bias from the final hidden state h."""
  model, params = _setup()
  h = np.asarray(model.apply({'params': params}, IDS, method=models.EncoderOnly.encode))
  assert h.shape == (2, 6, BASE['d_model'])
  dense, norm = params['mlm_dense'], params['mlm_norm']
  x = h @ np.asarray(dense['kernel']) + np.asarray(dense['bias'])
  x = np.asarray(jax.nn.gelu(x))  # BASE['activation']
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  x = (x - mean) / np.sqrt(var + 1e-6) * np.asarray(norm['scale']) + np.asarray(norm['bias'])
  want = x @ np.asarray(params['embed']['embedding']).T + np.asarray(params['mlm_bias'])
  np.testing.assert_allclose(_logits('dot_product', IDS), want, atol=1e-4, rtol=1e-4)


def test_training_on_a_masked_task_reduces_the_loss():
  """Toy task: each sequence repeats one token, so a selected token is given
  by any visible neighbour. Adam on the BERT loss (selected positions only),
  fresh masks every step."""
  dataset_vocab = 10
  vocab, mask_id = masking.mlm_vocab_size(dataset_vocab)
  model = models.build(dict(BASE, vocab_size=vocab, num_encoder_layers=1))
  rng = jax.random.PRNGKey(0)
  tokens = jax.random.randint(rng, (32, 1), masking.FIRST_TOKEN_ID, dataset_vocab)
  ids = jnp.broadcast_to(tokens, (32, 12)).at[:16, 9:].set(models.PAD_ID)  # half padded
  params = jax.jit(model.init)(rng, ids)['params']
  tx = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state, key):
    def loss_fn(params):
      inputs, targets, weights = masking.mask_tokens(
          key, ids, vocab_size=dataset_vocab, mask_id=mask_id, rate=0.3)
      logits = model.apply({'params': params}, inputs)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
      return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = tx.init(params), []
  for i in range(40):
    params, opt_state, loss = step(params, opt_state, jax.random.fold_in(rng, i))
    losses.append(float(loss))
  # Chance is log(7 tokens) ~ 1.9.
  assert losses[0] > 1.5 and np.mean(losses[-5:]) < 0.25 * losses[0], losses


def test_mlm_step_draws_replacements_from_the_data_ids_when_the_model_vocab_is_larger():
  """model.vocab_size may exceed what the data uses (64 rows for a 10-id
  dataset): random replacements must still be data tokens (3..9), and the
  mask the model's last id."""
  from flaxformer_lite.train import steps
  seen = {}

  def apply_fn(variables, inputs, **kwargs):
    seen['inputs'] = inputs
    return jnp.zeros(inputs.shape + (64,))

  ids = jnp.full((64, 32), 5, jnp.int32)
  logits, targets, weights = steps.forward(
      apply_fn, {}, {'inputs': ids}, objective='mlm', rng=jax.random.key(0), mlm_rate=1.0,
      vocab_size=64, data_vocab_size=10)
  inputs = np.asarray(seen['inputs'])
  replaced = inputs[(inputs != 5) & (inputs != 63)]
  assert replaced.size > 50  # ~10% of 2048 selected positions
  assert replaced.min() >= masking.FIRST_TOKEN_ID and replaced.max() < 10, np.unique(replaced)
  assert (inputs == 63).mean() == pytest.approx(0.8, abs=0.05)


def test_mlm_masks_with_the_tokenizers_own_mask_id():
  """A pretrained BERT's tokenizer has [MASK] inside its vocabulary (103 in
  BERT's): the step masks with it, and no extra id is reserved."""
  from flaxformer_lite.data import tokenizers
  from flaxformer_lite.train import steps
  vocab = {t: i for i, t in enumerate(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'a', 'b',
                                       'c', 'd', 'e'])}
  tokenizer = tokenizers.WordPieceTokenizer(vocab)
  assert tokenizer.mask_id == 4 and tokenizer.vocab_size == 10
  seen = {}

  def apply_fn(variables, inputs, **kwargs):
    seen['inputs'] = inputs
    return jnp.zeros(inputs.shape + (10,))

  steps.forward(apply_fn, {}, {'inputs': jnp.full((64, 32), 7, jnp.int32)}, objective='mlm',
                rng=jax.random.key(0), mlm_rate=1.0, vocab_size=10, data_vocab_size=10,
                mask_id=tokenizer.mask_id)
  inputs = np.asarray(seen['inputs'])
  assert (inputs == 4).mean() == pytest.approx(0.8, abs=0.05)
  assert (inputs == 9).mean() < 0.05  # the last id is an ordinary token here
