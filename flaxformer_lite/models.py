"""build(model_config) -> a linen Module (token ids: flaxformer_lite/tokens.py)."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import entry, masks, registry
from flaxformer_lite.config import check, check_choice, ConfigError
from flaxformer_lite.layers import (Decoder, Embed, Encoder, RNNConfig, RNNDecoder,
                                    RNNEncoder, TransformerConfig, TwoStreamEncoder)
from flaxformer_lite.layers.embeddings import POSITIONS
from flaxformer_lite.layers.fusion import FUSIONS
from flaxformer_lite.layers.rnn import CELLS
from flaxformer_lite.layers.transformer import (ACTIVATIONS, INITS, NORMS, REMAT, embed_kwargs,
                                               embed_tokens)
from flaxformer_lite.model_types import MODEL_TYPES, SCANNABLE_TYPES
from flaxformer_lite.tokens import BOS_ID, EOS_ID, PAD_ID, shift_right  # noqa: F401 (re-exported)

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'auto': None}


def compute_dtype(name: str):
  """model.dtype -> the compute dtype; 'auto': bfloat16 on a GPU or TPU (their
  matrix units' fast format, as nanoGPT and MaxText train), float32 on CPU
  (where bfloat16 matmuls are emulated and slower)."""
  if name == 'auto':
    return jnp.bfloat16 if jax.default_backend() in ('gpu', 'tpu') else jnp.float32
  return DTYPES[name]


def padding_mask(ids, causal=False, segmentation=None) -> masks.Mask:
  """Self-attention over ids [b, n]: PAD tokens neither attend nor are attended
  to; causal: key j <= query i; segmentation [b, n] (packed rows): only within
  a segment. A function (masks.Mask): the attention kernel evaluates it whole
  or block by block."""
  mask = masks.padding(ids > PAD_ID)
  if causal:
    mask = masks.causal() & mask
  if segmentation is not None:
    mask = mask & masks.segments(segmentation, segmentation)
  return mask


class EncoderDecoder(nn.Module):
  """Encoder-decoder Transformer with one embedding for both sides and the softmax.

  `__call__(inputs [b, m], decoder_inputs [b, n])` -> logits [b, n, vocab].
  Packed rows (data.pack) also pass `inputs_segmentation`,
  `targets_segmentation` (int [b, m], [b, n]; 0 = padding) and
  `inputs_positions`, `targets_positions` (each token's position in its own
  example): attention stays inside a segment (cross-attention: the decoder
  segment's own source), absolute positions restart per segment, and the
  relative variants need nothing more (within a segment, distances between
  row indices are the examples' own).
  """
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name='embed',
                       **embed_kwargs(cfg))
    self.encoder = Encoder(cfg, self.embed, name='encoder')
    self.decoder = Decoder(cfg, self.embed, cfg.num_decoder_layers, name='decoder')

  def encode(self, inputs, *, deterministic=True, inputs_segmentation=None,
             inputs_positions=None):
    """inputs [b, m] -> [b, m, d_model]."""
    return self.encoder(inputs, mask=padding_mask(inputs, segmentation=inputs_segmentation),
                        positions=inputs_positions, deterministic=deterministic)

  def decode(self, encoded, inputs, decoder_inputs, *, deterministic=True,
             inputs_segmentation=None, targets_segmentation=None, targets_positions=None):
    """encoded [b, m, d], inputs [b, m], decoder_inputs [b, n] -> logits [b, n, V].

    When `cfg.decode`, decoder_inputs are the next tokens after the cache
    (n >= 1); the cache supplies the causal mask.
    """
    if self.cfg.decode:
      self_mask = None
      queries_valid = None
    else:
      self_mask = padding_mask(decoder_inputs, causal=True, segmentation=targets_segmentation)
      queries_valid = decoder_inputs > PAD_ID
    cross_mask = masks.key_padding(inputs > PAD_ID)
    if queries_valid is not None:
      cross_mask = cross_mask & masks.query_padding(queries_valid)
    if targets_segmentation is not None:
      cross_mask = cross_mask & masks.segments(targets_segmentation, inputs_segmentation)
    return self.decoder(decoder_inputs, encoded, self_mask=self_mask,
                        cross_mask=cross_mask, positions=targets_positions,
                        deterministic=deterministic)

  def __call__(self, inputs, decoder_inputs, *, deterministic=True, inputs_segmentation=None,
               targets_segmentation=None, inputs_positions=None, targets_positions=None):
    encoded = self.encode(inputs, deterministic=deterministic,
                          inputs_segmentation=inputs_segmentation,
                          inputs_positions=inputs_positions)
    return self.decode(encoded, inputs, decoder_inputs, deterministic=deterministic,
                       inputs_segmentation=inputs_segmentation,
                       targets_segmentation=targets_segmentation,
                       targets_positions=targets_positions)


class DecoderOnly(nn.Module):
  """Causal language model. `__call__(ids [b, n])` -> logits [b, n, vocab].
  `mask`: a rule of positions in place of the causal one (model.mask:
  prefix-LM), padding kept; None: causal."""
  cfg: TransformerConfig
  mask: masks.Mask | None = None

  def setup(self):
    cfg = self.cfg
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name='embed',
                       **embed_kwargs(cfg))
    self.decoder = Decoder(cfg, self.embed, cfg.num_decoder_layers, name='decoder')

  def __call__(self, ids, *, deterministic=True):
    if self.cfg.decode:  # the cache adds: only the keys written so far
      self_mask = self.mask
    elif self.mask is None:
      self_mask = padding_mask(ids, causal=True)
    else:
      self_mask = padding_mask(ids) & self.mask
    return self.decoder(ids, self_mask=self_mask, deterministic=deterministic)


class EncoderOnly(nn.Module):
  """BERT-style encoder with a masked-LM head (Devlin et al. 2019).

  `__call__(ids [b, n])` -> logits [b, n, vocab]: bidirectional self-attention
  over the non-PAD tokens (cfg.num_encoder_layers), then the MLM head
  Dense(d_model) -> activation -> LayerNorm -> the embedding table transposed
  (tied, as in BERT) + a learned bias [vocab]. Logits at PAD positions are
  meaningless; the loss weights them 0. Masking: data/masking.py.
  """
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name='embed',
                       **embed_kwargs(cfg))
    self.encoder = Encoder(cfg, self.embed, name='encoder')
    self.mlm_dense = nn.Dense(cfg.d_model, dtype=cfg.dtype, use_bias=cfg.use_bias,
                              name='mlm_dense')
    self.mlm_norm = nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, name='mlm_norm')
    self.mlm_bias = self.param('mlm_bias', nn.initializers.zeros, (cfg.vocab_size,))

  def encode(self, ids, *, deterministic=True):
    """ids [b, n] -> final hidden states [b, n, d_model] (before the MLM head)."""
    return self.encoder(ids, mask=padding_mask(ids), deterministic=deterministic)

  def __call__(self, ids, *, deterministic=True):
    h = self.encode(ids, deterministic=deterministic)  # [b, n, d]
    h = self.mlm_norm(ACTIVATIONS[self.cfg.activation](self.mlm_dense(h)))
    return self.embed.attend(h).astype(jnp.float32) + self.mlm_bias  # [b, n, V]


class TwoStream(nn.Module):
  """Two token streams fused (layers/fusion.py), then classified.

  `__call__(inputs [b, n_a], inputs_b [b, n_b])` -> logits [b, num_classes].
  Each stream has its own token table and positions (0..n_i-1); PAD tokens
  neither attend nor are attended to. The classifier reads the mean of each
  stream's final states over its real tokens, the two concatenated: the same
  head for every fusion mode, so with fusion_layer = num_encoder_layers the
  streams meet there only (late fusion at the head).
  """
  cfg: TransformerConfig
  fusion: str = 'bottleneck'
  fusion_layer: int = 0
  num_bottleneck: int = 4
  num_classes: int = 2

  @nn.compact
  def __call__(self, inputs, inputs_b, *, deterministic=True):
    cfg = self.cfg
    valid = [inputs > PAD_ID, inputs_b > PAD_ID]
    x = [embed_tokens(cfg, Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                                  name=f'embed_{s}', **embed_kwargs(cfg)),
                       ids, deterministic, f'positions_{s}')
         for s, ids in zip('ab', (inputs, inputs_b))]
    y_a, y_b, _ = TwoStreamEncoder(cfg, self.fusion, self.num_bottleneck, self.fusion_layer,
                                   name='encoder')(x[0], x[1], valid_a=valid[0],
                                                   valid_b=valid[1], deterministic=deterministic)
    pooled = [jnp.sum(y * v[..., None], axis=1) / jnp.maximum(v.sum(axis=1), 1)[:, None]
              for y, v in zip((y_a, y_b), valid)]
    return nn.Dense(self.num_classes, dtype=cfg.dtype, name='classifier')(
        jnp.concatenate(pooled, axis=-1)).astype(jnp.float32)


class RNNSeq2Seq(nn.Module):
  """Bidirectional RNN encoder, attentional RNN decoder with input feeding
  (layers/rnn.py), one embedding for both sides. The interface is
  EncoderDecoder's: `__call__(inputs [b, m], decoder_inputs [b, n])` ->
  logits [b, n, vocab]; `encode`; `decode` (with `cfg.decode`, the decoder's
  carry lives in the 'cache' collection).
  """
  cfg: RNNConfig

  def setup(self):
    cfg = self.cfg
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name='embed')
    self.encoder = RNNEncoder(cfg, self.embed, name='encoder')
    self.decoder = RNNDecoder(cfg, self.embed, name='decoder')

  def encode(self, inputs, *, deterministic=True):
    """inputs [b, m] -> [b, m, d_model] (zeros at PAD)."""
    return self.encoder(inputs, valid=inputs > PAD_ID, deterministic=deterministic)

  def decode(self, encoded, inputs, decoder_inputs, *, deterministic=True):
    """encoded [b, m, d], inputs [b, m], decoder_inputs [b, n] -> logits [b, n, V]."""
    return self.decoder(decoder_inputs, encoded, valid=inputs > PAD_ID,
                        deterministic=deterministic)

  def __call__(self, inputs, decoder_inputs, *, deterministic=True):
    encoded = self.encode(inputs, deterministic=deterministic)
    return self.decode(encoded, inputs, decoder_inputs, deterministic=deterministic)


def _attention_kwargs(model_config) -> tuple:
  kwargs = model_config['attention_kwargs']
  kwargs = dict(kwargs.items()) if kwargs is not None else {}
  return tuple(sorted((k, v) for k, v in kwargs.items() if v is not None))


def _layer_config_fields(model_config: Mapping[str, Any], decode: bool) -> dict:
  """config.model -> the fields of LayerConfig (layers/config.py)."""
  c = model_config
  return dict(
      vocab_size=c['vocab_size'], d_model=c['d_model'], num_heads=c['num_heads'],
      num_kv_heads=c.get('num_kv_heads', 0),
      num_encoder_layers=c['num_encoder_layers'],
      num_decoder_layers=c['num_decoder_layers'], dropout_rate=c['dropout_rate'],
      attention_dropout_rate=c['attention_dropout_rate'], attention=c['attention'],
      attention_kwargs=_attention_kwargs(c), dtype=compute_dtype(c['dtype']), decode=decode)


def transformer_config(model_config: Mapping[str, Any], *, decode=False,
                       sow_weights=False) -> TransformerConfig:
  """config.model (ConfigDict or dict) -> TransformerConfig."""
  c = model_config
  return TransformerConfig(
      **_layer_config_fields(c, decode), mlp_dim=c['mlp_dim'], positions=c['positions'],
      max_len=c['max_len'], pre_ln=c['pre_ln'], activation=c['activation'],
      sow_weights=sow_weights, init=c.get('init', 'default'), remat=c.get('remat', 'none'),
      randomized_positions=c.get('randomized_positions', 0),
      norm=c.get('norm', 'layernorm'), norm_eps=c.get('norm_eps', 1e-6),
      use_bias=c.get('use_bias', True), tie_embeddings=c.get('tie_embeddings', True),
      embed_scale=c.get('embed_scale', 0.0), token_types=c.get('token_types', 0),
      embed_norm=c.get('embed_norm', False), scan_layers=c.get('scan_layers', False))


def rnn_config(model_config: Mapping[str, Any], *, decode=False) -> RNNConfig:
  """config.model (ConfigDict or dict) -> RNNConfig. Transformer-only keys
  (mlp_dim, positions, max_len, pre_ln, activation) are not used."""
  c = model_config
  return RNNConfig(**_layer_config_fields(c, decode), cell=c['rnn_cell'],
                   input_feeding=c['rnn_input_feeding'])


def build(model_config: Mapping[str, Any], *, decode: bool = False,
          sow_weights: bool = False) -> nn.Module:
  """config.model -> EncoderDecoder | DecoderOnly | EncoderOnly | TwoStream |
  RNNSeq2Seq (set by `model_config.type`).

  `decode=True` builds the same parameters with decoding caches.
  `sow_weights=True`: every Transformer attention layer stores its weights
  [b, h, n, m] as 'attention_weights' in 'intermediates' (plot_attention.py;
  the RNN decoder always does).
  """
  model_type = model_config['type']
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model.type={model_type!r}; valid: {', '.join(MODEL_TYPES)}")
  if model_type == 'rnn_seq2seq':
    return RNNSeq2Seq(rnn_config(model_config, decode=decode))
  cfg = transformer_config(model_config, decode=decode, sow_weights=sow_weights)
  if model_type == 'encoder_only':
    return EncoderOnly(cfg)
  if model_type == 'two_stream':
    return TwoStream(cfg, model_config['fusion'], model_config['fusion_layer'],
                     model_config['fusion_bottlenecks'], model_config['num_classes'])
  if model_type == 'encoder_decoder':
    return EncoderDecoder(cfg)
  return DecoderOnly(cfg, model_mask(model_config))


def model_mask(model_config) -> masks.Mask | None:
  """The registered mask config.model names (masks.NAMED), or None: the
  model's own rule."""
  return masks.named(model_config.get('mask', 'none'), model_config.get('mask_kwargs'))


def _validate_mask(m) -> None:
  name = m.get('mask', 'none')
  try:
    model_mask(m)
  except ValueError as e:
    raise ConfigError(f'model.{e}') from None
  if name != 'none':
    models = masks.NAMED[name].models
    check(m.type in models, f'model.mask={name!r} applies to model.type in {list(models)}; '
          f'model.type={m.type!r}. Use model.mask=\'none\' or one of those types')


def validate(model_config) -> None:
  """config.model's rules, before anything is built: raises ConfigError
  naming the bad value and what would be valid."""
  m = model_config
  check_choice('model.type', m.type, tuple(MODEL_TYPES))
  check_choice('model.attention', m.attention, registry.names())
  variant = registry.get(m.attention)
  check(m.type in variant.models,
        f'model.attention={m.attention!r} cannot be used in model.type={m.type!r}; '
        f'it works in: {", ".join(variant.models)}')
  try:
    registry.resolve_kwargs(m.attention, m.attention_kwargs)
  except ValueError as e:
    raise ConfigError(f'model.{e}') from None
  _validate_mask(m)
  for key in ('d_model', 'num_heads', 'mlp_dim', 'max_len'):
    check(m[key] > 0, f'model.{key}={m[key]} must be > 0')
  for key in ('num_encoder_layers', 'num_decoder_layers'):
    check(m[key] >= 0, f'model.{key}={m[key]} must be >= 0')
  check(m.d_model % m.num_heads == 0,
        f'model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}; '
        f'valid num_heads: {[h for h in range(1, m.d_model + 1) if m.d_model % h == 0]}')
  kv_valid = [g for g in range(1, m.num_heads + 1) if m.num_heads % g == 0]
  check(m.num_kv_heads == 0 or m.num_kv_heads in kv_valid,
        f'model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}; '
        f'valid: 0 (= num_heads) or {kv_valid}')
  if variant.check_head_dim is not None:
    try:
      variant.check_head_dim(m.d_model // m.num_heads)
    except ValueError as e:
      raise ConfigError(f'model.attention={m.attention!r}: {e} (the head size is '
                        f'model.d_model/model.num_heads)') from None
  check_choice('model.positions', m.positions, POSITIONS)
  randomized = m.get('randomized_positions', 0)
  check(isinstance(randomized, int) and randomized >= 0,
        f'model.randomized_positions={randomized!r} must be an int >= 0 (0: off; L > 0: '
        'positions drawn from 0..L-1 in training)')
  if randomized:
    check(m.type != 'rnn_seq2seq', 'model.randomized_positions is for Transformer models; '
          'model.type=rnn_seq2seq has no positions')
    check(m.positions != 'learned' or randomized <= m.max_len,
          f'model.randomized_positions={randomized} > model.max_len={m.max_len}: learned '
          'positions have a row for 0..max_len-1 only; raise model.max_len or lower L')
    check(not variant.uses_positions or variant.position_arrays,
          f'model.randomized_positions with model.attention={m.attention!r}: it reads '
          f'positions as a range only; valid: {", ".join(registry.position_array_names())} '
          'or a variant that reads no positions')
  check(m.positions != 'sinusoidal' or m.d_model % 2 == 0,
        f'sinusoidal positions need an even model.d_model, got {m.d_model}')
  check_choice('model.activation', m.activation, tuple(ACTIVATIONS))
  check_choice('model.norm', m.norm, NORMS)
  check(m.norm_eps > 0, f'model.norm_eps={m.norm_eps} must be > 0')
  check(m.embed_scale >= 0, f'model.embed_scale={m.embed_scale} must be >= 0 (0: by model.init)')
  check(m.token_types >= 0, f'model.token_types={m.token_types} must be >= 0 (0: none)')
  check(m.tie_embeddings or m.type != 'encoder_only',
        'model.tie_embeddings=False: model.type=encoder_only ties its MLM head to the token '
        'table (BERT); use model.tie_embeddings=True')
  check_choice('model.init', m.init, INITS)
  check_choice('model.remat', m.remat, tuple(REMAT))
  check(m.remat == 'none' or m.type != 'rnn_seq2seq',
        f'model.remat={m.remat!r} rematerialises Transformer blocks; model.type=rnn_seq2seq '
        f"has none (use model.remat='none')")
  scan_layers = m.get('scan_layers', False)
  check(isinstance(scan_layers, bool), f'model.scan_layers={scan_layers!r} must be True or False')
  check(not scan_layers or m.type in SCANNABLE_TYPES,
        f'model.scan_layers=True with model.type={m.type!r}: '
        + ('its layers are not one repeated block (per-stream, then fused layers); '
           if m.type == 'two_stream' else 'it has no Transformer stack; ')
        + f'valid types: {", ".join(SCANNABLE_TYPES)} (or model.scan_layers=False)')
  check_choice('model.dtype', m.dtype, tuple(DTYPES))
  for key in ('dropout_rate', 'attention_dropout_rate'):
    check(0.0 <= m[key] < 1.0, f'model.{key}={m[key]} must be in [0, 1)')
  check_choice('model.rnn_cell', m.rnn_cell, tuple(CELLS))
  if m.type == 'two_stream':
    _validate_two_stream(m)
  if m.type == 'rnn_seq2seq':
    check(m.d_model % 2 == 0,
          f'model.type=rnn_seq2seq splits model.d_model={m.d_model} over the two '
          f'directions of its bidirectional encoder; use an even d_model')
    for key in ('num_encoder_layers', 'num_decoder_layers'):
      check(m[key] >= 1, f'model.{key}={m[key]} must be >= 1 for model.type=rnn_seq2seq')


def _validate_two_stream(m) -> None:
  check_choice('model.fusion', m.fusion, FUSIONS)
  layers = m.num_encoder_layers
  check(layers >= 1, f'model.num_encoder_layers={layers} must be >= 1 for model.type=two_stream')
  check(0 <= m.fusion_layer <= layers,
        f'model.fusion_layer={m.fusion_layer} is beyond the model\'s layers: valid 0..{layers} '
        f'(model.num_encoder_layers={layers}; {layers} = the streams meet in the classifier only)')
  check(m.fusion != 'early' or m.fusion_layer == 0,
        f"model.fusion='early' fuses from the first layer; model.fusion_layer={m.fusion_layer} "
        "is for 'late' or 'bottleneck' (or set it to 0)")
  check(m.fusion != 'bottleneck' or m.fusion_bottlenecks >= 1,
        f"model.fusion='bottleneck' with model.fusion_bottlenecks={m.fusion_bottlenecks}: the "
        'streams would exchange nothing; use >= 1 (or fusion_layer = num_encoder_layers to '
        'fuse in the classifier only)')
  check(m.num_classes >= 0, f'model.num_classes={m.num_classes} must be >= 0 (0: the data\'s)')
  for key in ('randomized_positions', 'token_types', 'embed_norm'):
    check(not m[key], f'model.{key}={m[key]!r} is not implemented for model.type=two_stream; '
          'leave it off')


def attention_kernels(seen: list) -> list[str]:
  """What entry.recording noted while the model's programs were traced, one
  line per distinct call: 'alibi on dense (auto: cpu, scores 8 MiB <= 256),
  q [8, 64, 4, 16] against k [8, 64, 4, 16]'."""
  lines = []
  for c in seen:
    line = (f'{c.scheme} on {c.kernel} ({c.why}), q {list(c.query_shape)} against k '
            f'{list(c.key_shape)}')
    if line not in lines:
      lines.append(line)
  return lines


recording_attention = entry.recording
