"""Flax linen modules: the parameters around the attention math."""
from flaxformer_lite.layers.attention import MultiHeadAttention
from flaxformer_lite.layers.embeddings import AddPositions, Embed, sinusoidal_positions
from flaxformer_lite.layers.fusion import TwoStreamEncoder
from flaxformer_lite.layers.rnn import RNNConfig, RNNDecoder, RNNEncoder
from flaxformer_lite.layers.transformer import (Decoder, DecoderLayer, Encoder,
                                                EncoderLayer, MlpBlock,
                                                TransformerConfig)

__all__ = ['AddPositions', 'Decoder', 'DecoderLayer', 'Embed', 'Encoder',
           'EncoderLayer', 'MlpBlock', 'MultiHeadAttention', 'RNNConfig',
           'RNNDecoder', 'RNNEncoder', 'TransformerConfig', 'TwoStreamEncoder',
           'sinusoidal_positions']
