"""SmolLM2-135M-Instruct fine-tuned on Tiny Shakespeare, with its own tokenizer.

  ./launch.sh experiments/smollm2_shakespeare.py

The model is HuggingFaceTB's SmolLM2-135M-Instruct as the GGUF file
SmolLM2-135M-Instruct.Q4_1.gguf (4-bit weights, dequantised to float32 on
load; Llama architecture, 30 layers, d 576, 9 heads with 3 key/value heads,
RoPE), fetched into ~/.cache/flaxformer_lite/models/smollm2 on first use
(`model.init_from='smollm2'`; ./launch.sh fetch smollm2 does it alone). The
text is tokenized with the model's own BPE vocabulary (data.tokenizer
'pretrained'); a window is 128 tokens. The run evaluates the model as
fetched (step 0: perplexity on the first 64 validation windows and a greedy
sample of the text's continuation; eval.at_start), trains 40 steps of 8
windows, and evaluates the same way at step 40. The layers run under nn.scan
(model.scan_layers): one layer to compile, not 30.
Expected (2 CPU cores, benchmarks/RESULTS.md): validation perplexity 59.07 as
fetched, 32.29 after the 40 steps; 11m42s, peak RSS 5.8 GiB.
"""
from flaxformer_lite import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.model.init_from = 'smollm2'
  config.model.type = 'decoder_only'  # as the checkpoint's architecture says (its sizes too)
  config.model.scan_layers = True
  config.model.dropout_rate = 0.0

  config.data.task = 'tiny_shakespeare'
  config.data.tokenizer = 'pretrained'
  config.data.max_len = 128  # tokens of context

  config.train.num_steps = 40
  config.train.batch_size = 8
  config.train.schedule = 'constant'
  config.train.learning_rate = 5e-5
  config.train.warmup_steps = 5
  config.train.weight_decay = 0.0
  config.train.grad_clip = 1.0
  config.train.label_smoothing = 0.0
  config.train.log_every = 10
  config.train.eval_every = 40
  config.train.checkpoint_every = 40
  config.train.keep_checkpoints = 1

  config.eval.batch_size = 8
  config.eval.max_examples = 64  # validation windows: 8,192 tokens
  config.eval.num_examples_to_log = 1
  config.eval.at_start = True
  config.eval.sample_prompt = 64
  config.eval.sample_len = 48
  config.eval.final_test = False
  return config
