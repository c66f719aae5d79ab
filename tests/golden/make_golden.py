"""Golden outputs of the reference implementation, Hugging Face transformers
on PyTorch, for tests/test_pretrained.py: run once, the JSON committed.

  ./launch.sh fetch minilm && ./launch.sh fetch smollm2
  python3 -m venv /tmp/golden && /tmp/golden/bin/pip install -e '.[golden]'
  /tmp/golden/bin/python tests/golden/make_golden.py

Writes tests/golden/minilm.json (BertModel: token ids of a few texts from
the checkpoint's tokenizer, the last hidden state at every real position)
and tests/golden/smollm2.json (LlamaForCausalLM loading the GGUF file,
dequantised to float32: token ids, the logits of a full pass at a fixed
slice of the vocabulary, and greedy decoding with the cache: its tokens and
each step's logits at the same slice). float32 throughout, one thread.
"""
import json
import os

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get('FFL_MODEL_CACHE') or os.path.expanduser('~/.cache/flaxformer_lite/models')
TEXTS = ['The quick brown fox', 'Unaffable, naïve café!', 'First Citizen:\nBefore we proceed '
         'any further, hear me speak. 1234']
VOCAB_SLICE = 997  # every 997th logit, and the first 32


def _slice(logits: np.ndarray) -> list:
  """[..., V] -> the columns 0..31 and every VOCAB_SLICE-th, as nested lists."""
  columns = sorted(set(range(32)) | set(range(0, logits.shape[-1], VOCAB_SLICE)))
  return np.round(logits[..., columns].astype(np.float64), 6).tolist()


def minilm():
  path = os.path.join(CACHE, 'minilm')
  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  model = transformers.BertModel.from_pretrained(path, torch_dtype=torch.float32).eval()
  out = {'texts': TEXTS, 'ids': [], 'hidden': []}
  for text in TEXTS:
    ids = tokenizer(text)['input_ids']
    with torch.no_grad():
      hidden = model(torch.tensor([ids])).last_hidden_state[0].numpy()
    out['ids'].append(ids)
    out['hidden'].append(np.round(hidden.astype(np.float64), 6).tolist())
  return out


def smollm2(steps: int = 8):
  path = os.path.join(CACHE, 'smollm2')
  tokenizer = transformers.AutoTokenizer.from_pretrained(path, gguf_file='model.gguf')
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, gguf_file='model.gguf', torch_dtype=torch.float32).eval()
  out = {'texts': TEXTS, 'ids': [tokenizer(t, add_special_tokens=False)['input_ids']
                                 for t in TEXTS],
         'columns': sorted(set(range(32)) | set(range(0, model.config.vocab_size, VOCAB_SLICE)))}
  prompt = out['ids'][2]
  with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0].numpy()
    out['prompt'] = prompt
    out['logits'] = _slice(logits)
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                               use_cache=True, output_logits=True, return_dict_in_generate=True)
  out['greedy'] = generated.sequences[0, len(prompt):].tolist()
  out['greedy_logits'] = _slice(torch.stack(generated.logits, 1)[0].numpy())
  return out


if __name__ == '__main__':
  torch.set_num_threads(1)
  for name, make in (('minilm', minilm), ('smollm2', smollm2)):
    with open(os.path.join(HERE, f'{name}.json'), 'w') as f:
      json.dump({'reference': f'transformers {transformers.__version__}, torch {torch.__version__}',
                 **make()}, f)
    print(f'wrote {name}.json')
