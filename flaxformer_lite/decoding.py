"""Greedy decoding over a cached decoder.

Decoding is written against one interface, as in T5X:
  tokens_to_logits(tokens [b, L], cache) -> (logits [b, L, V], new_cache)
so the same loop serves the encoder-decoder and the decoder-only LM (and any
attention variant: the cache lives in the layers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.models import BOS_ID, EOS_ID, PAD_ID


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


def greedy_translate(model, decode_model, params, inputs, max_len: int):
  """Encoder-decoder greedy decoding.

  model / decode_model: `models.build(cfg)` and `models.build(cfg, decode=True)`.
  inputs [b, m] -> [b, max_len] tokens (EOS included, PAD after it).
  """
  encoded = model.apply({'params': params}, inputs, method='encode')
  cache = init_cache(decode_model, inputs, jnp.zeros((inputs.shape[0], max_len), inputs.dtype))

  def tokens_to_logits(tokens, cache):
    logits, variables = decode_model.apply(
        {'params': params, 'cache': cache}, encoded, inputs, tokens,
        method='decode', mutable=['cache'])
    return logits, variables['cache']

  bos = jnp.full((inputs.shape[0], 1), BOS_ID, inputs.dtype)
  return greedy(tokens_to_logits, cache, bos, max_len)


def greedy_generate(decode_model, params, prompt, max_steps: int):
  """Decoder-only LM: prompt [b, P] -> [b, max_steps] continuation."""
  total = prompt.shape[1] + max_steps
  cache = init_cache(decode_model, jnp.zeros((prompt.shape[0], total), prompt.dtype))

  def tokens_to_logits(tokens, cache):
    logits, variables = decode_model.apply(
        {'params': params, 'cache': cache}, tokens, mutable=['cache'])
    return logits, variables['cache']

  return greedy(tokens_to_logits, cache, prompt, max_steps)
