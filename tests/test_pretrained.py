"""pretrained.load on BERT checkpoints against BERT's forward pass written out
in numpy from the checkpoint's own tensors (Devlin et al. 2019; Hugging
Face's BertModel): a tiny random checkpoint written here in the Hugging Face
layout, and all-MiniLM-L6-v2 itself (./launch.sh fetch minilm)."""
import functools
import json
import math
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from flaxformer_lite import models, pretrained

ERF = np.vectorize(math.erf)


def write_safetensors(path, tensors: dict):
  """{name: float32 array} -> a .safetensors file (the format's spec: an
  8-byte header size, a JSON header of dtypes, shapes and offsets, the data)."""
  header, chunks, offset = {}, [], 0
  for name, array in tensors.items():
    raw = np.ascontiguousarray(array, np.float32).tobytes()
    header[name] = {'dtype': 'F32', 'shape': list(array.shape),
                    'data_offsets': [offset, offset + len(raw)]}
    chunks.append(raw)
    offset += len(raw)
  text = json.dumps(header).encode()
  with open(path, 'wb') as f:
    f.write(len(text).to_bytes(8, 'little') + text + b''.join(chunks))


def tiny_bert(path, *, d=8, heads=2, layers=2, ffn=12, vocab=20, max_len=16, prefix=''):
  rng = np.random.default_rng(0)

  def r(*shape):
    return rng.normal(size=shape).astype(np.float32) * 0.5

  t = {f'{prefix}embeddings.word_embeddings.weight': r(vocab, d),
       f'{prefix}embeddings.position_embeddings.weight': r(max_len, d),
       f'{prefix}embeddings.token_type_embeddings.weight': r(2, d),
       f'{prefix}embeddings.LayerNorm.weight': 1 + r(d), f'{prefix}embeddings.LayerNorm.bias': r(d),
       f'{prefix}pooler.dense.weight': r(d, d), f'{prefix}pooler.dense.bias': r(d)}
  for i in range(layers):
    p = f'{prefix}encoder.layer.{i}.'
    for name in ('attention.self.query', 'attention.self.key', 'attention.self.value',
                 'attention.output.dense'):
      t[p + name + '.weight'], t[p + name + '.bias'] = r(d, d), r(d)
    t[p + 'intermediate.dense.weight'], t[p + 'intermediate.dense.bias'] = r(ffn, d), r(ffn)
    t[p + 'output.dense.weight'], t[p + 'output.dense.bias'] = r(d, ffn), r(d)
    for name in ('attention.output.LayerNorm', 'output.LayerNorm'):
      t[p + name + '.weight'], t[p + name + '.bias'] = 1 + r(d), r(d)
  os.makedirs(path, exist_ok=True)
  write_safetensors(os.path.join(path, 'model.safetensors'), t)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'model_type': 'bert', 'hidden_size': d, 'num_attention_heads': heads,
               'num_hidden_layers': layers, 'intermediate_size': ffn, 'vocab_size': vocab,
               'max_position_embeddings': max_len, 'type_vocab_size': 2,
               'layer_norm_eps': 1e-12, 'hidden_act': 'gelu'}, f)
  return {k[len(prefix):]: v for k, v in t.items()}


def bert_forward(t, config, ids):
  """BertModel's last hidden state [b, n, d] for ids [b, n] (0 = [PAD], not
  attended to), in float64 from the checkpoint's tensors."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  d, h = config['hidden_size'], config['num_attention_heads']
  eps = config['layer_norm_eps']

  def ln(x, name):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * t[name + '.weight'] + t[name + '.bias']

  def linear(x, name):
    return x @ t[name + '.weight'].T + t[name + '.bias']

  n = ids.shape[1]
  x = (t['embeddings.word_embeddings.weight'][ids] + t['embeddings.position_embeddings.weight'][:n]
       + t['embeddings.token_type_embeddings.weight'][0])
  x = ln(x, 'embeddings.LayerNorm')
  masked = np.where(ids == 0, -np.inf, 0.0)[:, None, None, :]  # [b, 1, 1, n]
  for i in range(config['num_hidden_layers']):
    p = f'encoder.layer.{i}.'

    def heads(y):
      return y.reshape(y.shape[0], n, h, d // h).transpose(0, 2, 1, 3)

    q, k, v = (heads(linear(x, p + f'attention.self.{w}')) for w in ('query', 'key', 'value'))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // h) + masked
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = (weights @ v).transpose(0, 2, 1, 3).reshape(x.shape)
    x = ln(x + linear(context, p + 'attention.output.dense'), p + 'attention.output.LayerNorm')
    hidden = linear(x, p + 'intermediate.dense')
    hidden = 0.5 * hidden * (1 + ERF(hidden / math.sqrt(2)))
    x = ln(x + linear(hidden, p + 'output.dense'), p + 'output.LayerNorm')
  return x


def _fetched(name):
  """The model's path in the cache, fetched by the project's command; the
  test is skipped, saying why, where the package index cannot be reached
  (the tiny checkpoints written here test the same mapping without it)."""
  try:
    return pretrained.fetch(name)
  except pretrained.PretrainedError as e:
    pytest.skip(f'{name} is not in {pretrained.cache_dir()} and could not be fetched: {e}')


def _hidden(path, ids):
  model_config, params = pretrained.load(path)
  model = models.build(model_config)
  out = jax.jit(functools.partial(model.apply, method=model.encode))({'params': params},
                                                                     jnp.asarray(ids))
  return model_config, np.asarray(out)


@pytest.mark.parametrize('prefix', ['', 'bert.'])
def test_a_bert_checkpoint_gives_bertmodels_hidden_states(tmp_path, prefix, caplog):
  tensors = tiny_bert(str(tmp_path), prefix=prefix)
  config = json.loads((tmp_path / 'config.json').read_text())
  ids = np.array([[5, 9, 3, 17, 2, 0, 0], [1, 2, 3, 4, 5, 6, 7]])
  with caplog.at_level('INFO', logger='flaxformer_lite'):
    model_config, got = _hidden(str(tmp_path), ids)
  assert (model_config.type, model_config.pre_ln, model_config.activation) == (
      'encoder_only', False, 'gelu_exact')
  assert 'mlm_bias' in caplog.text  # the head BertModel lacks is initialised, and said so
  want = bert_forward(tensors, config, ids)
  valid = ids != 0
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)


def test_what_cannot_be_mapped_is_named(tmp_path):
  tensors = tiny_bert(str(tmp_path))
  tensors['encoder.layer.0.attention.self.rotary.weight'] = np.zeros((2, 2), np.float32)
  write_safetensors(str(tmp_path / 'model.safetensors'), tensors)
  with pytest.raises(pretrained.PretrainedError, match=r'encoder\.layer\.0\.attention\.self\.rotary'):
    pretrained.load(str(tmp_path))
  config = json.loads((tmp_path / 'config.json').read_text())
  (tmp_path / 'config.json').write_text(json.dumps({**config, 'model_type': 'gpt2'}))
  with pytest.raises(pretrained.PretrainedError, match="model_type='gpt2'; readable: bert"):
    pretrained.load(str(tmp_path))
  with pytest.raises(pretrained.PretrainedError, match='a GGUF file'):
    pretrained.load(str(tmp_path / 'model.gguf'))


def test_load_zero_fills_unused_parts_and_strict_refuses_what_else_is_missing(tmp_path):
  """A BertModel checkpoint (no masked-LM head): `unused` parts are zeros,
  the rest as a plain load gives it; `strict` names what the checkpoint lacks."""
  from flax import traverse_util
  tensors = tiny_bert(str(tmp_path))
  _, plain = pretrained.load(str(tmp_path))
  _, params = pretrained.load(str(tmp_path), unused=('mlm_',), strict=True)
  plain, params = (traverse_util.flatten_dict(p, sep='/') for p in (plain, params))
  assert sorted(params) == sorted(plain)
  for name, value in params.items():
    if name.startswith('mlm_'):
      assert not np.any(value), name
    else:
      np.testing.assert_array_equal(value, plain[name], err_msg=name)
  with pytest.raises(pretrained.PretrainedError, match='lacks parameters: mlm_bias'):
    pretrained.load(str(tmp_path), strict=True)
  del tensors['pooler.dense.bias'], tensors['encoder.layer.1.output.dense.bias']
  write_safetensors(str(tmp_path / 'model.safetensors'), tensors)
  with pytest.raises(pretrained.PretrainedError,
                     match=r'lacks parameters: encoder/layer_1/.*bias$'):
    pretrained.load(str(tmp_path), unused=('mlm_',), strict=True)


@pytest.mark.parametrize('scanned', [False, True])
def test_the_weights_are_initialised_only_where_the_checkpoint_lacks_them(monkeypatch, scanned):
  """Given the params' shapes, init_params runs the initialisation only for a
  checkpoint that lacks a tensor; a scanned model's layers leave the tensors
  read as they are stacked (one copy of the weights at a time). The reader is
  stubbed with an unrolled model's own tensors (tests/layers/test_scan.py
  checks the stacked values)."""
  from flaxformer_lite import config as config_lib
  from flaxformer_lite.layers import scan

  def build(scan_layers):
    m = config_lib.base_config().model
    m.update(type='decoder_only', vocab_size=11, d_model=8, num_heads=2, mlp_dim=12,
             num_decoder_layers=3, max_len=16, scan_layers=scan_layers)
    return models.build(m)
  ids = jnp.ones((1, 4), jnp.int32)
  tensors = traverse_util.flatten_dict(jax.tree.map(np.asarray, nn.unbox(
      build(False).init(jax.random.key(0), ids))['params']), sep='/')
  shapes = nn.unbox(jax.eval_shape(build(scanned).init, jax.random.key(0), ids))['params']
  calls = []
  fresh = lambda: calls.append(1) or jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
  for lacking in ((), ('embed/embedding',)):
    read = {k: v for k, v in tensors.items() if k not in lacking}
    monkeypatch.setattr(pretrained, '_read', lambda path, read=read: (None, read))
    params = traverse_util.flatten_dict(pretrained.init_params(shapes, 'ckpt', init=fresh),
                                        sep='/')
    assert len(calls) == len(lacking)
    # Stacked, only the tensors outside the layers stay in what was read.
    assert sorted(read) == sorted(k for k in tensors if k not in lacking
                                  and not (scanned and '/layer_' in k))
    assert not lacking or not params['embed/embedding'].any()  # the initialisation's zeros
  assert any(k.startswith(f'decoder/{scan.SCANNED}/') for k in params) == scanned


def test_init_from_takes_the_architecture_and_the_weights(tmp_path):
  """model.init_from on the training path: main.from_checkpoint sets the
  checkpoint's architecture and attention variant (a variant given on the
  command line stays), and the train state starts from its tensors (the
  masked-LM head it lacks from the run's own initialisation)."""
  from flaxformer_lite import config as config_lib, main
  from flaxformer_lite.train import state as state_lib
  tensors = tiny_bert(str(tmp_path / 'bert'), vocab=30, max_len=32)
  c = config_lib.base_config()
  c.model.init_from = str(tmp_path / 'bert')
  c.model.attention = 'alibi'  # from the experiment file: the checkpoint's wins
  lines = main.from_checkpoint(c)
  assert (c.model.type, c.model.d_model, c.model.num_encoder_layers, c.model.vocab_size,
          c.model.attention) == ('encoder_only', 8, 2, 30, 'dot_product')
  assert len(lines) == 1 and "type='encoder_only'" in lines[0] and 'd_model=8' in lines[0]
  c.model.attention = 'alibi'  # from the command line: kept
  lines = main.from_checkpoint(c, keep={'model.attention'})
  assert c.model.attention == 'alibi'
  assert lines == ['init_from: kept from the command line: attention']
  c.model.attention = 'dot_product'
  model = models.build(c.model)
  state = state_lib.create(model, c, {'inputs': np.ones((1, 6), np.int32)},
                           jax.random.key(0))
  p = state.params
  np.testing.assert_array_equal(p['embed']['embedding'],
                                tensors['embeddings.word_embeddings.weight'])
  np.testing.assert_array_equal(
      np.asarray(p['encoder']['layer_1']['self_attention']['query']['kernel']).reshape(8, 8),
      tensors['encoder.layer.1.attention.self.query.weight'].T)
  np.testing.assert_array_equal(p['encoder']['layer_0']['mlp_block']['norm']['bias'],
                                tensors['encoder.layer.0.output.LayerNorm.bias'])
  assert np.asarray(p['mlm_norm']['scale']).tolist() == [1.0] * 8  # initialised: LayerNorm's 1s

  # evaluated as it is (train.num_steps=0), a checkpoint without the
  # masked-LM head would score a random head: refused, the head named
  c.train.num_steps = 0
  with pytest.raises(pretrained.PretrainedError,
                     match=r"lacks 5 parameters .*\(mlm_bias, mlm_dense, mlm_norm\): with "
                           r'train\.num_steps=0'):
    state_lib.create(model, c, {'inputs': np.ones((1, 6), np.int32)}, jax.random.key(0))

  c.model.init_from = str(tmp_path / 'nothing')
  with pytest.raises(config_lib.ConfigError, match="model.init_from=.*nothing' does not exist"):
    main.from_checkpoint(c)


# --- the Llama family, from GGUF -------------------------------------------------

def _f16(x):
  return np.float16(x).tobytes()


def q4_1_block(d, m, q):
  """One Q4_1 block (32 values x = d q + m, q in 0..15) as the ggml layout stores it."""
  q = np.asarray(q, np.uint8)
  return _f16(d) + _f16(m) + (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()


def q8_0_block(d, q):
  return _f16(d) + np.asarray(q, np.int8).tobytes()


def write_gguf(path, metadata: dict, tensors: dict):
  """A GGUF v3 file: metadata {key: int | float | str | list of str} and
  tensors {name: (numpy shape, ggml type, raw bytes)} (the spec: header,
  key-values, tensor infos with dims fastest-first, data aligned to 32)."""
  import struct

  def string(s):
    b = s.encode()
    return struct.pack('<Q', len(b)) + b

  def value(v):
    if isinstance(v, str):
      return struct.pack('<I', 8) + string(v)
    if isinstance(v, float):
      return struct.pack('<If', 6, v)
    if isinstance(v, list):
      return struct.pack('<IIQ', 9, 8, len(v)) + b''.join(string(s) for s in v)
    return struct.pack('<II', 4, v)

  out = b'GGUF' + struct.pack('<IQQ', 3, len(tensors), len(metadata))
  out += b''.join(string(k) + value(v) for k, v in metadata.items())
  offset, data = 0, b''
  for name, (shape, kind, raw) in tensors.items():
    out += string(name) + struct.pack('<I', len(shape))
    out += b''.join(struct.pack('<Q', n) for n in reversed(shape)) + struct.pack('<IQ', kind, offset)
    padded = raw + b'\0' * (-len(raw) % 32)
    data += padded
    offset += len(padded)
  out += b'\0' * (-len(out) % 32)
  with open(path, 'wb') as f:
    f.write(out + data)


def test_q4_1_and_q8_0_blocks_dequantise_by_hand(tmp_path):
  q = np.arange(32) % 16
  q8 = np.arange(-16, 16)
  write_gguf(str(tmp_path / 'q.gguf'), {'general.architecture': 'llama'}, {
      'a': ((2, 32), 3, q4_1_block(0.5, -1.0, q) + q4_1_block(2.0, 3.0, q[::-1])),
      'b': ((32,), 8, q8_0_block(0.25, q8)),
      'c': ((2, 2), 0, np.array([[1, 2], [3, 4]], np.float32).tobytes())})
  _, infos = pretrained.read_gguf(str(tmp_path / 'q.gguf'))
  read = {name: pretrained._dequantise(str(tmp_path / 'q.gguf'), info)
          for name, info in infos.items()}
  np.testing.assert_array_equal(read['a'][0], 0.5 * q - 1.0)
  np.testing.assert_array_equal(read['a'][1], 2.0 * q[::-1] + 3.0)
  np.testing.assert_array_equal(read['b'], 0.25 * q8)
  np.testing.assert_array_equal(read['c'], [[1, 2], [3, 4]])


def llama_forward(t, meta, ids):
  """A Llama's logits [n, V] for ids [n], float64, from GGUF tensors: RMSNorm,
  RoPE on adjacent feature pairs (GGUF's q and k are permuted for it),
  grouped-query causal attention, SwiGLU, the tied (or output) matrix."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  d, h = meta['llama.embedding_length'], meta['llama.attention.head_count']
  kv, eps = meta['llama.attention.head_count_kv'], meta['llama.attention.layer_norm_rms_epsilon']
  dh, n = d // h, len(ids)
  base = meta['llama.rope.freq_base']

  def rms(x, w):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

  def rope(x):  # [n, heads, dh]
    out = x.copy()
    for pos in range(n):
      for i in range(dh // 2):
        angle = pos * base ** (-2 * i / dh)
        a, b = x[pos, :, 2 * i], x[pos, :, 2 * i + 1]
        out[pos, :, 2 * i] = a * np.cos(angle) - b * np.sin(angle)
        out[pos, :, 2 * i + 1] = a * np.sin(angle) + b * np.cos(angle)
    return out

  x = t['token_embd.weight'][ids]
  for i in range(meta['llama.block_count']):
    p = f'blk.{i}.'
    y = rms(x, t[p + 'attn_norm.weight'])
    q = rope((y @ t[p + 'attn_q.weight'].T).reshape(n, h, dh))
    k = rope((y @ t[p + 'attn_k.weight'].T).reshape(n, kv, dh))
    v = (y @ t[p + 'attn_v.weight'].T).reshape(n, kv, dh)
    out = np.zeros((n, h, dh))
    for head in range(h):
      g = head // (h // kv)
      scores = q[:, head] @ k[:, g].T / np.sqrt(dh)
      scores[np.triu_indices(n, 1)] = -np.inf
      w = np.exp(scores - scores.max(-1, keepdims=True))
      out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, g]
    x = x + out.reshape(n, d) @ t[p + 'attn_output.weight'].T
    y = rms(x, t[p + 'ffn_norm.weight'])
    gate, up = y @ t[p + 'ffn_gate.weight'].T, y @ t[p + 'ffn_up.weight'].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + 'ffn_down.weight'].T
  x = rms(x, t['output_norm.weight'])
  return x @ t.get('output.weight', t['token_embd.weight']).T


def _logits(path, ids):
  model_config, params = pretrained.load(path)
  model = models.build(model_config)
  return model_config, np.asarray(jax.jit(model.apply)({'params': params},
                                                         jnp.asarray(ids)[None]))[0]


def tiny_llama(path, *, d=8, h=2, kv=1, layers=2, ffn=12, vocab=20, untied=False,
               tokens=None, eos=2):
  rng = np.random.default_rng(1)
  meta = {'general.architecture': 'llama', 'llama.block_count': layers,
          'llama.context_length': 64, 'llama.embedding_length': d,
          'llama.feed_forward_length': ffn, 'llama.attention.head_count': h,
          'llama.attention.head_count_kv': kv, 'llama.rope.freq_base': 100.0,
          'llama.attention.layer_norm_rms_epsilon': 1e-5, 'llama.vocab_size': vocab,
          'llama.rope.dimension_count': d // h}
  if tokens:
    meta.update({'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.pre': 'smollm',
                 'tokenizer.ggml.tokens': tokens, 'tokenizer.ggml.merges': ['Ġ t'],
                 'tokenizer.ggml.eos_token_id': eos})
  shapes = {'token_embd.weight': (vocab, d), 'output_norm.weight': (d,)}
  if untied:
    shapes['output.weight'] = (vocab, d)
  for i in range(layers):
    p = f'blk.{i}.'
    shapes.update({p + 'attn_norm.weight': (d,), p + 'ffn_norm.weight': (d,),
                   p + 'attn_q.weight': (d, d), p + 'attn_k.weight': (kv * d // h, d),
                   p + 'attn_v.weight': (kv * d // h, d), p + 'attn_output.weight': (d, d),
                   p + 'ffn_gate.weight': (ffn, d), p + 'ffn_up.weight': (ffn, d),
                   p + 'ffn_down.weight': (d, ffn)})
  tensors, values = {}, {}
  for name, shape in shapes.items():
    if name.endswith('attn_q.weight'):  # Q4_1, the quantised path
      blocks = int(np.prod(shape)) // 32
      d_m_q = [(0.1, -0.8, rng.integers(0, 16, 32)) for _ in range(blocks)]
      raw = b''.join(q4_1_block(*b) for b in d_m_q)
      values[name] = np.concatenate([np.float16(dd).astype(np.float32) * q +  # as stored
                                     np.float16(m).astype(np.float32)
                                     for dd, m, q in d_m_q]).reshape(shape)
      tensors[name] = (shape, 3, raw)
    else:
      values[name] = rng.normal(size=shape).astype(np.float32) * 0.5 + (
          1.0 if name.endswith('norm.weight') else 0.0)
      tensors[name] = (shape, 0, values[name].tobytes())
  write_gguf(path, meta, tensors)
  return meta, values


@pytest.mark.parametrize('untied', [False, True])
def test_a_llama_gguf_gives_the_llama_forward(tmp_path, untied):
  path = str(tmp_path / 'tiny.gguf')
  meta, values = tiny_llama(path, untied=untied)
  ids = np.array([3, 7, 1, 19, 4, 4, 11])
  model_config, got = _logits(path, ids)
  assert (model_config.type, model_config.num_kv_heads, model_config.attention,
          model_config.tie_embeddings) == ('decoder_only', 1, 'rotary', not untied)
  np.testing.assert_allclose(got, llama_forward(values, meta, ids), rtol=1e-4, atol=1e-4)


def llama_cpp_permute(w, heads):
  """llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute): Hugging Face's
  q or k rows, rotating halves of each head, reordered into the adjacent
  pairs GGUF files rotate."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def tiny_hf_llama(path, *, d=8, h=2, kv=1, layers=2, ffn=12, vocab=20, untied=False,
                  shards=1, prefix='model.'):
  """A random Llama as Hugging Face saves one (config.json + safetensors, in
  `shards` files with an index when more than one) -> (the same tensors under
  GGUF names, q and k permuted as llama.cpp converts them; llama_forward's meta)."""
  rng = np.random.default_rng(2)
  dh = d // h
  shapes = {'embed_tokens.weight': (vocab, d), 'norm.weight': (d,)}
  for i in range(layers):
    p = f'layers.{i}.'
    shapes.update({p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight': (d,),
                   p + 'self_attn.q_proj.weight': (h * dh, d),
                   p + 'self_attn.k_proj.weight': (kv * dh, d),
                   p + 'self_attn.v_proj.weight': (kv * dh, d),
                   p + 'self_attn.o_proj.weight': (d, h * dh), p + 'mlp.gate_proj.weight': (ffn, d),
                   p + 'mlp.up_proj.weight': (ffn, d), p + 'mlp.down_proj.weight': (d, ffn)})
  hf = {prefix + name: rng.normal(size=shape).astype(np.float32) * 0.5 + (
      1.0 if name.endswith('norm.weight') else 0.0) for name, shape in shapes.items()}
  if untied:
    hf['lm_head.weight'] = rng.normal(size=(vocab, d)).astype(np.float32) * 0.5
  hf[prefix + 'layers.0.self_attn.rotary_emb.inv_freq'] = np.ones(dh // 2, np.float32)
  os.makedirs(path, exist_ok=True)
  names = sorted(hf)
  if shards == 1:
    write_safetensors(os.path.join(path, 'model.safetensors'), hf)
  else:
    weight_map = {}
    for k in range(shards):
      file = f'model-{k + 1:05d}-of-{shards:05d}.safetensors'
      write_safetensors(os.path.join(path, file), {n: hf[n] for n in names[k::shards]})
      weight_map.update({n: file for n in names[k::shards]})
    with open(os.path.join(path, 'model.safetensors.index.json'), 'w') as f:
      json.dump({'metadata': {}, 'weight_map': weight_map}, f)
  config = {'model_type': 'llama', 'hidden_size': d, 'num_attention_heads': h,
            'num_key_value_heads': kv, 'num_hidden_layers': layers, 'intermediate_size': ffn,
            'vocab_size': vocab, 'max_position_embeddings': 64, 'rms_norm_eps': 1e-5,
            'rope_theta': 100.0, 'hidden_act': 'silu', 'tie_word_embeddings': not untied,
            'rope_scaling': None, 'attention_bias': False}
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(config, f)
  gguf = {'token_embd.weight': hf[prefix + 'embed_tokens.weight'],
          'output_norm.weight': hf[prefix + 'norm.weight']}
  if untied:
    gguf['output.weight'] = hf['lm_head.weight']
  names = {'input_layernorm': 'attn_norm', 'post_attention_layernorm': 'ffn_norm',
           'self_attn.q_proj': 'attn_q', 'self_attn.k_proj': 'attn_k',
           'self_attn.v_proj': 'attn_v', 'self_attn.o_proj': 'attn_output',
           'mlp.gate_proj': 'ffn_gate', 'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down'}
  for i in range(layers):
    for theirs, ours in names.items():
      w = hf[f'{prefix}layers.{i}.{theirs}.weight']
      if ours in ('attn_q', 'attn_k'):
        w = llama_cpp_permute(w, h if ours == 'attn_q' else kv)
      gguf[f'blk.{i}.{ours}.weight'] = w
  meta = {'llama.embedding_length': d, 'llama.attention.head_count': h,
          'llama.attention.head_count_kv': kv, 'llama.attention.layer_norm_rms_epsilon': 1e-5,
          'llama.rope.freq_base': 100.0, 'llama.block_count': layers}
  return gguf, meta


@pytest.mark.parametrize('untied,shards,prefix', [(False, 1, 'model.'), (True, 3, 'model.'),
                                                  (False, 1, '')],
                         ids=['tied', 'untied-3-shards', 'llamamodel-names'])
def test_a_hugging_face_llama_directory_gives_the_llama_forward(tmp_path, untied, shards,
                                                                prefix):
  """A Llama directory as Hugging Face writes it: the forward of the same
  weights converted as llama.cpp converts them (its q/k permutation, RoPE on
  adjacent pairs: llama_forward), so Hugging Face's halves layout is read
  as such, without the permutation."""
  path = str(tmp_path / 'llama')
  gguf, meta = tiny_hf_llama(path, untied=untied, shards=shards, prefix=prefix)
  ids = np.array([3, 7, 1, 19, 4, 4, 11])
  model_config, got = _logits(path, ids)
  assert (model_config.type, model_config.num_kv_heads, model_config.tie_embeddings,
          model_config.attention_kwargs.rotary_layout) == ('decoder_only', 1, not untied, 'halves')
  np.testing.assert_allclose(got, llama_forward(gguf, meta, ids), rtol=1e-4, atol=1e-4)
  # model.init_from on the training path takes the same architecture
  from flaxformer_lite import config as config_lib, main
  c = config_lib.base_config()
  c.model.init_from = path
  main.from_checkpoint(c)
  assert (c.model.type, c.model.num_decoder_layers, c.model.attention,
          c.model.attention_kwargs.rotary_layout, c.model.attention_kwargs.max_wavelength) == (
              'decoder_only', 2, 'rotary', 'halves', 100.0)


def test_what_a_llama_directory_cannot_give_is_named(tmp_path):
  path = str(tmp_path / 'llama')
  tiny_hf_llama(path)
  with open(os.path.join(path, 'config.json')) as f:
    config = json.load(f)
  for key, value, message in (
      ('rope_scaling', {'rope_type': 'llama3'}, "rope_scaling={'rope_type': 'llama3'}"),
      ('attention_bias', True, 'attention_bias=True; readable: False'),
      ('hidden_act', 'gelu', "hidden_act='gelu'; readable: 'silu'"),
      ('model_type', 'qwen2', "model_type='qwen2'; readable: bert, llama")):
    with open(os.path.join(path, 'config.json'), 'w') as f:
      json.dump({**config, key: value}, f)
    with pytest.raises(pretrained.PretrainedError, match=re.escape(message)):
      pretrained.load(path)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(config, f)
  tensors = pretrained.read_safetensors(os.path.join(path, 'model.safetensors'))
  write_safetensors(os.path.join(path, 'model.safetensors'),
                    {**tensors, 'model.layers.0.self_attn.q_norm.weight': np.ones(4, np.float32)})
  with pytest.raises(pretrained.PretrainedError, match='model.layers.0.self_attn.q_norm.weight'):
    pretrained.load(path)


def _golden(name):
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'golden',
                         f'{name}.json')) as f:
    return json.load(f)


def _close(got, want):
  """float32 against the reference: relative error <= 1e-4 (of the largest value)."""
  want = np.asarray(want)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_smollm2_matches_transformers():
  """SmolLM2-135M-Instruct (Q4_1), fetched by the project's command, against
  Hugging Face transformers' LlamaForCausalLM on the same GGUF
  (tests/golden/smollm2.json): the tokenizer's ids, a full pass's logits,
  and greedy decoding with the cache, token by token and logit by logit.
  (The numpy Llama forward checks the same mapping on a tiny GGUF.)"""
  from flaxformer_lite import decoding
  path = _fetched('smollm2')
  golden = _golden('smollm2')
  tokenizer = pretrained.gguf_tokenizer(path)
  for text, ids in zip(golden['texts'], golden['ids']):
    assert tokenizer.encode(text).tolist() == ids, text
  prompt = np.asarray(golden['prompt'])
  model_config, params = pretrained.load(path)
  model = models.build(model_config)
  got = np.asarray(jax.jit(model.apply)({'params': params}, jnp.asarray(prompt)[None]))[0]
  columns = golden['columns']
  _close(got[:, columns], golden['logits'])


  decode_model = models.build(model_config, decode=True)
  steps = len(golden['greedy'])
  cache = decoding.init_cache(decode_model, jnp.zeros((1, len(prompt) + steps), jnp.int32))
  # The parameters as an argument, not constants of the computation.
  step = jax.jit(lambda params, tokens, cache: decoding._lm_fn(decode_model, params)(tokens,
                                                                                      cache))
  for token in prompt:  # the prompt a token at a time: one compiled step for all
    logits, cache = step(params, jnp.asarray([[token]], jnp.int32), cache)
  tokens, step_logits = [], []
  for _ in range(steps):
    last = np.asarray(logits)[0, -1]
    step_logits.append(last[columns])
    tokens.append(int(np.argmax(last)))
    logits, cache = step(params, jnp.asarray([[tokens[-1]]], jnp.int32), cache)
  assert tokens == golden['greedy']
  _close(np.stack(step_logits), golden['greedy_logits'])
  assert tokenizer.decode(tokens)  # text, not nothing


def test_a_directorys_byte_level_bpe_tokenizer_json_gives_the_reference_ids(tmp_path):
  """SmolLM2's vocabulary and merges (from its GGUF) as a Hugging Face
  directory's tokenizer.json (BPE; Digits, then ByteLevel): the ids that
  transformers' tokenizer gave for the golden texts, and config.json's
  eos_token_id as the end id. A pre-tokenizer that splits text otherwise is
  refused, naming it."""
  meta, _ = pretrained.read_gguf(_fetched('smollm2'))
  tokens = meta['tokenizer.ggml.tokens']
  spec = {'normalizer': None,
          'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [
              {'type': 'Digits', 'individual_digits': True},
              {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True,
               'use_regex': True}]},
          'added_tokens': [{'id': 0, 'content': tokens[0], 'special': True}],
          'model': {'type': 'BPE', 'vocab': {t: i for i, t in enumerate(tokens) if i},
                    'merges': [m.split(' ', 1) for m in meta['tokenizer.ggml.merges']]}}
  path = tmp_path / 'smollm2'
  path.mkdir()
  (path / 'config.json').write_text(json.dumps({'model_type': 'llama', 'eos_token_id': 2}))
  (path / 'tokenizer.json').write_text(json.dumps(spec))
  tokenizer = pretrained.tokenizer(str(path))
  golden = _golden('smollm2')
  for text, ids in zip(golden['texts'], golden['ids']):
    assert tokenizer.encode(text).tolist() == ids, text
  assert tokenizer.eos_id == 2
  spec['pre_tokenizer'] = {'type': 'Metaspace', 'replacement': '\u2581'}
  (path / 'tokenizer.json').write_text(json.dumps(spec))
  with pytest.raises(pretrained.PretrainedError, match='Metaspace'):
    pretrained.tokenizer(str(path))
  # By hand: with a merge '1 2', Digits keeps '12' as two tokens; ByteLevel alone merges it.
  byte_level = {'type': 'ByteLevel', 'add_prefix_space': False}
  spec['model'] = {'type': 'BPE', 'vocab': {'1': 0, '2': 1, '12': 2}, 'merges': ['1 2']}
  spec['added_tokens'] = []
  for steps, want in (([{'type': 'Digits', 'individual_digits': True}, byte_level], [0, 1]),
                      ([byte_level], [2])):
    spec['pre_tokenizer'] = {'type': 'Sequence', 'pretokenizers': steps}
    (path / 'tokenizer.json').write_text(json.dumps(spec))
    assert pretrained.tokenizer(str(path)).encode('12').tolist() == want, steps


def test_minilm_matches_transformers_bertmodel_and_its_bert_forward():
  """all-MiniLM-L6-v2, fetched by the project's command, against Hugging
  Face transformers' BertModel (tests/golden/minilm.json): the tokenizer's
  ids and the last hidden state; a padded batch against the numpy forward."""
  path = _fetched('minilm')
  golden = _golden('minilm')
  tokenizer = pretrained.tokenizer(path)
  # BERT's own example of a word cut into pieces (uncased vocabulary)
  assert [tokenizer.tokens[int(i)] for i in tokenizer.encode('Unaffable')] == [
      'una', '##ffa', '##ble']
  model_config, params = pretrained.load(path)
  model = models.build(model_config)
  encode = jax.jit(functools.partial(model.apply, method=model.encode))
  for text, ids, hidden in zip(golden['texts'], golden['ids'], golden['hidden']):
    assert tokenizer.with_specials(tokenizer.encode(text)).tolist() == ids, text
    _close(np.asarray(encode({'params': params}, jnp.asarray([ids])))[0], hidden)
  config = json.loads(open(os.path.join(path, 'config.json')).read())
  tensors = pretrained.read_safetensors(os.path.join(path, 'model.safetensors'))
  fox, hello = (tokenizer.with_specials(tokenizer.encode(t)) for t in ('The quick fox', 'Hi'))
  ids = np.stack([fox, np.pad(hello, (0, len(fox) - len(hello)))])  # a shorter row padded
  got = np.asarray(encode({'params': params}, jnp.asarray(ids)))
  valid = ids != 0
  _close(got[valid], bert_forward(tensors, config, ids)[valid])


def test_wordpiece_cuts_words_greedily_by_hand(tmp_path):
  """A tokenizer.json of a few pieces: normalised (lowercase, accents and
  control characters gone), split at spaces and punctuation, each word cut
  into its longest pieces from the start, [UNK] for a word that cannot be."""
  from flaxformer_lite.data import tokenizers
  pieces = ['[PAD]', '[unused0]', '[unused1]', '[UNK]', '[CLS]', '[SEP]', 'un', '##aff',
            '##able', '##a', 'hello', ',', 'world', '!', 'cafe', 'x', '##y']
  (tmp_path / 'tokenizer.json').write_text(json.dumps({
      'normalizer': {'type': 'BertNormalizer', 'lowercase': True},
      'model': {'type': 'WordPiece', 'unk_token': '[UNK]', 'continuing_subword_prefix': '##',
                'max_input_chars_per_word': 9, 'vocab': {p: i for i, p in enumerate(pieces)}}}))
  tok = pretrained.tokenizer(str(tmp_path))
  assert isinstance(tok, tokenizers.WordPieceTokenizer)
  text = 'Unaffable, HELLO\tworld!\x07 Café xy unaffablea xyz'
  want = ['un', '##aff', '##able', ',', 'hello', 'world', '!', 'cafe', 'x', '##y', '[UNK]',
          '[UNK]']  # 'unaffablea' is longer than 9 characters; 'xyz' has no cut for z
  assert [pieces[i] for i in tok.encode(text)] == want
  assert tok.decode(tok.encode('hello, xy')) == 'hello , xy'
  assert tok.with_specials(tok.encode('x')).tolist() == [4, 15, 5]
  # A text ends with [SEP], as BERT was trained to read it, in the datasets
  # (documents and sentences) and when decoding.
  from flaxformer_lite.data import loading
  assert loading._encode(tok, 'x x', None, 'drop')[0].tolist() == [15, 15, 5]
  assert tok.decode([15, 5, 10]) == 'x'


def test_a_gguf_files_eos_token_ends_its_texts(tmp_path):
  from flaxformer_lite.data import loading, tokenizers
  symbols = tokenizers.byte_symbols()
  tokens = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] + [symbols[b] for b in range(256)]
  for eos in (0, 2):  # SmolLM2's base models end with <|endoftext|>, the instruct ones <|im_end|>
    path = str(tmp_path / f'eos_{eos}.gguf')
    meta, _ = tiny_llama(path, vocab=len(tokens), tokens=tokens, eos=eos)
    tok = pretrained.tokenizer(path)
    assert tok.eos_id == eos
    assert loading._encode(tok, 'hi', None, 'drop')[0].tolist() == [3 + ord('h'), 3 + ord('i'),
                                                                       eos]
  assert tok.decode([3 + ord('h'), 2, 3 + ord('i')]) == 'h'


def test_byte_level_bpe_merges_by_rank_by_hand():
  """A vocabulary of single bytes and a few merges: each pre-token merges its
  best-ranked pair first (rank = place in the merges list), then again."""
  from flaxformer_lite.data import tokenizers
  symbols = tokenizers.byte_symbols()
  space = symbols[ord(' ')]  # 'Ġ'
  singles = [symbols[b] for b in range(256)]
  merged = ['he', 'll', 'hell', 'hello', space + 'w', 'or', space + 'wor']
  merges = ['h e', 'l l', 'he ll', 'hell o', f'{space} w', 'o r', f'{space}w or']
  tok = tokenizers.BPETokenizer(singles + merged, merges, split_digits=True)
  ids = {t: i for i, t in enumerate(tok.tokens)}
  assert tok.pieces('hello world 42!') == ['hello', ' world', ' ', '4', '2', '!']
  want = ['hello', space + 'wor', 'l', 'd', space, '4', '2', '!']
  assert tok.encode('hello world 42!').tolist() == [ids[t] for t in want]
  assert tok.encode('help').tolist() == [ids[t] for t in ('he', 'l', 'p')]  # 'll' needs two l
  for text in ('hello world 42!', 'naïve café — ✓\n\n  x'):
    assert tok.decode(tok.encode(text)) == text


def test_a_gguf_llama_fine_tunes_on_tiny_shakespeare_with_its_own_tokenizer(
    tmp_path, tfds_dir, shared_data, caplog):
  """The user's path: model.init_from a GGUF file and data.tokenizer=pretrained.
  The run takes the file's architecture, tokenizes the corpus with its BPE
  (here: three specials, the 256 byte symbols and one merge: byte b is
  token 3 + b), trains 2 steps and evaluates."""
  from flaxformer_lite import config as config_lib, data, main
  from flaxformer_lite.data import tokenizers
  from flaxformer_lite.train import loop
  symbols = tokenizers.byte_symbols()
  tokens = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] + [symbols[b] for b in range(256)]
  tokens.append('Ġt')
  path = str(tmp_path / 'tiny.gguf')
  meta, values = tiny_llama(path, vocab=len(tokens), tokens=tokens)
  c = config_lib.base_config()
  c.model.init_from = path
  c.data.task, c.data.tokenizer, c.data.max_len = 'tiny_shakespeare', 'pretrained', 16
  c.data.manual_dir, c.data.data_dir = os.path.join(shared_data, 'tiny_shakespeare'), tfds_dir
  c.train.num_steps, c.train.batch_size, c.train.label_smoothing = 2, 2, 0.0
  c.train.log_every = c.train.eval_every = c.train.checkpoint_every = 1
  c.eval.max_examples, c.eval.sample_prompt, c.eval.sample_len = 2, 8, 4
  c.eval.at_start = True  # the checkpoint as it came, at step 0, beside the trained steps
  main.from_checkpoint(c)
  main.validate(c)
  assert c.model.type == 'decoder_only' and c.model.num_kv_heads == 1
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(c, workdir)

  with caplog.at_level('INFO', logger='flaxformer_lite'):
    dataset = data.load(c.data, tokenizer_from=path)
  # the data line names the file's tokenizer, not the corpus builder's 'char'
  assert (f'data: tiny_shakespeare tokenized by the tokenizer of {path} (BPETokenizer), '
          f'vocabulary {len(tokens)}') in caplog.text
  assert dataset.vocab_size == len(tokens)
  text = 'First Citizen:\nBefore we proceed'
  assert dataset.tokenizer.decode(dataset.tokenizer.encode(text)) == text
  assert dataset.splits['train'][:len(text)].tolist()[:6] == [3 + b for b in b'First ']
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  assert [r['step'] for r in records if r['split'] == 'eval'] == [0, 1, 2]
  saved = json.loads(open(os.path.join(workdir, 'config.json')).read())
  assert saved['model']['d_model'] == 8 and saved['model']['attention'] == 'rotary'

  # train.num_steps=0: the checkpoint evaluated as it is, against the numpy
  # Llama's mean next-token loss over the same windows.
  c.train.num_steps = 0
  main.validate(c)
  evaluated = str(tmp_path / 'evaluated')
  results = loop.train_and_evaluate(c, evaluated)
  windows = data.lm_eval_arrays(dataset.splits['validation'], 16)
  nll = []
  for inputs, targets in zip(windows['inputs'][:2], windows['targets'][:2]):
    logits = llama_forward(values, meta, inputs)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                           ) - logits.max(-1, keepdims=True)
    nll += [-logp[i, t] for i, t in enumerate(targets) if t != 0]
  assert results['eval']['nll'] == pytest.approx(np.mean(nll), rel=1e-4)
  records = [json.loads(l) for l in open(os.path.join(evaluated, 'metrics.jsonl'))]
  assert [(r['step'], r['split']) for r in records] == [(0, 'eval')]  # no test split
  assert not os.path.exists(os.path.join(evaluated, 'checkpoints'))
  # the same command again: the evaluation recorded stands, written once
  again = loop.train_and_evaluate(c, evaluated)
  assert again['eval'] == results['eval']
  assert [json.loads(l) for l in open(os.path.join(evaluated, 'metrics.jsonl'))] == records

