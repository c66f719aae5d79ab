"""Greedy and beam search over a cached decoder.

Decoding is written against one interface, as in T5X:
  tokens_to_logits(tokens [b, L], cache) -> (logits [b, L, V], new_cache)
so the same loops serve the encoder-decoder, the decoder-only LM and the RNN
seq2seq model (and any attention variant: the cache lives in the layers).
Beam search needs nothing more of the cache than that every leaf is either
[b, ...] (per sequence) or a scalar shared by all sequences (a step index);
under a scanned stack's `layers` (model.scan_layers) each leaf carries the
layer axis first: [L, b, ...], or [L] for the step index.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.layers.scan import SCANNED
from flaxformer_lite.tokens import BOS_ID, EOS_ID, PAD_ID


def init_cache(decode_model, *example_args):
  """Zero cache for `decode_model` (built with decode=True).

  example_args: full-length inputs of the shapes to decode, e.g.
  (inputs [b, m], decoder_inputs [b, max_len]) for an encoder-decoder or
  (ids [b, max_len]) for an LM. Costs no compute (shapes only).
  """
  shapes = jax.eval_shape(
      functools.partial(decode_model.init, jax.random.key(0)), *example_args)['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def greedy(tokens_to_logits, cache, prompt, max_steps: int, *, eos_id=EOS_ID):
  """Greedy continuation of `prompt` for up to `max_steps` tokens.

  Args:
    tokens_to_logits: see the module docstring.
    cache: the cache, empty.
    prompt: [b, P] tokens fed first in one call (P >= 1; BOS for translation).
    max_steps: number of tokens to generate.
  Returns:
    [b, max_steps] generated tokens; after a sequence's EOS, PAD.
  """
  b = prompt.shape[0]
  logits, cache = tokens_to_logits(prompt, cache)
  first = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)
  out = jnp.full((b, max_steps), PAD_ID, prompt.dtype).at[:, 0].set(first)

  def cond(state):
    i, _, _, _, done = state
    return jnp.logical_and(i < max_steps, ~jnp.all(done))

  def body(state):
    i, cache, token, out, done = state
    logits, cache = tokens_to_logits(token[:, None], cache)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(out.dtype)
    token = jnp.where(done, PAD_ID, token)
    out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
    return i + 1, cache, token, out, done | (token == eos_id)

  state = (jnp.array(1), cache, first, out, first == eos_id)
  return jax.lax.while_loop(cond, body, state)[3]


def _batch_axis(path) -> int:
  """The batch axis of the cache leaf at `path`: 0, moved right by one for
  every scanned stack (a `layers` key, leaves [L, ...]) it sits under."""
  return sum(getattr(key, 'key', None) == SCANNED for key in path)


def length_penalty(length, alpha: float):
  """GNMT's ((5 + length) / 6) ** alpha (Wu et al. 2016, eq. 14).

  length: the generated tokens, EOS included, the prompt not.
  """
  return ((5.0 + length) / 6.0) ** alpha


def beam_search(tokens_to_logits, cache, prompt, max_steps: int, *, beam_size: int,
                alpha: float = 0.6, eos_id=EOS_ID):
  """Beam search with GNMT's length penalty.

  Each step extends every live hypothesis by every token and looks at the
  2 * `beam_size` most probable extensions, as T5X and tensor2tensor do: at
  most `beam_size` of them end in EOS (one per live hypothesis), so the
  `beam_size` most probable of the others always fill the beam again, and the
  ones that end in EOS join the finished pool (its best `beam_size`, each
  keeping its score log p / length_penalty(length, alpha), length counting
  EOS). The search stops when the finished pool is full and no live
  hypothesis can still beat its worst (log p only falls as a hypothesis
  grows), which leaves the result as if it had run on, or after `max_steps`
  tokens, when the hypotheses still live are scored as they are.
  beam_size=1 is not greedy decoding: where greedy decoding would pick EOS,
  that hypothesis is finished and the beam goes on with the likeliest other
  token, so the result scores at least as high as greedy decoding's.

  Args:
    tokens_to_logits: see the module docstring; always called with
      b * beam_size rows, hypothesis j of example i in row i * beam_size + j.
    cache: the empty cache for b rows. Leaves [b, ...] are tiled to
      [b * beam_size, ...] and reordered after each step to follow their
      hypotheses; scalar leaves (positions shared by all rows) are kept.
      Under a scanned stack (`layers`), the same on axis 1 of [L, b, ...],
      and [L] leaves are kept.
    prompt: [b, P] tokens fed first in one call (P >= 1); not scored.
    max_steps: the most tokens to generate.
  Returns:
    (sequences [b, beam_size, max_steps] with PAD after EOS, scores
    [b, beam_size]), best first; -inf scores mark empty slots.
  """
  if beam_size < 1 or max_steps < 1:
    raise ValueError(f'beam_size={beam_size} and max_steps={max_steps} must be >= 1')
  b, k = prompt.shape[0], beam_size

  def tile(path, x):
    axis = _batch_axis(path)
    if x.ndim == axis:  # a position shared by all rows (one per layer under `layers`)
      return x
    if x.ndim < axis or x.shape[axis] != b:
      layout = '[' + 'layers, ' * axis + f'batch={b}, ...]'
      raise ValueError(f'beam search needs cache leaves of shape {layout} or scalars; '
                       f'got a leaf of shape {x.shape} at {jax.tree_util.keystr(path)}')
    return jnp.repeat(x, k, axis=axis)

  def reorder(cache, origin):  # origin [b, k]: the hypothesis each row continues
    rows = (jnp.arange(b)[:, None] * k + origin).reshape(-1)

    def take(path, x):
      axis = _batch_axis(path)
      return jnp.take(x, rows, axis=axis) if x.ndim > axis else x
    return jax.tree_util.tree_map_with_path(take, cache)

  penalty_bound = lambda i: jnp.maximum(length_penalty(i + 1, alpha),
                                        length_penalty(max_steps, alpha))

  def extend(i, logits, state):
    """Generates token i (0-based) from logits [b * k, V] of the last fed tokens."""
    seqs, live, fin_seqs, fin_scores = state
    vocab = logits.shape[-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(b, k, vocab)
    candidates = (live[:, :, None] + logp).reshape(b, k * vocab)
    grown, index = jax.lax.top_k(candidates, min(2 * k, k * vocab))  # [b, 2k]
    origin, token = index // vocab, (index % vocab).astype(seqs.dtype)
    grown_seqs = jnp.take_along_axis(seqs, origin[:, :, None], axis=1).at[:, :, i].set(token)
    ended = token == eos_id
    scores = jnp.where(ended, grown / length_penalty(i + 1, alpha), -jnp.inf)
    fin_scores, best = jax.lax.top_k(jnp.concatenate([fin_scores, scores], 1), k)
    fin_seqs = jnp.take_along_axis(jnp.concatenate([fin_seqs, grown_seqs], 1),
                                   best[:, :, None], axis=1)
    live, kept = jax.lax.top_k(jnp.where(ended, -jnp.inf, grown), k)  # [b, k]
    seqs = jnp.take_along_axis(grown_seqs, kept[:, :, None], axis=1)
    origin, token = (jnp.take_along_axis(x, kept, axis=1) for x in (origin, token))
    return origin, token, (seqs, live, fin_seqs, fin_scores)

  cache = jax.tree_util.tree_map_with_path(tile, cache)
  logits, cache = tokens_to_logits(jnp.repeat(prompt, k, axis=0), cache)
  empty = jnp.full((b, k, max_steps), PAD_ID, prompt.dtype)
  # The k copies of the prompt are one hypothesis: only the first is extended.
  live = jnp.full((b, k), -jnp.inf).at[:, 0].set(0.0)
  origin, token, state = extend(0, logits[:, -1], (empty, live, empty,
                                                   jnp.full((b, k), -jnp.inf)))
  cache = reorder(cache, origin)

  def cond(loop):
    i, _, _, (_, live, _, fin_scores) = loop
    # With log p <= 0, a live hypothesis scores at most log p / the largest
    # penalty of any length it can still reach; fin_scores[:, -1] is -inf
    # until the pool holds k.
    can_improve = jnp.max(live, axis=1) / penalty_bound(i) > fin_scores[:, -1]
    return jnp.logical_and(i < max_steps, jnp.any(can_improve))

  def body(loop):
    i, cache, token, state = loop
    logits, cache = tokens_to_logits(token.reshape(b * k, 1), cache)
    origin, token, state = extend(i, logits[:, -1], state)
    return i + 1, reorder(cache, origin), token, state

  i, _, _, (seqs, live, fin_seqs, fin_scores) = jax.lax.while_loop(
      cond, body, (jnp.array(1), cache, token, state))
  live_scores = jnp.where(i == max_steps, live / length_penalty(max_steps, alpha), -jnp.inf)
  scores, best = jax.lax.top_k(jnp.concatenate([fin_scores, live_scores], 1), k)
  seqs = jnp.take_along_axis(jnp.concatenate([fin_seqs, seqs], 1), best[:, :, None], axis=1)
  return seqs, scores


def _translation_fn(decode_model, params, encoded, inputs):
  """tokens_to_logits of an encoder-decoder for `encoded` = encode(inputs)."""
  def tokens_to_logits(tokens, cache):
    logits, variables = decode_model.apply(
        {'params': params, 'cache': cache}, encoded, inputs, tokens,
        method='decode', mutable=['cache'])
    return logits, variables['cache']
  return tokens_to_logits


def _lm_fn(decode_model, params):
  def tokens_to_logits(tokens, cache):
    logits, variables = decode_model.apply(
        {'params': params, 'cache': cache}, tokens, mutable=['cache'])
    return logits, variables['cache']
  return tokens_to_logits


def greedy_translate(model, decode_model, params, inputs, max_len: int):
  """Encoder-decoder greedy decoding.

  model / decode_model: `models.build(cfg)` and `models.build(cfg, decode=True)`.
  inputs [b, m] -> [b, max_len] tokens (EOS included, PAD after it).
  """
  encoded = model.apply({'params': params}, inputs, method='encode')
  cache = init_cache(decode_model, inputs, jnp.zeros((inputs.shape[0], max_len), inputs.dtype))
  bos = jnp.full((inputs.shape[0], 1), BOS_ID, inputs.dtype)
  return greedy(_translation_fn(decode_model, params, encoded, inputs), cache, bos, max_len)


def beam_translate(model, decode_model, params, inputs, max_len: int, *, beam_size: int,
                   alpha: float = 0.6):
  """Encoder-decoder beam search (see `beam_search`); encodes once.

  inputs [b, m] -> the best hypothesis [b, max_len] (EOS included, PAD after it).
  """
  encoded = model.apply({'params': params}, inputs, method='encode')
  cache = init_cache(decode_model, inputs, jnp.zeros((inputs.shape[0], max_len), inputs.dtype))
  tiled = jax.tree.map(lambda x: jnp.repeat(x, beam_size, axis=0), (encoded, inputs))
  bos = jnp.full((inputs.shape[0], 1), BOS_ID, inputs.dtype)
  seqs, _ = beam_search(_translation_fn(decode_model, params, *tiled), cache, bos, max_len,
                        beam_size=beam_size, alpha=alpha)
  return seqs[:, 0]


def greedy_generate(decode_model, params, prompt, max_steps: int, *, eos_id=EOS_ID):
  """Decoder-only LM: prompt [b, P] -> [b, max_steps] continuation, PAD after
  `eos_id` (a pretrained vocabulary's own: `tokenizers.end_id`)."""
  total = prompt.shape[1] + max_steps
  cache = init_cache(decode_model, jnp.zeros((prompt.shape[0], total), prompt.dtype))
  return greedy(_lm_fn(decode_model, params), cache, prompt, max_steps, eos_id=eos_id)


def beam_generate(decode_model, params, prompt, max_steps: int, *, beam_size: int,
                  alpha: float = 0.6, eos_id=EOS_ID):
  """Decoder-only LM beam search: prompt [b, P] -> the best [b, max_steps] continuation."""
  total = prompt.shape[1] + max_steps
  cache = init_cache(decode_model, jnp.zeros((prompt.shape[0], total), prompt.dtype))
  seqs, _ = beam_search(_lm_fn(decode_model, params), cache, prompt, max_steps,
                        beam_size=beam_size, alpha=alpha, eos_id=eos_id)
  return seqs[:, 0]
