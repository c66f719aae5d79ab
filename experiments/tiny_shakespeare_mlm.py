"""A BERT-style encoder (masked LM) on Tiny Shakespeare characters.

  ./launch.sh experiments/tiny_shakespeare_mlm.py

experiments/tiny_shakespeare_cpu.py's corpus, size, optimiser and budget
(2000 steps of 12 windows of 64 characters) with a 4-layer bidirectional
encoder and BERT's MLM head (dense, GELU, LayerNorm, the tied embedding and
an output bias). In each window 15% of the positions are selected; 80% of
those become [MASK], 10% a random character, 10% stay; the loss is on the
selected positions only. Eval: loss, accuracy and perplexity at the selected
positions, for one fixed draw of masks over every validation window (not
comparable with the causal LM's numbers: the encoder sees both sides, but
only 15% of the characters carry a loss).
Expected: masked-character loss 2.42 (accuracy 0.334, perplexity 11.3) after
2000 steps; 1m46s on 2 CPU cores.
"""
import os
import runpy

_CAUSAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tiny_shakespeare_cpu.py')


def get_config():
  config = runpy.run_path(_CAUSAL)['get_config']()
  config.model.type = 'encoder_only'
  config.model.num_encoder_layers = 4
  config.model.num_decoder_layers = 0  # an encoder alone
  config.data.mlm_rate = 0.15
  return config
