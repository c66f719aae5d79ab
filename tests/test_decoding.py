"""Greedy decoding over the cache against re-running the full model each step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import decoding, models

CFG = dict(vocab_size=11, d_model=16, num_heads=2, num_encoder_layers=1,
           num_decoder_layers=2, mlp_dim=32, dropout_rate=0.0, attention_dropout_rate=0.0,
           attention='dot_product', attention_kwargs={}, positions='sinusoidal', max_len=32,
           pre_ln=True, activation='relu', dtype='float32')


def _naive_greedy(step_logits, prefix, steps, eos_id=models.EOS_ID):
  """Re-runs the whole (uncached) model on the growing prefix: the obvious loop.

  The prefix is kept in a fixed-size buffer (one compilation); the model is
  causal, so what lies after position t does not change the logits at t.
  """
  b, p = prefix.shape
  buf = np.zeros((b, p + steps), np.int32)
  buf[:, :p] = prefix
  logits_fn = jax.jit(step_logits)
  done = np.zeros(b, bool)
  for t in range(p, p + steps):
    nxt = np.asarray(jnp.argmax(logits_fn(jnp.asarray(buf))[:, t - 1], -1))
    nxt = np.where(done, models.PAD_ID, nxt)
    buf[:, t] = nxt
    done |= nxt == eos_id
  return buf[:, p:]


@pytest.mark.parametrize('positions', ['sinusoidal', 'learned'])
def test_greedy_translate_equals_naive_loop(positions):
  cfg = {**CFG, 'type': 'encoder_decoder', 'positions': positions}
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  inputs = jnp.array([[4, 5, 6, 2, 0], [7, 2, 0, 0, 0], [3, 3, 9, 8, 2]])
  params = model.init(jax.random.key(1), inputs, jnp.ones((3, 6), jnp.int32))['params']
  got = decoding.greedy_translate(model, decode_model, params, inputs, max_len=8)

  def step_logits(prefix):
    return model.apply({'params': params}, inputs, prefix)
  expected = _naive_greedy(step_logits, jnp.full((3, 1), models.BOS_ID), 8)
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_greedy_generate_with_prompt_equals_naive_loop():
  cfg = {**CFG, 'type': 'decoder_only'}
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  prompt = jnp.array([[1, 4, 5, 6], [1, 9, 3, 3]])
  params = model.init(jax.random.key(2), prompt)['params']
  got = decoding.greedy_generate(decode_model, params, prompt, max_steps=7)
  expected = _naive_greedy(lambda p: model.apply({'params': params}, p), prompt, 7)
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_greedy_generate_stops_at_the_given_end_id():
  # A pretrained vocabulary ends texts with its own id (tokenizers.end_id):
  # generation stops there, not at EOS_ID.
  cfg = {**CFG, 'type': 'decoder_only'}
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  prompt = jnp.array([[1, 4, 5, 6], [1, 9, 3, 3]])
  params = model.init(jax.random.key(0), prompt)['params']
  full = lambda p: model.apply({'params': params}, p)
  free = _naive_greedy(full, prompt, 7, eos_id=-1)
  end = int(free[0, 2])
  assert end != models.EOS_ID and (free[:, -1] != models.PAD_ID).all()
  expected = _naive_greedy(full, prompt, 7, eos_id=end)
  assert (expected == models.PAD_ID).any(axis=1).all()  # both rows end early
  got = decoding.greedy_generate(decode_model, params, prompt, max_steps=7, eos_id=end)
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_tokens_after_eos_are_padding():
  # A one-token vocabulary tail: force EOS by a model whose logits always pick it.
  def tokens_to_logits(tokens, cache):
    logits = jnp.zeros(tokens.shape + (5,)).at[..., models.EOS_ID].set(1.0)
    return logits, cache
  out = decoding.greedy(tokens_to_logits, {}, jnp.ones((2, 1), jnp.int32), 4)
  np.testing.assert_array_equal(np.asarray(out), [[2, 0, 0, 0], [2, 0, 0, 0]])
