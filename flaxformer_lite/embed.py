"""Sentence embeddings from a BERT-family checkpoint, and their similarities:

  ./launch.sh run -m flaxformer_lite.embed [--model=minilm] [--file=TEXTS.txt]
      "A man is eating food." "A man is eating pasta." ...

all-MiniLM-L6-v2 (`--model=minilm`, the default) is a sentence-transformers
model: BERT, then the mean of the last hidden states over the real tokens,
then L2 normalisation. It has no masked-LM head, so its masked-LM logits
(models.EncoderOnly.__call__) mean nothing; this is what it was trained for.
The command prints the embedding dimension and the cosine similarities of the
texts (the arguments, then the lines of --file; `--file=-` reads stdin) as a
table, rows ending with their text.

--model: a name (MODELS; fetched into the cache on first use, as
`./launch.sh fetch` does) or a checkpoint directory of the BERT family
(pretrained.py). Texts longer than the checkpoint's max_seq_length
(sentence_bert_config.json; else its max_position_embeddings) are cut to it,
as sentence-transformers does.

Exit codes: 0 done; 2 bad flag, no texts, or a --model that is not a known
name or a readable BERT-family checkpoint (named, with what is valid).
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging

from flaxformer_lite import compilation, models, pretrained

# The pretrained.MODELS that are sentence encoders (smollm2, a Llama, is not).
MODELS = ('minilm',)
BATCH_SIZE = 64

FLAGS = flags.FlagValues()  # our own registry, as plot_attention.py (main.py's flags differ)
flags.DEFINE_string('model', 'minilm', f'A model name ({", ".join(MODELS)}) or a BERT-family '
                    'checkpoint directory.', flag_values=FLAGS)
flags.DEFINE_string('file', None, 'Texts, one per line (blank lines skipped); - for stdin.',
                    flag_values=FLAGS)


def sentence_embeddings(hidden, mask):
  """hidden [n, t, d] float, mask [n, t] (bool or 0/1: real tokens) -> [n, d]:
  the mean of each row's real tokens, L2-normalised (sentence-transformers'
  Pooling(mean) then Normalize, with their clamps: a row without tokens is
  0, not NaN). Masked-out positions are dropped with `where`, not multiplied
  by 0, so that whatever the model left at PAD positions cannot leak in."""
  mask = jnp.asarray(mask).astype(bool)[..., None]  # [n, t, 1]
  total = jnp.where(mask, hidden, 0.0).sum(axis=1)
  mean = total / jnp.maximum(mask.sum(axis=1), 1e-9)
  return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


def resolve(model: str) -> str:
  """--model (a name of MODELS, or a path) -> the checkpoint's path; a name
  not yet in the cache is fetched."""
  path = pretrained.resolve(model, names=MODELS)
  if not os.path.exists(path):
    raise pretrained.PretrainedError(
        f'{model!r} is neither a known model nor an existing path; valid: '
        f'{", ".join(MODELS)}, or a BERT-family checkpoint directory (config.json + '
        'model.safetensors + tokenizer.json)')
  return path


def load(path: str):
  """(model, params, tokenizer, max_tokens) of a BERT-family checkpoint, for
  `model.encode`. The masked-LM head that a BertModel lacks is never run
  here: zeros, not a compiled initialisation (pretrained.load's `unused`);
  any other parameter the checkpoint lacks is refused."""
  model_type = pretrained.architecture(path)['type']  # before any tensor is read
  if model_type != 'encoder_only':
    raise pretrained.PretrainedError(
        f'{path} is a {model_type} checkpoint; sentence embeddings need a '
        f'BERT-family encoder, e.g. {", ".join(MODELS)}')
  _check_pooling(path)
  model_config, params = pretrained.load(path, unused=('mlm_',), strict=True)
  return (models.build(model_config), params, pretrained.tokenizer(path),
          _max_tokens(path, model_config.max_len))


def _check_pooling(path: str):
  """PretrainedError where the checkpoint's own sentence-transformers
  pooling (modules.json) is not the mean this module computes."""
  try:
    with open(os.path.join(path, 'modules.json')) as f:
      modules = json.load(f)
  except FileNotFoundError:
    return  # a plain BERT: mean pooling is the usual choice
  for module in modules:
    if module['type'].endswith('.Pooling'):
      with open(os.path.join(path, module['path'], 'config.json')) as f:
        pooling = {k for k, v in json.load(f).items() if k.startswith('pooling_mode') and v}
      if pooling != {'pooling_mode_mean_tokens'}:
        raise pretrained.PretrainedError(f'{path} pools with {", ".join(sorted(pooling))}; '
                                         'this module computes pooling_mode_mean_tokens only')


def _max_tokens(path: str, max_len: int) -> int:
  """The longest input, [CLS] and [SEP] included: sentence-transformers'
  max_seq_length where the checkpoint gives one (all-MiniLM-L6-v2: 256,
  what it was trained on), else the model's positions."""
  try:
    with open(os.path.join(path, 'sentence_bert_config.json')) as f:
      return min(max_len, json.load(f).get('max_seq_length') or max_len)
  except FileNotFoundError:
    return max_len


def tokenize(tokenizer, texts, max_tokens: int) -> np.ndarray:
  """texts -> ids [n, t] int32: [CLS] pieces [SEP], cut to max_tokens, padded
  with 0 ([PAD], which the model neither attends to nor pools) to the
  longest."""
  rows = [tokenizer.with_specials(tokenizer.encode(text)[:max_tokens - 2]) for text in texts]
  ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  return ids


def embed(texts, init_from: str, batch_size: int = BATCH_SIZE) -> np.ndarray:
  """texts -> their sentence embeddings [n, d] float32, unit-norm.
  init_from: a name of MODELS or a checkpoint path (resolve). All texts are
  padded to one length and run in batches of one size (the last one filled
  with empty rows), so the encoder compiles once."""
  model, params, tokenizer, max_tokens = load(resolve(init_from))
  ids = tokenize(tokenizer, texts, max_tokens)
  batch = max(1, min(len(ids), batch_size))
  padded = np.pad(ids, ((0, -len(ids) % batch), (0, 0)))

  @jax.jit
  def forward(params, ids):
    hidden = model.apply({'params': params}, ids, method=model.encode)
    return sentence_embeddings(hidden, ids > 0)

  out = [np.asarray(forward(params, padded[i:i + batch])) for i in range(0, len(padded), batch)]
  return np.concatenate(out)[:len(ids)]


def similarity_table(embeddings: np.ndarray, texts) -> str:
  """Cosine similarities (the dot products of unit vectors) as aligned
  rows: a header of column numbers, then each row's number, values and text."""
  sims = embeddings.astype(np.float64) @ embeddings.T.astype(np.float64)
  label = len(str(len(texts) - 1))  # the widest row number
  lines = [' ' * label + ''.join(f'{j:>8}' for j in range(len(texts)))]
  for i, row in enumerate(sims):
    lines.append(f'{i:>{label}}' + ''.join(f'{v:8.4f}' for v in row) + f'  {texts[i]}')
  return '\n'.join(lines)


def read_texts(texts, file: str | None) -> list[str]:
  """The arguments, then the non-blank lines of `file` ('-': stdin)."""
  texts = list(texts)
  if file:
    if file == '-':
      lines = sys.stdin.read().splitlines()
    else:
      try:
        with open(file, encoding='utf-8') as f:
          lines = f.read().splitlines()
      except OSError as e:
        _fail(f'--file={file!r} cannot be read ({e.strerror}); give a text file, one text a line')
    texts += [line.strip() for line in lines if line.strip()]
  if not texts:
    _fail('no texts: give them as arguments ("A man is eating food." ...) or --file=TEXTS.txt')
  return texts


def main(argv):
  absl_logging.set_verbosity(absl_logging.WARNING)
  compilation.set_xla_flags()
  compilation.enable_cache()
  texts = read_texts(argv[1:], FLAGS.file)
  try:
    embeddings = embed(texts, FLAGS.model)
  except pretrained.PretrainedError as e:
    _fail(f'--model: {e}')
  print(f'{FLAGS.model}: {len(texts)} texts, embedding dimension {embeddings.shape[1]} '
        '(mean-pooled, L2-normalised); cosine similarities:')
  print(similarity_table(embeddings, texts))


def _fail(message: str):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  """Parses our FLAGS; what is left are the texts. absl's global FLAGS
  (app.run needs them parsed) get defaults only."""
  flags.FLAGS(argv[:1])
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _fail(f'{e}. Usage: --model=NAME_OR_PATH [--file=TEXTS.txt] "text" ...')


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
