"""Beam search against exhaustive enumeration, a plain reference search, greedy decoding,
and full passes."""
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import decoding, models
from flaxformer_lite.layers import scan

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


def _next_logp(table, prompt, seq):
  """log p(next token | prompt, seq) [V] under the Markov table (numpy, no cache)."""
  fed = [PAD] + list(prompt) + list(seq)
  logits = table[len(fed) - 2, fed[-2], fed[-1]]
  return logits - np.logaddexp.reduce(logits)


def _reference_logp(table, prompt, seq):
  """log p(seq | prompt) under the Markov table (numpy, no cache)."""
  return sum(_next_logp(table, prompt, seq[:n])[token] for n, token in enumerate(seq))


def _gnmt_lp(length, alpha):
  """lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha (Wu et al. 2016, eq. 14), written out here
  rather than taken from `decoding`. |Y| counts the generated tokens, EOS included, the
  prompt not, as `decoding.beam_search` documents."""
  return (5.0 + length) ** alpha / (5.0 + 1.0) ** alpha


def _score(table, prompt, seq, alpha):
  """The length-penalised score of seq, a [max_steps] row as beam search returns it."""
  seq = list(seq)
  length = seq.index(EOS) + 1 if EOS in seq else len(seq)
  assert all(t == PAD for t in seq[length:]) and PAD not in seq[:length]
  return _reference_logp(table, prompt, seq[:length]) / _gnmt_lp(length, alpha)


def _brute_force(table, prompt, max_steps, alpha):
  """The best (score, sequence padded to max_steps) of every sequence: content
  tokens then EOS (length <= max_steps), or max_steps content tokens."""
  candidates = [body + (EOS,) for n in range(max_steps)
                for body in itertools.product(CONTENT, repeat=n)]
  candidates += list(itertools.product(CONTENT, repeat=max_steps))
  score = lambda s: _reference_logp(table, prompt, s) / _gnmt_lp(len(s), alpha)
  best = max(candidates, key=score)
  return score(best), list(best) + [PAD] * (max_steps - len(best))


def _reference_beam(table, prompt, max_steps, beam_size, alpha):
  """T5X's beam search as a slow loop over lists, always run to `max_steps`.

  Each step looks at the 2 * beam_size likeliest extensions of the live
  hypotheses: those ending in EOS join the finished pool (its best beam_size by
  score), the best beam_size others are the next live ones. Live hypotheses
  left at the end are scored as they are. Returns the best beam_size
  (score, sequence padded to max_steps), best first.
  """
  live, finished = [(0.0, ())], []
  for i in range(max_steps):
    grown = sorted(((logp + _next_logp(table, prompt, seq)[t], seq + (t,))
                    for logp, seq in live for t in range(V)), reverse=True)[:2 * beam_size]
    finished += [(logp / _gnmt_lp(i + 1, alpha), seq) for logp, seq in grown if seq[-1] == EOS]
    finished = sorted(finished, reverse=True)[:beam_size]
    live = [(logp, seq) for logp, seq in grown if seq[-1] != EOS][:beam_size]
  final = finished + [(logp / _gnmt_lp(max_steps, alpha), seq) for logp, seq in live]
  return [(score, list(seq) + [PAD] * (max_steps - len(seq)))
          for score, seq in sorted(final, reverse=True)[:beam_size]]


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
    np.testing.assert_allclose(scores[row, j], _score(table, PROMPTS[row], seqs[row, j], alpha),
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
  fn = _markov_fn(table)
  greedy = jax.jit(functools.partial(decoding.greedy, fn, max_steps=max_steps))(
      _empty_cache(1), prompt)
  seqs, scores = jax.jit(functools.partial(decoding.beam_search, fn, max_steps=max_steps,
                                           beam_size=2))(_empty_cache(1), prompt)
  assert np.asarray(greedy[0]).tolist() == [3, 3, 3, 3]
  assert np.asarray(seqs[0, 0]).tolist() == [4, EOS, PAD, PAD]
  greedy_score = _reference_logp(table, [BOS], [3, 3, 3, 3]) / _gnmt_lp(4, 0.6)
  assert float(scores[0, 0]) > greedy_score + 1.0
  # By hand: |Y| = 2 counts the EOS, so lp = (5 + 2)^0.6 / 6^0.6.
  np.testing.assert_allclose(float(scores[0, 0]), np.log(0.45 * 0.9) / (7 / 6) ** 0.6,
                             rtol=1e-5)


def test_cache_leaf_without_batch_dimension_is_an_error():
  cache = {'prev': jnp.zeros((3,), jnp.int32), 'step': jnp.array(0)}
  with pytest.raises(ValueError, match=r'\[batch=2, \.\.\.\].*\(3,\)'):
    decoding.beam_search(_markov_fn(_table(0, 8)), cache, jnp.asarray(PROMPTS), 3,
                         beam_size=2)


@functools.partial(jax.jit, static_argnames=('max_steps',))
def _markov_greedy(table, *, max_steps):
  return decoding.greedy(_markov_fn(table), _empty_cache(len(PROMPTS)), jnp.asarray(PROMPTS),
                         max_steps)


def test_beam_size_1_scores_at_least_greedy():
  # Greedy decoding's path stays the live hypothesis until greedy picks EOS, which then
  # joins the finished pool; the beam may end better, never worse.
  max_steps, alpha, better = 5, 0.6, 0
  for seed in range(30):
    table = _table(200 + seed, PROMPTS.shape[1] + max_steps)
    greedy = np.asarray(_markov_greedy(table, max_steps=max_steps))
    _, scores = _markov_search(table, alpha, max_steps=max_steps, beam_size=1)
    for row in range(len(PROMPTS)):
      greedy_score = _score(table, PROMPTS[row], greedy[row], alpha)
      assert float(scores[row, 0]) >= greedy_score - 1e-5, f'seed {200 + seed}'
      better += float(scores[row, 0]) > greedy_score + 1e-5
  assert better  # so beam_size=1 is not greedy decoding


# ---- EOS among the likeliest extensions -----------------------------------------
#
# The first generated token is ranked so that keeping only the beam_size likeliest
# extensions goes wrong: EOS is among them, so fewer hypotheses stay live and the one
# that starts the best sequence is dropped; or EOS ranks just below them and never
# reaches the finished pool.

def _skewed(top, p):
  """{token: probability}: `top` gets p, the other CONTENT tokens and EOS share 1 - p."""
  others = [t for t in CONTENT + (EOS,) if t != top]
  return {top: p, **{t: (1 - p) / len(others) for t in others}}


def _probs_table(max_steps, rows):
  """Uniform over CONTENT and EOS but at rows {(step, previous, current): {token: p}},
  None standing for any token. With the 2-token PROMPTS, generated token t reads step
  t + 1."""
  table = np.zeros((PROMPTS.shape[1] + max_steps, V, V, V))
  table[..., [PAD, BOS]] = -1e9
  every = lambda t: slice(None) if t is None else t
  for (step, prev, current), probs in rows.items():
    row = np.full(V, -1e9)
    row[list(probs)] = np.log(list(probs.values()))
    table[step, every(prev), every(current)] = row
  return table


@pytest.mark.parametrize('alpha', [0.6, 1.0, 2.0])
@pytest.mark.parametrize('beam_size', [1, 2, 3])
@pytest.mark.parametrize('trap', ['eos_in_top_k', 'eos_below_top_k'])
def test_eos_among_the_likeliest_extensions_costs_no_hypothesis(trap, beam_size, alpha):
  max_steps = 5
  if trap == 'eos_in_top_k':
    # EOS is the likeliest first token and content token number beam_size (by rank) starts
    # a near-certain [good, good, good, EOS], which the length penalty prefers to [EOS].
    good = CONTENT[beam_size - 1]
    table = _probs_table(max_steps, {(1, BOS, None): {EOS: .27, 3: .25, 4: .245, 5: .235},
                                     (2, None, good): _skewed(good, .99),
                                     (3, good, good): _skewed(good, .99),
                                     (4, good, good): _skewed(EOS, .99)})
    intended = [good] * 3 + [EOS, PAD]
  else:
    # EOS ranks beam_size + 1 as the first token, below content tokens after which every
    # token is as likely: [EOS] is the best sequence.
    first = {1: {3: .3, EOS: .28, 4: .21, 5: .21}, 2: {3: .27, 4: .26, EOS: .25, 5: .22},
             3: {3: .26, 4: .255, 5: .25, EOS: .235}}[beam_size]
    table = _probs_table(max_steps, {(1, BOS, None): first})
    intended = [EOS] + [PAD] * (max_steps - 1)
  seqs, scores = _markov_search(table, alpha, max_steps=max_steps, beam_size=beam_size)
  for row in range(len(PROMPTS)):
    want_score, want_seq = _brute_force(table, PROMPTS[row], max_steps, alpha)
    assert want_seq == intended  # the trap is set
    np.testing.assert_allclose(float(scores[row, 0]), want_score, rtol=1e-5)
    assert np.asarray(seqs[row, 0]).tolist() == want_seq


@pytest.mark.parametrize('beam_size', [1, 2, 3])
def test_random_models_match_the_reference_search(beam_size):
  """Every returned hypothesis and score equals the plain loop's, on 100 random
  tables; the loop never stops early, so stopping early must change nothing."""
  max_steps = 5
  for seed in range(100):
    table, alpha = _table(seed, PROMPTS.shape[1] + max_steps), [0.0, 0.6, 1.0, 2.0][seed % 4]
    seqs, scores = _markov_search(table, alpha, max_steps=max_steps, beam_size=beam_size)
    for row in range(len(PROMPTS)):
      want = _reference_beam(table, PROMPTS[row], max_steps, beam_size, alpha)
      np.testing.assert_allclose(scores[row], [score for score, _ in want], rtol=1e-5,
                                 err_msg=f'seed {seed}, prompt {row}')
      assert np.asarray(seqs[row]).tolist() == [seq for _, seq in want], f'seed {seed}'


# ---- real models: cache reordering ----------------------------------------------

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
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), *args)['params'])
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


def _no_pad_bos(logits):
  # A generated PAD would be read as padding by the full pass: keep both sides real.
  return logits.at[..., PAD].set(-1e9).at[..., BOS].set(-1e9)


def _search_args(model_type, model, decode_model, params, k):
  """(tokens_to_logits for b * k rows, the empty cache for b, the prompt) of
  PROMPT (an LM) or of INPUTS from BOS (seq2seq)."""
  b = PROMPT.shape[0]
  if model_type == 'decoder_only':
    cache = decoding.init_cache(decode_model, jnp.zeros((b, PROMPT.shape[1] + MAX_LEN), jnp.int32))
    return decoding._lm_fn(decode_model, params), cache, PROMPT
  encoded = model.apply({'params': params}, INPUTS, method='encode')
  cache = decoding.init_cache(decode_model, INPUTS, jnp.zeros((b, MAX_LEN), jnp.int32))
  tiled = [jnp.repeat(x, k, axis=0) for x in (encoded, INPUTS)]
  return decoding._translation_fn(decode_model, params, *tiled), cache, PROMPT[:, :1]


@pytest.mark.parametrize('model_type', SEQ2SEQ + ['decoder_only'])
def test_beam_scores_equal_full_pass_scores(model_type):
  """Each returned hypothesis, re-scored by the uncached model: wrong cache
  rows after reordering would change the numbers."""
  model, decode_model, params = _setup(model_type)
  b, k, alpha = PROMPT.shape[0], 3, 0.6
  fn, cache, prompt = _search_args(model_type, model, decode_model, params, k)

  def masked_fn(tokens, cache):
    logits, cache = fn(tokens, cache)
    return _no_pad_bos(logits), cache

  seqs, scores = jax.jit(functools.partial(decoding.beam_search, masked_fn, max_steps=MAX_LEN,
                                           beam_size=k, alpha=alpha))(cache, prompt)
  scores = np.asarray(scores).reshape(-1)
  assert np.isfinite(scores).all()  # an early stop leaves a full finished pool
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
  want = (token_logp * keep).sum(1) / _gnmt_lp(lengths, alpha)
  np.testing.assert_allclose(scores, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize('model_type', ['encoder_decoder', 'decoder_only'])
def test_a_scanned_stack_finds_the_unrolled_beams_and_scores(model_type):
  """model.scan_layers: the cache's leaves are [L, b, ...] under `layers`
  (cache_index [L]), tiled and reordered on axis 1. The unrolled model is the
  reference: with its weights stacked, the same beams and scores."""
  cfg = {**CFG, 'type': model_type, 'num_encoder_layers': 2, 'num_decoder_layers': 2}
  k = 3
  params = _random_params(models.build(cfg), *((PROMPT,) if model_type == 'decoder_only'
                                               else (INPUTS, PROMPT)))

  def search(scan_layers, params):
    c = {**cfg, 'scan_layers': scan_layers}
    fn, cache, prompt = _search_args(model_type, models.build(c),
                                     models.build(c, decode=True), params, k)
    assert scan.is_stacked(cache) == scan_layers
    return decoding.beam_search(fn, cache, prompt, MAX_LEN, beam_size=k)

  (want_seqs, want_scores), (seqs, scores) = jax.jit(
      lambda p, q: (search(False, p), search(True, q)))(params, scan.stack_layers(params))
  np.testing.assert_array_equal(seqs, want_seqs)
  np.testing.assert_array_equal(scores, want_scores)


def test_a_scanned_cache_leaf_without_batch_on_axis_1_is_an_error():
  cache = {'prev': jnp.zeros((2,), jnp.int32),
           'layers': {'step': jnp.zeros((2,), jnp.int32), 'key': jnp.zeros((2, 3, 4))}}
  with pytest.raises(ValueError, match=r"\[layers, batch=2, \.\.\.\].*\(2, 3, 4\).*'key'"):
    decoding.beam_search(_markov_fn(_table(0, 8)), cache, jnp.asarray(PROMPTS), 3,
                         beam_size=2)
