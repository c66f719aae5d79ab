"""kernel='chunked' in whole models, against kernel='dense'.

Every variant in the live registry that has a chunked form trains a tiny
Transformer for three SGD steps with each kernel, from the same parameters
and batches, with attention dropout (both kernels drop the same weights):
the loss curves and the final parameters must agree to float32 rounding. chunk_size=4 on rows of 11 tokens (and 9 source tokens): several
blocks, the last one partial. Each variant trains one model type, the types
taken in turn over the variants (every type is covered, each variant is
covered once; the whole matrix would triple the compile time, and
tests/attention/kernels/test_blockwise.py already puts every variant through causal,
bidirectional and rectangular masks). All of it is traced into one jit and
compiled once.

Also: cached decoding on the chunked kernel (a prompt, then one token at a
time, grouped-query attention) gives the dense full pass's logits for every
variant that decodes, and XLA's compiled memory for the gradient of a
16k-token LM stays under 1 GiB with the chunked kernel (the dense one needs
several GiB for its [h, n, n] scores alone). Greedy generation through the
chunked kernel is checked end to end in tests/train/test_evaluation.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from flaxformer_lite import config as config_lib
from flaxformer_lite import decoding, models
from flaxformer_lite.attention import registry
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.train import losses, steps
from tests.xla_options import BLOCK_KERNEL_COMPILE

V = 13
TYPES = ('encoder_decoder', 'decoder_only', 'encoder_only')
# Small options so that far blocks occur at these lengths (shaw: beyond the
# clipping distance; t5: one bucket; local: outside the window).
OPTIONS = {'shaw': {'max_distance': 2}, 'local': {'window': 3},
           't5_bias': {'num_buckets': 8, 'bucket_max_distance': 4},
           'deberta': {'position_buckets': 4, 'max_relative_positions': 6}}


def _model_cases():
  cases = []
  for i, name in enumerate(registry.chunked_names()):
    supported = [t for t in TYPES if t in registry.get(name).models]
    if supported:
      cases.append((name, supported[i % len(supported)]))
  return cases


MODEL_CASES = _model_cases()


def _config(name, model_type, implementation, **model):
  cfg = config_lib.base_config()
  cfg.model.update({**dict(type=model_type, vocab_size=V, d_model=16, num_heads=2, mlp_dim=32,
                           dropout_rate=0.0, attention_dropout_rate=0.0, num_encoder_layers=1,
                           num_decoder_layers=1, attention=name), **model})
  cfg.model.attention_kwargs.update(kernel=implementation, chunk_size=4,
                                    **OPTIONS.get(name, {}))
  return cfg


def _batches():
  """3 steps of 3 rows: ragged PAD tails; in row 2 the source is all PAD (its
  decoder queries see no encoder key: the uniform rule) and the target half."""
  rng = np.random.default_rng(0)
  batches = {'inputs': rng.integers(3, V - 1, size=(3, 3, 9)).astype(np.int32),
             'targets': rng.integers(3, V - 1, size=(3, 3, 11)).astype(np.int32)}
  batches['inputs'][:, 0, 6:] = 0
  batches['inputs'][:, 2, :] = 0
  batches['targets'][:, 1, 7:] = 0
  batches['targets'][:, 2, 5:] = 0
  return batches


def _lm_batches(batches, model_type):
  """Single-input models read 'inputs' (with 'targets' the next tokens for the LM):
  11-token rows, one of them half PAD."""
  if model_type == 'encoder_decoder':
    return batches
  ids = batches['targets']
  return {'inputs': ids, 'targets': np.pad(ids[..., 1:], [(0, 0), (0, 0), (0, 1)])}


def _random_params(model, batch, model_type):
  """Random values of the model's parameter shapes (eval_shape: no compile).
  Any values serve: both kernels get the same."""
  args = ((batch['inputs'][0], models.shift_right(batch['targets'][0]))
          if model_type == 'encoder_decoder' else (batch['inputs'][0],))
  shapes = jax.eval_shape(lambda *a: model.init(jax.random.key(0), *a)['params'], *args)
  leaves, tree = jax.tree.flatten(shapes)
  rng = np.random.default_rng(1)
  return jax.tree.unflatten(tree, [(0.3 * rng.normal(size=s.shape)).astype(s.dtype)
                                   for s in leaves])


# blockwise.attend's calls while tracing (the fixture counts them): the chunked
# kernel must really run in the 'chunked' models (not fall back on 'dense').
_ATTEND_CALLS = []
_TRACED_ATTEND_CALLS = {}
ATTENTION_LAYERS = {'encoder_decoder': 3, 'decoder_only': 1, 'encoder_only': 1}
TRAINING = dict(attention_dropout_rate=0.3)


def _train_all(params, batches):
  """{(name, type, implementation): (loss per step [3], final params)}."""
  out = {}
  for name, model_type in MODEL_CASES:
    for implementation in ('dense', 'chunked'):
      model = models.build(_config(name, model_type, implementation, **TRAINING).model)
      state = train_state.TrainState.create(apply_fn=model.apply, params=params[name],
                                            tx=optax.sgd(0.5))
      step = functools.partial(steps.train_step, label_smoothing=0.1,
                               objective=steps.OBJECTIVES[model_type], mlm_rate=0.5,
                               vocab_size=V, data_vocab_size=V - 1)

      def one(state, batch, step=step):
        state, sums = step(state, batch, jax.random.key(1))
        return state, sums['loss'] / sums['tokens']
      before = len(_ATTEND_CALLS)
      state, curve = jax.lax.scan(one, state, batches[model_type])
      _TRACED_ATTEND_CALLS[name, model_type, implementation] = len(_ATTEND_CALLS) - before
      out[name, model_type, implementation] = curve, state.params
  return out


@pytest.fixture(scope='module')
def trained(counting_chunked_attend):
  raw = _batches()
  batches = {t: _lm_batches(raw, t) for t in TYPES}
  params = {name: _random_params(models.build(_config(name, t, 'dense', **TRAINING).model),
                                 batches[t], t)
            for name, t in MODEL_CASES}
  with counting_chunked_attend(_ATTEND_CALLS):
    compiled = jax.jit(_train_all).lower(params, batches).compile(BLOCK_KERNEL_COMPILE)
  return jax.tree.map(np.asarray, compiled(params, batches)), params


def test_every_chunked_variant_and_every_model_type_is_trained():
  assert {name for name, _ in MODEL_CASES} == set(registry.chunked_names())
  assert {t for _, t in MODEL_CASES} == set(TYPES)


@pytest.mark.parametrize('name,model_type', MODEL_CASES,
                         ids=[f'{n}-{t}' for n, t in MODEL_CASES])
def test_chunked_training_follows_the_dense_loss_curve(trained, name, model_type):
  results, initial = trained
  # every attention layer ran the block kernel (once per layer: one trace of the step)
  assert _TRACED_ATTEND_CALLS[name, model_type, 'chunked'] == ATTENTION_LAYERS[model_type]
  assert _TRACED_ATTEND_CALLS[name, model_type, 'dense'] == 0
  dense_curve, dense_params = results[name, model_type, 'dense']
  curve, params = results[name, model_type, 'chunked']
  assert np.all(np.isfinite(curve))
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), dense_params, initial[name])
  assert max(jax.tree.leaves(moved)) > 0.05  # the steps do something
  np.testing.assert_allclose(curve, dense_curve, rtol=2e-6)
  flat, dense_flat = (jax.tree_util.tree_flatten_with_path(p)[0] for p in (params, dense_params))
  for (path, got), (_, want) in zip(flat, dense_flat):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


def _cached_logits(decode_model, params, prompt, continuation):
  """Logits of the prompt (one call), then of each continuation token fed one
  at a time, over the cache: [b, P + T, V]."""
  def step(tokens, cache):
    logits, variables = decode_model.apply({'params': params, 'cache': cache}, tokens,
                                           mutable=['cache'])
    return logits, variables['cache']

  total = prompt.shape[1] + continuation.shape[1]
  cache = decoding.init_cache(decode_model, jnp.zeros((prompt.shape[0], total), prompt.dtype))
  first, cache = step(prompt, cache)
  _, rest = jax.lax.scan(lambda cache, token: step(token[:, None], cache)[::-1], cache,
                         continuation.T)  # [T, b, 1, V]
  return jnp.concatenate([first, rest[:, :, 0].transpose(1, 0, 2)], axis=1)


DECODERS = [name for name in registry.chunked_names()
            if 'decoder_only' in registry.get(name).models]


def _decode_all(params, ids):
  """{name: (full-pass logits on the dense kernel, cached logits on the
  chunked kernel)} [b, L, V]: the prompt's 5 tokens in one call, then one
  token at a time, against a 16-token cache of one key/value head for two
  query heads (blocks of 4: the steps skip the blocks past the index)."""
  out = {}
  for name in DECODERS:
    dense = _config(name, 'decoder_only', 'dense', max_len=16, num_kv_heads=1).model
    chunked_cfg = _config(name, 'decoder_only', 'chunked', max_len=16, num_kv_heads=1).model
    full = models.build(dense).apply({'params': params[name]}, ids)
    cached = _cached_logits(models.build(chunked_cfg, decode=True), params[name], ids[:, :5],
                            ids[:, 5:])
    out[name] = full, cached
  return out


def test_cached_decoding_on_the_chunked_kernel_equals_the_full_pass_for_every_variant(
    counting_chunked_attend):
  """Every chunkable variant that decodes (local included: its window's
  uniform rule is computed near the index, not over the cache), with
  grouped-query attention, through the decoding cache on the chunked kernel
  against the dense full pass."""
  ids = jnp.asarray(np.random.default_rng(3).integers(1, V, size=(2, 14)), jnp.int32)
  params = {name: _random_params(models.build(_config(name, 'decoder_only', 'dense',
                                                       num_kv_heads=1).model),
                                 {'inputs': ids[None]}, 'decoder_only')
            for name in DECODERS}
  calls = []
  with counting_chunked_attend(calls):
    results = jax.jit(_decode_all).lower(params, ids).compile(BLOCK_KERNEL_COMPILE)(params, ids)
  # per variant: the cache's shapes (init), the prompt and the step, all on the chunked kernel
  assert len(calls) == 3 * len(DECODERS)
  for name, (full, cached) in results.items():
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=2e-4, atol=2e-4,
                               err_msg=name)


def test_chunked_lm_gradient_at_16k_tokens_compiles_within_1_gib():
  """1 layer, d_model 512, 8 heads, batch 1, n = 16384, the default chunk size:
  XLA's temp buffers for the loss gradient (compiled, not run). Dense scores
  alone would be 8 heads * 16384^2 * 4 bytes = 8 GiB."""
  n = 16384
  cfg = config_lib.base_config()
  cfg.model.update(type='decoder_only', vocab_size=64, d_model=512, num_heads=8, mlp_dim=512,
                   dropout_rate=0.0, num_encoder_layers=1, num_decoder_layers=1, max_len=n)
  cfg.model.attention_kwargs.kernel = 'chunked'
  model = models.build(cfg.model)
  ids = jax.ShapeDtypeStruct((1, n), jnp.int32)
  params = jax.eval_shape(lambda ids: model.init(jax.random.key(0), ids)['params'], ids)

  def loss(params, batch):
    logits, targets, weights = steps.forward(model.apply, params, batch, objective='lm')
    return losses.token_metrics(logits, targets, weights, 0.1)['loss']

  compiled = jax.jit(jax.grad(loss)).lower(params, {'inputs': ids, 'targets': ids}).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= 2 ** 30, f'{temp / 2 ** 20:.0f} MiB'
