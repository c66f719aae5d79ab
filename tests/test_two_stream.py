"""model.type=two_stream: every attention variant it takes, the chunked kernel
against the dense one inside it, padding, and a run end to end. (The joint
layer against an explicit reference: tests/layers/test_fusion.py.)"""
import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import models
from flaxformer_lite.attention import registry
from flaxformer_lite.train import profiling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(type='two_stream', vocab_size=20, d_model=16, num_heads=2, num_encoder_layers=1,
            num_decoder_layers=0, mlp_dim=32, dropout_rate=0.0, attention_dropout_rate=0.0,
            attention='dot_product', attention_kwargs={}, positions='sinusoidal', max_len=32,
            pre_ln=True, activation='relu', dtype='float32', fusion='early', fusion_layer=0,
            fusion_bottlenecks=2, num_classes=3)
# Stream A padded after 5 and 7 tokens, stream B after 3 and 4.
A = jnp.asarray([[3, 4, 5, 6, 7, 0, 0], [8, 9, 10, 11, 12, 13, 14]], jnp.int32)
B = jnp.asarray([[15, 16, 17, 0], [18, 19, 15, 16]], jnp.int32)
VARIANTS = [n for n in registry.names() if 'two_stream' in registry.get(n).models]
# Small windows, distances and buckets, so that the variants' position logic
# reaches beyond them on 7 + 4 tokens.
OPTIONS = {'window': 3, 'half_window': 2, 'max_distance': 3, 'num_buckets': 4,
           'bucket_max_distance': 6, 'cope_positions_max': 4}


def _options(name, **extra):
  defaults = registry.get(name).kwargs
  return {**{k: v for k, v in OPTIONS.items() if k in defaults}, **extra}


@functools.lru_cache(maxsize=None)
def _params(name, fusion):
  """Random parameters (0.5 N(0, 1)) of the shapes `init` would create."""
  model = models.build(dict(BASE, attention=name, attention_kwargs=_options(name),
                            fusion=fusion))
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), A, B))['params']
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)


def _logits(name, fusion='early', a=A, b=B, **extra):
  model = models.build(dict(BASE, attention=name, attention_kwargs=_options(name, **extra),
                            fusion=fusion))
  return np.asarray(jax.jit(model.apply)({'params': _params(name, fusion)}, a, b))


def _pad(x, extra):
  return jnp.pad(x, ((0, 0), (0, extra)))


def test_every_transformer_variant_takes_two_streams():
  assert set(VARIANTS) == set(registry.names()) - {
      n for n in registry.names() if 'two_stream' not in registry.get(n).models}
  assert {'dot_product', 'shaw', 'rotary', 'alibi', 't5_bias'} <= set(VARIANTS)


@pytest.mark.parametrize('name', VARIANTS)
def test_each_variant_classifies_ignores_padding_and_runs_chunked(name):
  """Logits [b, classes], finite; more PAD at the end of either stream
  changes nothing (bottleneck fusion, [z; x_i]: padding never moves a token,
  and neither attends nor is attended to, nor pooled). The padded rows go
  through the chunked kernel where the variant has one, so that it is held
  to the dense kernel's logits too (padding on the dense path: variants with
  no chunked form here, tests/layers/test_fusion.py for dot_product)."""
  logits = _logits(name, 'bottleneck')
  assert logits.shape == (2, 3) and np.isfinite(logits).all()
  chunked = {} if registry.get(name).chunked is None else {'kernel': 'chunked',
                                                          'chunk_size': 2}
  np.testing.assert_allclose(_logits(name, 'bottleneck', a=_pad(A, 2), b=_pad(B, 3), **chunked),
                             logits, atol=2e-5)


@pytest.mark.parametrize('fusion,fusion_layer,fused', [
    ('early', 0, True), ('bottleneck', 0, True), ('late', 0, True),
    ('late', 1, False),  # fusion_layer = the one layer: never fused
    ('bottleneck', 1, False)])  # of 2 layers: only the last exchanges, read by no stream
def test_streams_interact_below_the_classifier_only_when_fused(fusion, fusion_layer, fused):
  """The classifier is linear in the two pooled streams, so without fusion
  the logits split as f(A) + g(B): logits(A, B) + logits(A', B') = logits(A,
  B') + logits(A', B). A joint layer breaks the identity; a bottleneck needs
  two fused layers (a stream reads z only in the layer after z read the
  other stream; 2 layers here)."""
  model = models.build(dict(BASE, fusion=fusion, fusion_layer=fusion_layer,
                            num_encoder_layers=2 if fusion == 'bottleneck' else 1))
  params = model.init(jax.random.key(1), A, B)
  a2 = jnp.asarray([[9, 9, 4, 3, 8, 0, 0], [14, 13, 12, 11, 10, 9, 8]], jnp.int32)
  b2 = jnp.asarray([[17, 15, 16, 0], [16, 16, 19, 18]], jnp.int32)
  f = lambda a, b: np.asarray(model.apply(params, a, b))
  gap = np.abs(f(A, B) + f(a2, b2) - f(A, b2) - f(a2, B)).max()
  assert (gap > 1e-3) if fused else (gap < 1e-5), gap


def test_step_flops_counts_a_matmul_by_hand():
  """XLA's count for x @ y, [8, 16] x [16, 4]: 2 * 8 * 16 * 4 multiply-adds."""
  compiled = jax.jit(jnp.matmul).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile()
  assert profiling.step_flops(compiled) == 2 * 8 * 16 * 4


def test_experiment_runs_end_to_end(tmp_path):
  """experiments/two_stream.py through the command line at a tiny size:
  trains, evaluates, and records test accuracy and the step's FLOPs."""
  workdir = tmp_path / 'run'
  done = subprocess.run(
      [sys.executable, '-m', 'flaxformer_lite.main', '--config=experiments/two_stream.py',
       f'--workdir={workdir}', '--config.train.num_steps=6', '--config.train.log_every=3',
       '--config.train.eval_every=6', '--config.train.batch_size=8',
       '--config.data.num_train=64', '--config.data.num_eval=20', '--config.eval.batch_size=8',
       '--config.model.d_model=16', '--config.model.mlp_dim=16',
       '--config.model.num_encoder_layers=2', '--config.model.fusion_layer=1',
       '--config.model.fusion_bottlenecks=2'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  records = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  test = [r for r in records if r['split'] == 'test'][-1]
  train = [r for r in records if r['split'] == 'train'][-1]
  assert 0.0 <= test['accuracy'] <= 1.0 and np.isfinite(test['loss'])
  assert train['step_flops'] > 0
  config = json.load(open(workdir / 'config.json'))
  claims = config['data']['num_claims']
  assert config['model']['num_classes'] == claims + 1  # 0..claims of them hold
