"""Transformer blocks (Vaswani et al. 2017): FFN, encoder and decoder stacks.

Pre-LN (default; LN before each sublayer, one final LN per stack) or post-LN
(the 2017 paper: LN after each residual sum). Activations are [b, n, d_model].

A stack's blocks are unrolled (`layer_0` .. `layer_{L-1}`), or with
cfg.scan_layers one block under `nn.scan` (`layers`, each parameter with a
leading axis of size L; layers/scan.py converts between the two), so that
XLA compiles one block however deep the stack is.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.layers.attention import MultiHeadAttention
from flaxformer_lite.layers.config import LayerConfig
from flaxformer_lite.layers.embeddings import AddPositions, Embed
from flaxformer_lite.layers.scan import SCANNED

# 'gelu' is the tanh approximation (GPT-2, T5 v1.1's gated form); 'gelu_exact'
# the erf form (BERT). The gated MLPs (Shazeer 2020) multiply act(x W_gate)
# by x W_up before W_down: swiglu (Llama) and geglu.
ACTIVATIONS = {'relu': nn.relu, 'gelu': nn.gelu,
               'gelu_exact': functools.partial(nn.gelu, approximate=False),
               'swiglu': nn.silu, 'geglu': nn.gelu}
GATED = ('swiglu', 'geglu')
NORMS = ('layernorm', 'rmsnorm')


@dataclasses.dataclass(frozen=True)
class TransformerConfig(LayerConfig):
  """Everything the Transformer modules need: LayerConfig's fields and these."""
  mlp_dim: int = 512
  positions: str = 'sinusoidal'
  max_len: int = 512
  pre_ln: bool = True
  activation: str = 'relu'  # ACTIVATIONS; GATED ones add a gate matrix
  norm: str = 'layernorm'  # NORMS: LayerNorm, or RMSNorm (no centring, no bias; Llama)
  norm_eps: float = 1e-6
  use_bias: bool = True  # biases on the attention and MLP projections (Llama: none)
  tie_embeddings: bool = True  # logits from the token table; False: their own matrix
  embed_scale: float = 0.0  # token embeddings times this; 0: by init (sqrt(d) or 1)
  token_types: int = 0  # > 0: BERT's token-type table; every token is of type 0
  embed_norm: bool = False  # a norm over the summed embeddings (BERT)
  sow_weights: bool = False  # attention weights -> 'intermediates' (plots)
  # 'default': flax's lecun_normal kernels, embeddings N(0, 1/d) scaled by
  # sqrt(d) on the way in (Vaswani et al.). 'gpt2': every kernel and
  # embedding N(0, 0.02), residual output projections N(0, 0.02/sqrt(2L)),
  # no embedding scale (GPT-2 / nanoGPT).
  init: str = 'default'
  remat: str = 'none'  # REMAT: what a training block keeps for its backward pass
  # L > 0: training positions are a sorted draw from 0..L-1 (random_positions)
  randomized_positions: int = 0
  # One scanned block per stack (`layers`, parameters [L, ...]) instead of L unrolled ones
  scan_layers: bool = False


INITS = ('default', 'gpt2')
# Rematerialisation per Transformer block (jax.checkpoint): 'block' keeps only
# each block's input and recomputes the rest in the backward pass; 'dots_saveable'
# keeps the matmul outputs and recomputes the cheap elementwise work between them.
REMAT = {'none': None, 'block': jax.checkpoint_policies.nothing_saveable,
         'dots_saveable': jax.checkpoint_policies.dots_saveable}


def _remat(layer_class, cfg: TransformerConfig, deterministic_argnum: int):
  """layer_class, or it under cfg.remat's policy. The cache's decoding is never
  rematerialised. Its call's `deterministic` (at deterministic_argnum, self
  being 0) must then be positional: it is static, a Python bool."""
  if cfg.remat == 'none' or cfg.decode:
    return layer_class
  # Inside a scan the loop already keeps XLA from merging the recomputation
  # with the forward pass (flax's nn.remat docs), so CSE prevention only costs.
  return nn.remat(layer_class, policy=REMAT[cfg.remat], static_argnums=(deterministic_argnum,),
                  prevent_cse=not cfg.scan_layers)


# What a scanned stack keeps per layer, stacked on axis 0: parameters, the
# decoding cache and sown attention weights.
SCANNED_COLLECTIONS = ('params', 'cache', 'intermediates')


def _run_layers(layer_class, cfg: TransformerConfig, num_layers: int, x, *args,
                deterministic_argnum: int):
  """x [b, n, d] through num_layers blocks of layer_class, each called as
  (x, *args): unrolled as layer_0 .. layer_{L-1}, or (cfg.scan_layers) one
  block scanned L times as `layers`, the args (masks, encoded, drawn
  positions, deterministic) broadcast to every step. Dropout and init rngs
  are split per layer. Called inside the parent's compact method."""
  layer = _remat(layer_class, cfg, deterministic_argnum)
  if not cfg.scan_layers or not num_layers:
    for i in range(num_layers):
      x = layer(cfg, name=f'layer_{i}')(x, *args)
    return x
  stack = nn.scan(layer, variable_axes={c: 0 for c in SCANNED_COLLECTIONS},
                  split_rngs={'params': True, 'dropout': True},
                  in_axes=(nn.broadcast,) * len(args), length=num_layers,
                  metadata_params={nn.PARTITION_NAME: SCANNED})
  x, _ = stack(cfg, scanned=True, name=SCANNED)(x, *args)
  return x


def kernel_inits(cfg: TransformerConfig, num_layers: int) -> dict:
  """{'kernel_init', 'out_kernel_init'} for a stack of num_layers blocks."""
  if cfg.init == 'gpt2':
    return {'kernel_init': nn.initializers.normal(0.02),
            'out_kernel_init': nn.initializers.normal(0.02 / (2 * max(num_layers, 1)) ** 0.5)}
  return {'kernel_init': nn.initializers.lecun_normal(), 'out_kernel_init': None}


def embed_kwargs(cfg: TransformerConfig) -> dict:
  """Embed's stddev and input scaling for cfg.init (cfg.embed_scale > 0 overrides it)."""
  kwargs = {'stddev': 0.02, 'scale': False} if cfg.init == 'gpt2' else {}
  return {**kwargs, 'multiplier': cfg.embed_scale} if cfg.embed_scale else kwargs


def norm(cfg: TransformerConfig, name: str) -> nn.Module:
  """cfg.norm's layer: LayerNorm (x - mean) / sqrt(var + eps) * scale + bias,
  or RMSNorm x / sqrt(mean(x^2) + eps) * scale."""
  if cfg.norm == 'rmsnorm':
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, name=name)
  return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, name=name)


class MlpBlock(nn.Module):
  """d_model -> mlp_dim -> activation -> dropout -> d_model; a GATED
  activation computes act(x W_gate) * (x W_up) (wi_gate, wi) in between."""
  mlp_dim: int
  activation: str = 'relu'
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()
  out_kernel_init: Any = None  # None: kernel_init
  use_bias: bool = True

  @nn.compact
  def __call__(self, x, *, deterministic=True):
    d = x.shape[-1]
    # Logical axes (train/partitioning.py): a model axis shards the hidden units.
    def up(name):
      return nn.Dense(self.mlp_dim, dtype=self.dtype, name=name, use_bias=self.use_bias,
                      kernel_init=nn.with_logical_partitioning(self.kernel_init,
                                                               ('embed', 'mlp')),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('mlp',)))
    h = up('wi')(x)
    if self.activation in GATED:
      h = ACTIVATIONS[self.activation](up('wi_gate')(x)) * h
    else:
      h = ACTIVATIONS[self.activation](h)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return nn.Dense(d, dtype=self.dtype, name='wo', use_bias=self.use_bias,
                    kernel_init=nn.with_logical_partitioning(
                        self.out_kernel_init or self.kernel_init, ('mlp', 'embed')),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)))(h)


class _Residual(nn.Module):
  """x + dropout(sublayer(LN(x))) (pre-LN) or LN(x + dropout(sublayer(x)))."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, sublayer, *, deterministic):
    cfg = self.cfg
    layer_norm = norm(cfg, 'norm')
    y = sublayer(layer_norm(x) if cfg.pre_ln else x)
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    return x + y if cfg.pre_ln else layer_norm(x + y)


def _attention(cfg: TransformerConfig, name: str, num_layers: int, decode: bool = False,
               cross: bool = False):
  """Self-attention uses the configured variant. Cross-attention does too,
  unless the variant is about positions: decoder and encoder positions are
  not on one axis, so relative schemes there fall back to dot_product (on
  the configured kernel, or 'auto' where that kernel is written for the
  configured scheme alone)."""
  attention, kwargs = cfg.attention, cfg.attention_kwargs
  if cross and registry.get(attention).uses_positions:
    kernel = {k: v for k, v in dict(kwargs or {}).items()
              if k in registry.KERNEL_OPTIONS and v is not None}
    if not registry.runs_on('dot_product', kernel.get('kernel', 'auto')):
      del kernel['kernel']
    attention, kwargs = 'dot_product', kernel or None
  return MultiHeadAttention(
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads or None, attention=attention,
      attention_kwargs=kwargs,
      dropout_rate=cfg.attention_dropout_rate, dtype=cfg.dtype, decode=decode,
      sow_weights=cfg.sow_weights, use_bias=cfg.use_bias, name=name,
      **kernel_inits(cfg, num_layers))


def _mlp(cfg: TransformerConfig, num_layers: int):
  return MlpBlock(cfg.mlp_dim, cfg.activation, cfg.dropout_rate, cfg.dtype, name='mlp',
                  use_bias=cfg.use_bias, **kernel_inits(cfg, num_layers))


def random_positions(module: nn.Module, cfg: TransformerConfig, length: int,
                     deterministic: bool):
  """Randomized positions (Ruoss et al. 2023): in training with
  cfg.randomized_positions = L > 0, a sorted draw of `length` distinct
  positions from 0..L-1, one per batch (from the 'dropout' stream); else
  None (0..n-1)."""
  if not cfg.randomized_positions or deterministic or cfg.decode:
    return None
  if length > cfg.randomized_positions:
    raise ValueError(f'a sequence of {length} tokens does not fit in randomized positions '
                     f'0..{cfg.randomized_positions - 1} (model.randomized_positions); '
                     f'set it to at least {length}')
  key = module.make_rng('dropout')
  return jnp.sort(jax.random.choice(key, cfg.randomized_positions, (length,), replace=False))


class EncoderLayer(nn.Module):
  """Self-attention, FFN: x [b, n, d] -> [b, n, d] (scanned: (it, None), the
  carry and no per-layer output of nn.scan)."""
  cfg: TransformerConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, mask=None, deterministic=True, positions=None):
    cfg = self.cfg
    attn = _attention(cfg, 'self_attention', cfg.num_encoder_layers)
    x = _Residual(cfg, name='attention_block')(
        x, lambda y: attn(y, mask=mask, deterministic=deterministic, positions=positions),
        deterministic=deterministic)
    mlp = _mlp(cfg, cfg.num_encoder_layers)
    x = _Residual(cfg, name='mlp_block')(
        x, lambda y: mlp(y, deterministic=deterministic), deterministic=deterministic)
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Causal self-attention (cached when decoding), cross-attention, FFN.

  `encoded=None` drops the cross-attention (decoder-only LM). Scanned: returns
  (x, None), as EncoderLayer.
  """
  cfg: TransformerConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, encoded=None, self_mask=None, cross_mask=None,
               deterministic=True, positions=None):
    cfg = self.cfg
    layers = cfg.num_decoder_layers
    self_attn = _attention(cfg, 'self_attention', layers, decode=cfg.decode)
    x = _Residual(cfg, name='self_attention_block')(
        x, lambda y: self_attn(y, mask=self_mask, deterministic=deterministic,
                               positions=positions),
        deterministic=deterministic)
    if encoded is not None:
      cross_attn = _attention(cfg, 'cross_attention', layers, cross=True)
      x = _Residual(cfg, name='cross_attention_block')(
          x, lambda y: cross_attn(y, encoded, mask=cross_mask,
                                  deterministic=deterministic),
          deterministic=deterministic)
    mlp = _mlp(cfg, layers)
    x = _Residual(cfg, name='mlp_block')(
        x, lambda y: mlp(y, deterministic=deterministic), deterministic=deterministic)
    return (x, None) if self.scanned else x


def embed_tokens(cfg, embed, ids, deterministic, name, decode=False, positions=None):
  """Tokens + positions (+ the type-0 row of cfg.token_types' table) (->
  norm with cfg.embed_norm) -> dropout: [b, n, d_model]."""
  x = embed(ids)
  x = AddPositions(cfg.positions, cfg.max_len, decode=decode, name=name)(x, positions)
  if cfg.token_types:
    table = nn.Embed(cfg.token_types, cfg.d_model, dtype=cfg.dtype, name='token_types',
                     embedding_init=nn.initializers.normal(0.02))
    x = x + table(jnp.zeros((1, 1), jnp.int32))
  if cfg.embed_norm:
    x = norm(cfg, 'embed_norm')(x)
  return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


class Encoder(nn.Module):
  """ids [b, n] -> [b, n, d_model]; positions [b, n]: each token's own
  (packed rows), default 0..n-1.

  Parameters: `layer_0` .. `layer_{L-1}` (L = cfg.num_encoder_layers), or
  with cfg.scan_layers one `layers` subtree of the same names whose every
  leaf is the L layers' leaves stacked on a new axis 0 ([L, ...]; logical
  axis 'layers'); then `final_norm` (pre-LN).
  """
  cfg: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(self, ids, *, mask, positions=None, deterministic=True):
    cfg = self.cfg
    drawn = random_positions(self, cfg, ids.shape[1], deterministic)
    x = embed_tokens(cfg, self.embed, ids, deterministic, 'positions',
                      positions=positions if drawn is None else drawn)
    x = _run_layers(EncoderLayer, cfg, cfg.num_encoder_layers, x, mask, deterministic, drawn,
                    deterministic_argnum=3)
    return norm(cfg, 'final_norm')(x) if cfg.pre_ln else x


class Decoder(nn.Module):
  """ids [b, n] (and encoded [b, m, d_model]) -> logits [b, n, vocab].

  Parameters: `layer_0` .. `layer_{L-1}` (L = num_layers), or with
  cfg.scan_layers one `layers` subtree whose leaves are theirs stacked on
  axis 0 ([L, ...]; logical axis 'layers'), as Encoder's. Decoding's cache
  is stacked alike: `layers/self_attention/cached_key` [L, b, max_len, g, d],
  `cache_index` [L].
  """
  cfg: TransformerConfig
  embed: Embed
  num_layers: int

  @nn.compact
  def __call__(self, ids, encoded=None, *, self_mask, cross_mask=None, positions=None,
               deterministic=True):
    cfg = self.cfg
    drawn = random_positions(self, cfg, ids.shape[1], deterministic)
    x = embed_tokens(cfg, self.embed, ids, deterministic, 'positions',
                      decode=cfg.decode, positions=positions if drawn is None else drawn)
    x = _run_layers(DecoderLayer, cfg, self.num_layers, x, encoded, self_mask, cross_mask,
                    deterministic, drawn, deterministic_argnum=5)
    if cfg.pre_ln:
      x = norm(cfg, 'final_norm')(x)
    if not cfg.tie_embeddings:
      return nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, name='logits',
                      kernel_init=nn.initializers.normal(cfg.d_model ** -0.5))(
                          x).astype(jnp.float32)
    # The paper multiplies the embedding by sqrt(d) on the way in; tied logits
    # use the raw table, as in T5/flax WMT.
    return self.embed.attend(x).astype(jnp.float32)
