"""Beam search against exhaustive enumeration, greedy decoding, and full passes."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import decoding, models

PAD, BOS, EOS = models.PAD_ID, models.BOS_ID, models.EOS_ID

# ---- a hand-written second-order Markov "model" ---------------------------------
#
# logits(next) = TABLE[step, previous token, current token]; the cache holds the
# previous token per row ([b], reordered by the search) and the step (a scalar,
# shared by all rows). PAD and BOS are never generated.

V = 6
CONTENT = (3, 4, 5)


def _table(seed, steps):
  table = np.random.default_rng(seed).normal(size=(steps, V, V, V)) * 1.5
  table[..., [PAD, BOS]] = -1e9
  return table


def _markov_fn(table):
  table = jnp.asarray(table, jnp.float32)

  def tokens_to_logits(tokens, cache):
    prev, step, out = cache['prev'], cache['step'], []
    for j in range(tokens.shape[1]):
      out.append(table[step, prev, tokens[:, j]])
      prev, step = tokens[:, j], step + 1
    return jnp.stack(out, 1), {'prev': prev, 'step': step}
  return tokens_to_logits


def _empty_cache(b):
  return {'prev': jnp.full((b,), PAD, jnp.int32), 'step': jnp.array(0, jnp.int32)}


def _reference_logp(table, prompt, seq):
  """log p(seq | prompt) under the Markov table (numpy, no cache)."""
  fed, total = [PAD] + list(prompt), 0.0
  for token in seq:
    logits = table[len(fed) - 2, fed[-2], fed[-1]]
    total += logits[token] - np.logaddexp.reduce(logits)
    fed.append(token)
  return total


def _brute_force(table, prompt, max_steps, alpha):
  """The best (score, sequence padded to max_steps) of every sequence: content
  tokens then EOS (length <= max_steps), or max_steps content tokens."""
  candidates = [body + (EOS,) for n in range(max_steps)
                for body in itertools.product(CONTENT, repeat=n)]
  candidates += list(itertools.product(CONTENT, repeat=max_steps))
  score = lambda s: _reference_logp(table, prompt, s) / decoding.length_penalty(len(s), alpha)
  best = max(candidates, key=score)
  return score(best), list(best) + [PAD] * (max_steps - len(best))


PROMPTS = np.array([[BOS, 3], [BOS, 5]], np.int32)


@functools.partial(jax.jit, static_argnames=('max_steps', 'beam_size'))
def _markov_search(table, alpha, *, max_steps, beam_size):
  """One compilation per (max_steps, beam_size): table and alpha are traced."""
  prompts = jnp.asarray(PROMPTS)
  return decoding.beam_search(_markov_fn(table), _empty_cache(len(PROMPTS)), prompts,
                              max_steps, beam_size=beam_size, alpha=alpha)


@pytest.mark.parametrize('seed', range(4))
@pytest.mark.parametrize('alpha', [0.0, 0.6, 2.0])
def test_wide_beam_finds_the_brute_force_best(seed, alpha):
  max_steps = 4
  table = _table(seed, PROMPTS.shape[1] + max_steps)
  # Wide enough never to drop a hypothesis: 4 * 3**3 finite candidates at the last step.
  seqs, scores = _markov_search(table, alpha, max_steps=max_steps, beam_size=108)
  for row in range(2):
    want_score, want_seq = _brute_force(table, PROMPTS[row], max_steps, alpha)
    np.testing.assert_allclose(float(scores[row, 0]), want_score, rtol=1e-5)
    assert np.asarray(seqs[row, 0]).tolist() == want_seq


@pytest.mark.parametrize('beam_size', [1, 2, 3, 5])
def test_every_returned_hypothesis_carries_its_own_score(beam_size):
  # Catches mixed-up bookkeeping (a cache row, a length, a score that follows
  # the wrong hypothesis) that the best hypothesis alone can hide.
  max_steps, alpha = 5, 0.6
  table = _table(7, PROMPTS.shape[1] + max_steps)
  seqs, scores = _markov_search(table, alpha, max_steps=max_steps, beam_size=beam_size)
  seqs, scores = np.asarray(seqs), np.asarray(scores)
  assert np.all(scores[:, :-1] >= scores[:, 1:])  # best first
  for row, j in itertools.product(range(2), range(beam_size)):
    if not np.isfinite(scores[row, j]):
      continue
    seq = seqs[row, j].tolist()
    length = seq.index(EOS) + 1 if EOS in seq else max_steps
    assert all(t == PAD for t in seq[length:]) and PAD not in seq[:length]
    want = _reference_logp(table, PROMPTS[row], seq[:length])
    np.testing.assert_allclose(scores[row, j], want / decoding.length_penalty(length, alpha),
                               rtol=1e-5)


def test_beam_finds_what_greedy_misses():
  # From BOS, 3 is likelier than 4 (0.5 > 0.45), but after 3 nothing is likely
  # and EOS is rare, while 4 is followed by EOS with probability 0.9.
  probs = np.full((V, V), 1e-9)
  probs[BOS, [3, 4, EOS]] = [0.5, 0.45, 0.05]
  probs[3, [3, 4, 5, EOS]] = [0.3, 0.25, 0.25, 0.2]
  probs[4, [3, 4, 5, EOS]] = [0.04, 0.03, 0.03, 0.9]
  probs[5, [3, 4, 5, EOS]] = 0.25
  table = np.broadcast_to(np.log(probs), (8, V, V, V))  # [step, prev, current, next]
  prompt, max_steps = jnp.array([[BOS]], jnp.int32), 4
  greedy = decoding.greedy(_markov_fn(table), _empty_cache(1), prompt, max_steps)
  seqs, scores = decoding.beam_search(_markov_fn(table), _empty_cache(1), prompt, max_steps,
                                      beam_size=2)
  assert np.asarray(greedy[0]).tolist() == [3, 3, 3, 3]
  assert np.asarray(seqs[0, 0]).tolist() == [4, EOS, PAD, PAD]
  greedy_score = _reference_logp(table, [BOS], [3, 3, 3, 3]) / decoding.length_penalty(4, 0.6)
  assert float(scores[0, 0]) > greedy_score + 1.0


def test_cache_leaf_without_batch_dimension_is_an_error():
  cache = {'prev': jnp.zeros((3,), jnp.int32), 'step': jnp.array(0)}
  with pytest.raises(ValueError, match=r'\[batch=2, \.\.\.\].*\(3,\)'):
    decoding.beam_search(_markov_fn(_table(0, 8)), cache, jnp.asarray(PROMPTS), 3,
                         beam_size=2)


# ---- real models: greedy equivalence and cache reordering -------------------------

CFG = dict(vocab_size=11, d_model=16, num_heads=2, num_encoder_layers=1,
           num_decoder_layers=1, mlp_dim=32, dropout_rate=0.0, attention_dropout_rate=0.0,
           attention='dot_product', attention_kwargs={}, positions='sinusoidal', max_len=32,
           pre_ln=True, activation='relu', dtype='float32', rnn_cell='lstm',
           rnn_input_feeding=True)
INPUTS = jnp.array([[4, 5, 6, 2, 0], [7, 2, 0, 0, 0], [3, 3, 9, 8, 2]])
PROMPT = jnp.array([[1, 4, 5], [1, 9, 3], [1, 7, 7]])
MAX_LEN = 7


def _random_params(model, *args):
  """Random values for every parameter (the initial ones give near-uniform logits)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), *args)['params']
  leaves, tree = jax.tree_util.tree_flatten(shapes)
  rng = np.random.default_rng(3)
  return jax.tree_util.tree_unflatten(
      tree, [jnp.asarray(rng.normal(size=x.shape).astype(np.float32) * 0.7) for x in leaves])


def _setup(model_type):
  cfg = {**CFG, 'type': model_type}
  model, decode_model = models.build(cfg), models.build(cfg, decode=True)
  args = (PROMPT,) if model_type == 'decoder_only' else (INPUTS, PROMPT)
  return model, decode_model, _random_params(model, *args)


SEQ2SEQ = ['encoder_decoder', 'rnn_seq2seq']


@pytest.mark.parametrize('model_type', SEQ2SEQ)
def test_beam_size_1_is_greedy_translation(model_type):
  model, decode_model, params = _setup(model_type)
  greedy = jax.jit(functools.partial(decoding.greedy_translate, model, decode_model,
                                     max_len=MAX_LEN))(params, INPUTS)
  beam = jax.jit(functools.partial(decoding.beam_translate, model, decode_model,
                                   max_len=MAX_LEN, beam_size=1))(params, INPUTS)
  np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))


def test_beam_size_1_is_greedy_generation():
  _, decode_model, params = _setup('decoder_only')
  greedy = jax.jit(functools.partial(decoding.greedy_generate, decode_model,
                                     max_steps=MAX_LEN))(params, PROMPT)
  beam = jax.jit(functools.partial(decoding.beam_generate, decode_model, max_steps=MAX_LEN,
                                   beam_size=1))(params, PROMPT)
  np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))


def _no_pad_bos(logits):
  # A generated PAD would be read as padding by the full pass: keep both sides real.
  return logits.at[..., PAD].set(-1e9).at[..., BOS].set(-1e9)


@pytest.mark.parametrize('model_type', SEQ2SEQ + ['decoder_only'])
def test_beam_scores_equal_full_pass_scores(model_type):
  """Each returned hypothesis, re-scored by the uncached model: wrong cache
  rows after reordering would change the numbers."""
  model, decode_model, params = _setup(model_type)
  b, k, alpha = PROMPT.shape[0], 3, 0.6
  if model_type == 'decoder_only':
    cache = decoding.init_cache(decode_model, jnp.zeros((b, PROMPT.shape[1] + MAX_LEN), jnp.int32))
    fn, prompt = decoding._lm_fn(decode_model, params), PROMPT
  else:
    encoded = model.apply({'params': params}, INPUTS, method='encode')
    cache = decoding.init_cache(decode_model, INPUTS, jnp.zeros((b, MAX_LEN), jnp.int32))
    tiled = [jnp.repeat(x, k, axis=0) for x in (encoded, INPUTS)]
    fn, prompt = decoding._translation_fn(decode_model, params, *tiled), PROMPT[:, :1]

  def masked_fn(tokens, cache):
    logits, cache = fn(tokens, cache)
    return _no_pad_bos(logits), cache

  seqs, scores = jax.jit(functools.partial(decoding.beam_search, masked_fn, max_steps=MAX_LEN,
                                           beam_size=k, alpha=alpha))(cache, prompt)
  scores = np.asarray(scores).reshape(-1)
  found = np.isfinite(scores)  # early stopping may leave slots empty
  assert found.reshape(b, k)[:, 0].all()
  seqs = np.asarray(seqs).reshape(b * k, MAX_LEN)
  full = np.concatenate([np.repeat(np.asarray(prompt), k, 0), seqs], 1)  # [b*k, P+T]
  apply = jax.jit(model.apply)
  if model_type == 'decoder_only':
    logits = apply({'params': params}, jnp.asarray(full[:, :-1]))[:, prompt.shape[1] - 1:]
  else:
    logits = apply({'params': params}, jnp.repeat(INPUTS, k, 0), jnp.asarray(full[:, :-1]))
  logp = np.asarray(jax.nn.log_softmax(_no_pad_bos(logits)))
  token_logp = np.take_along_axis(logp, seqs[..., None], -1)[..., 0]  # [b*k, T]
  lengths = np.array([list(s).index(EOS) + 1 if EOS in s else MAX_LEN for s in seqs])
  keep = np.arange(MAX_LEN)[None] < lengths[:, None]
  want = (token_logp * keep).sum(1) / decoding.length_penalty(lengths, alpha)
  np.testing.assert_allclose(scores[found], want[found], rtol=2e-4, atol=2e-4)
