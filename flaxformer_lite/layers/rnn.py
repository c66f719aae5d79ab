"""RNN sequence-to-sequence layers: a bidirectional encoder and an attentional
decoder with input feeding (Luong et al. 2015, "Effective Approaches to
Attention-based Neural Machine Translation").

Encoder: `num_encoder_layers` bidirectional LSTM/GRU layers. Each direction
has d_model/2 units, so the outputs (forward and backward states
concatenated) are [b, m, d_model] and attention needs no extra projection.
Each direction reads the valid tokens only (`seq_lengths`; padding sits at
the end); outputs at PAD positions are zeros.

Decoder, step t = 0, 1, ... (all sizes d_model):
  x_t      = [embed(y_{t-1}); htilde_{t-1}]     input feeding (htilde_{-1} = 0)
  s_t      = stacked RNN cells(x_t)               dropout between layers
  c_t, a_t = MultiHeadAttention(query s_t, keys/values = encoder outputs,
                                q_offset=t, prev_alignment=sum_{u<t} a_u)
  htilde_t = dropout(tanh(W_c [c_t; s_t]))
  logits_t = W_o htilde_t
Attention is computed after the RNN step, from the new state s_t (Luong's
order; Bahdanau et al. 2014 score s_{t-1} before the step). Every variant
(dot, general, additive, local, location-sensitive...) plugs in as the
scoring function of MultiHeadAttention. The decoder's initial state is a
bridge from the encoder: for every decoder layer and every part of its carry
(LSTM: c and h; GRU: h), tanh(Dense([h_fwd(last valid token); h_bwd(first
token)])) of the top encoder layer, read from the encoder outputs.

Teacher forcing scans the step over the decoder inputs (`nn.scan`). With
`decode=True` the decoder keeps its carry in the 'cache' collection as
'carry' = {'cells', 'htilde' [b, d], 'alignment' [b, h, 1, m], 'step' int32
scalar}; any number of tokens may be fed per call. The pass that creates the
cache (inside `init`) leaves it zero; step 0 starts from the bridge.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.attention import registry
from flaxformer_lite.layers.attention import MultiHeadAttention
from flaxformer_lite.layers.config import LayerConfig
from flaxformer_lite.layers.embeddings import Embed

# OptimizedLSTMCell: LSTMCell's math with the four gates in one matmul.
CELLS = {'lstm': nn.OptimizedLSTMCell, 'gru': nn.GRUCell}


@dataclasses.dataclass(frozen=True)
class RNNConfig(LayerConfig):
  """Everything the RNN modules need: LayerConfig's fields and these."""
  cell: str = 'lstm'
  input_feeding: bool = True


def _cell(cfg: RNNConfig, features: int, name: str | None = None):
  if cfg.cell not in CELLS:
    raise ValueError(f'rnn cell={cfg.cell!r}; valid: {", ".join(CELLS)}')
  return CELLS[cfg.cell](features, dtype=cfg.dtype, param_dtype=jnp.float32, name=name)


def _float32(tree):
  """Carries stay float32 (the scan needs one dtype per step; bf16 sums drift)."""
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


class RNNEncoder(nn.Module):
  """ids [b, m], valid [b, m] bool (True = token) -> [b, m, d_model].

  Valid tokens must come first in each row.
  """
  cfg: RNNConfig
  embed: Embed

  @nn.compact
  def __call__(self, ids, *, valid, deterministic=True):
    cfg = self.cfg
    half = cfg.d_model // 2
    lengths = jnp.sum(valid, axis=-1, dtype=jnp.int32)  # [b]
    x = nn.Dropout(cfg.dropout_rate)(self.embed(ids), deterministic=deterministic)
    for i in range(cfg.num_encoder_layers):
      # The cells are created here, so their parameters sit under this module
      # as layer_{i}_forward / layer_{i}_backward.
      x = nn.Bidirectional(nn.RNN(_cell(cfg, half, f'layer_{i}_forward')),
                           nn.RNN(_cell(cfg, half, f'layer_{i}_backward')))(
                               x, seq_lengths=lengths)  # [b, m, 2 * half]
      x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    return jnp.where(valid[..., None], x, 0).astype(cfg.dtype)


class _DecoderStep(nn.Module):
  """One decoder step: (carry, embedded y_{t-1} [b, d]) -> (carry, (htilde_t
  [b, d], attention weights a_t [b, h, m])). Scanned over time by RNNDecoder."""
  cfg: RNNConfig
  deterministic: bool

  @nn.compact
  def __call__(self, carry, y, encoded, mask):
    cfg = self.cfg
    dropout = nn.Dropout(cfg.dropout_rate)
    x = jnp.concatenate([y, carry['htilde'].astype(y.dtype)], -1) if cfg.input_feeding else y
    cells = []
    for i, cell_carry in enumerate(carry['cells']):
      if i:
        x = dropout(x, deterministic=self.deterministic)
      cell_carry, x = _cell(cfg, cfg.d_model, name=f'cell_{i}')(cell_carry, x)
      cells.append(cell_carry)
    state = x  # s_t [b, d]
    uses_alignment = registry.get(cfg.attention).uses_alignment
    context, weights = MultiHeadAttention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads or None, attention=cfg.attention,
        attention_kwargs=cfg.attention_kwargs,
        dropout_rate=cfg.attention_dropout_rate, dtype=cfg.dtype, name='attention')(
            state[:, None], encoded, mask=mask, deterministic=self.deterministic,
            q_offset=carry['step'],
            prev_alignment=carry['alignment'] if uses_alignment else None,
            return_weights=True)  # [b, 1, d], [b, h, 1, m]
    htilde = nn.Dense(cfg.d_model, dtype=cfg.dtype, name='combine')(
        jnp.concatenate([context[:, 0], state.astype(context.dtype)], -1))
    htilde = dropout(jnp.tanh(htilde), deterministic=self.deterministic)
    carry = {'cells': _float32(tuple(cells)), 'htilde': _float32(htilde),
             'alignment': carry['alignment'] + _float32(weights),
             'step': carry['step'] + 1}
    return carry, (htilde, weights[:, :, 0])


class RNNDecoder(nn.Module):
  """ids [b, n], encoded [b, m, d], valid [b, m] -> logits [b, n, vocab].

  Sows the attention weights [b, h, n, m] as 'attention_weights' in
  'intermediates' (apply with mutable=['intermediates'] to read them).
  """
  cfg: RNNConfig
  embed: Embed

  @nn.compact
  def __call__(self, ids, encoded, *, valid, deterministic=True):
    cfg = self.cfg
    carry = self._initial_carry(encoded, valid)
    if cfg.decode:
      initialized = self.has_variable('cache', 'carry')
      cache = self.variable('cache', 'carry', jax.tree.map, jnp.zeros_like, carry)
      if initialized:
        fresh = cache.value['step'] == 0
        carry = jax.tree.map(lambda new, old: jnp.where(fresh, new, old), carry, cache.value)
    y = nn.Dropout(cfg.dropout_rate)(self.embed(ids), deterministic=deterministic)
    scan = nn.scan(_DecoderStep, variable_broadcast='params',
                   split_rngs={'params': False, 'dropout': True},
                   in_axes=(1, nn.broadcast, nn.broadcast), out_axes=(1, 2))
    mask = valid[:, None, None, :]  # [b, 1, 1, m]
    carry, (htilde, weights) = scan(cfg, deterministic, name='step')(
        carry, y, encoded, mask)  # htilde [b, n, d], weights [b, h, n, m]
    if cfg.decode and initialized:
      cache.value = carry
    self.sow('intermediates', 'attention_weights', weights)
    return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name='logits')(htilde).astype(jnp.float32)

  def _initial_carry(self, encoded, valid):
    """The bridge (module docstring), zero htilde and alignment, step 0."""
    cfg = self.cfg
    b, m, d = encoded.shape
    half = d // 2
    last = jnp.maximum(jnp.sum(valid, axis=-1) - 1, 0)  # [b]
    forward = jnp.take_along_axis(encoded[..., :half], last[:, None, None], axis=1)[:, 0]
    bridge_in = jnp.concatenate([forward, encoded[:, 0, half:]], -1)  # [b, d]

    def bridge(name):
      return jnp.tanh(nn.Dense(cfg.d_model, dtype=cfg.dtype, name=name)(bridge_in))

    cells = tuple(
        (bridge(f'bridge_{i}_c'), bridge(f'bridge_{i}_h')) if cfg.cell == 'lstm'
        else bridge(f'bridge_{i}') for i in range(cfg.num_decoder_layers))
    return {'cells': _float32(cells),
            'htilde': jnp.zeros((b, cfg.d_model), jnp.float32),
            'alignment': jnp.zeros((b, cfg.num_heads, 1, m), jnp.float32),
            'step': jnp.zeros((), jnp.int32)}
