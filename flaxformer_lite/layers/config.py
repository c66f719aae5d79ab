"""LayerConfig: the fields every model family's layer config shares
(TransformerConfig in layers/transformer.py, RNNConfig in layers/rnn.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerConfig:
  """Sizes, attention and dtype of an encoder-decoder model (built by
  `models.build`). The defaults are config.py's."""
  vocab_size: int
  d_model: int = 128
  num_heads: int = 4
  num_kv_heads: int = 0  # key/value heads; 0: num_heads
  num_encoder_layers: int = 2
  num_decoder_layers: int = 2
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  attention: str = 'dot_product'
  attention_kwargs: Mapping[str, Any] | None = None
  dtype: Any = jnp.float32
  decode: bool = False
