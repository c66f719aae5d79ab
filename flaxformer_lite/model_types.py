"""The model types (config.model.type) and what each one trains on: the one
table that the config checks, the attention registry (which types a variant
fits) and the train step (which objective) read."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelType:
  objective: str  # seq2seq | lm | mlm | classify: the loss (train/steps.py)
  data: str  # seq2seq | lm | two_stream: the kind of data it reads (data/loading.py)
  transformer: bool  # built of Transformer blocks (else the RNN)
  # built of Encoder/Decoder stacks of one repeated block, which model.scan_layers
  # scans (two_stream's per-stream and fused layers are not one block)
  scannable: bool = False


MODEL_TYPES = {
    'encoder_decoder': ModelType(objective='seq2seq', data='seq2seq', transformer=True,
                                 scannable=True),
    'decoder_only': ModelType(objective='lm', data='lm', transformer=True, scannable=True),
    'encoder_only': ModelType(objective='mlm', data='lm', transformer=True, scannable=True),
    'two_stream': ModelType(objective='classify', data='two_stream', transformer=True),
    'rnn_seq2seq': ModelType(objective='seq2seq', data='seq2seq', transformer=False),
}
TRANSFORMER_TYPES = tuple(name for name, t in MODEL_TYPES.items() if t.transformer)
SCANNABLE_TYPES = tuple(name for name, t in MODEL_TYPES.items() if t.scannable)
