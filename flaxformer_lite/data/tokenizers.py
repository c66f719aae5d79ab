"""Tokenizers: text <-> int32 ids, with PAD=0, BOS=1, EOS=2 reserved.

Every tokenizer has
  vocab_size: int           largest id + 1;
  encode(text) -> [n] int32 ids >= 3 (never PAD/BOS/EOS), WITHOUT EOS:
                            callers append `end_id(tokenizer)`;
  decode(ids) -> str        ids is 1-D (list, numpy or jax); decoding stops at
                            the first EOS and skips PAD, BOS and ids >= vocab_size
                            (a model's output layer may be padded past the vocab).
Kinds (`create`, by name): 'char' (id = 3 + index in a sorted character set),
'byte' (id = 3 + UTF-8 byte) and 'sentencepiece' (unigram or BPE, unk id 3).
sentencepiece and regex are imported by the tokenizers that use them: the
synthetic tasks need neither.
"""
from __future__ import annotations

import io
import json
import os
import tempfile
from typing import Callable, Iterable, Protocol

import numpy as np

from flaxformer_lite.tokens import BOS_ID, EOS_ID, PAD_ID

FIRST_ID = 3  # the first id of real text; also sentencepiece's unk id
TOKENIZERS = ('sentencepiece', 'char', 'byte', 'pretrained')  # pretrained: model.init_from's
SP_MODEL_TYPES = ('unigram', 'bpe')
MIN_SP_VOCAB_SIZE = 16


class Tokenizer(Protocol):
  vocab_size: int
  def encode(self, text: str) -> np.ndarray: ...
  def decode(self, ids) -> str: ...


def end_id(tokenizer) -> int:
  """The id that ends a text: EOS_ID, or a pretrained vocabulary's own
  (BERT's [SEP], a GGUF file's eos token), as its model was trained to read."""
  return getattr(tokenizer, 'eos_id', EOS_ID)


def _text_ids(ids, vocab_size: int, eos_id: int = EOS_ID) -> np.ndarray:
  """The ids before the first EOS, without PAD, BOS and out-of-vocabulary ids."""
  ids = np.asarray(ids, dtype=np.int64)
  if ids.ndim != 1:
    raise ValueError(f'decode takes a 1-D sequence of ids, got shape {ids.shape}')
  eos = np.flatnonzero(ids == eos_id)
  if eos.size:
    ids = ids[:eos[0]]
  return ids[(ids != PAD_ID) & (ids != BOS_ID) & (ids >= 0) & (ids < vocab_size)]


def _atomic_write(path: str, data: bytes):
  """Readers see the old file or the whole new one, never a partial write."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.' + os.path.basename(path) + '.')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


class CharTokenizer:
  """One id per character: id = 3 + index of the character in `chars`."""

  def __init__(self, chars: str, unknown: str = 'error'):
    if ''.join(sorted(set(chars))) != chars:
      raise ValueError('chars must be a sorted string of distinct characters')
    if unknown not in ('error', 'skip'):
      raise ValueError(f"unknown must be 'error' or 'skip', got {unknown!r}")
    self.chars, self.unknown = chars, unknown
    self._ids = {c: FIRST_ID + i for i, c in enumerate(chars)}
    self.vocab_size = FIRST_ID + len(chars)

  @classmethod
  def from_text(cls, text: str | Iterable[str], unknown: str = 'error') -> CharTokenizer:
    """The characters of a string, or of every string in an iterable."""
    chars = set()
    for t in [text] if isinstance(text, str) else text:
      chars.update(t)
    return cls(''.join(sorted(chars)), unknown)

  def encode(self, text: str) -> np.ndarray:
    ids = [self._ids.get(c, -1) for c in text]
    if self.unknown == 'error' and -1 in ids:
      missing = [c for c, i in zip(text, ids) if i < 0]
      raise ValueError(
          f'{len(missing)} character(s) of the text are not in the vocabulary of '
          f'{len(self.chars)} characters: {sorted(set(missing))!r} '
          "(build the vocabulary from more text, or pass unknown='skip')")
    return np.array([i for i in ids if i >= 0], np.int32)

  def decode(self, ids) -> str:
    return ''.join(self.chars[i - FIRST_ID] for i in _text_ids(ids, self.vocab_size))


class ByteTokenizer:
  """UTF-8 bytes: id = 3 + byte; invalid UTF-8 decodes to U+FFFD."""
  vocab_size = FIRST_ID + 256

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32) + FIRST_ID

  def decode(self, ids) -> str:
    data = (_text_ids(ids, self.vocab_size) - FIRST_ID).astype(np.uint8).tobytes()
    return data.decode('utf-8', errors='replace')


class SentencePieceTokenizer:
  """A sentencepiece model with pad=0, bos=1, eos=2, unk=3."""

  def __init__(self, model_file: str):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    self.model_file = model_file
    self._sp = spm.SentencePieceProcessor(model_file=model_file)
    special = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
    if special != (PAD_ID, BOS_ID, EOS_ID, FIRST_ID):
      raise ValueError(f'{model_file}: (pad, bos, eos, unk) ids are {special}, not (0, 1, 2, 3)')
    self.vocab_size = self._sp.get_piece_size()
    spec = sentencepiece_model_pb2.ModelProto.FromString(
        self._sp.serialized_model_proto()).trainer_spec
    self.model_type = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(spec.model_type).lower()

  @classmethod
  def train_or_load(cls, path_prefix: str, texts: Iterable[str], vocab_size: int,
                    model_type: str = 'unigram') -> SentencePieceTokenizer:
    """Loads `<path_prefix>.model`, or trains it on `texts` first if it is missing.

    Training is deterministic (the same texts give the same bytes), so processes
    that race to train the same prefix all write the same model.
    """
    if model_type not in SP_MODEL_TYPES:
      raise ValueError(f'model_type must be one of {SP_MODEL_TYPES}, got {model_type!r}')
    if vocab_size < MIN_SP_VOCAB_SIZE:
      raise ValueError(f'vocab_size must be >= {MIN_SP_VOCAB_SIZE}, got {vocab_size}')
    model_file = path_prefix + '.model'
    if not os.path.exists(model_file):
      _train_sentencepiece(path_prefix, texts, vocab_size, model_type)
    tok = cls(model_file)
    if (tok.vocab_size, tok.model_type) != (vocab_size, model_type):
      raise ValueError(
          f'{model_file} is a {tok.model_type} model of {tok.vocab_size} pieces, but '
          f'{model_type} with {vocab_size} was asked for: delete it or use another prefix')
    return tok

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text, out_type=int), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode(_text_ids(ids, self.vocab_size).tolist())


def byte_symbols() -> dict[int, str]:
  """GPT-2's byte -> printable character map: the printable Latin-1 bytes
  stand for themselves, every other byte for the next unused code point
  from 256 on (so that a byte-level token is a string without spaces or
  control characters)."""
  keep = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
          *range(ord('®'), ord('ÿ') + 1)]
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


# GPT-2's pre-tokenizer: contractions, letters, numbers and other runs, each
# with at most one leading space; whitespace. `split_digits` first cuts
# numbers into single digits (SmolLM's, Llama 3's style).
GPT2_SPLIT = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
              r'|\s+(?!\S)|\s+')


class BPETokenizer:
  """Byte-level BPE (GPT-2; Sennrich et al. 2016 on bytes) from a vocabulary
  (token strings in the byte_symbols alphabet, id = index) and merges
  ('a b', highest priority first), as a GGUF file's tokenizer.ggml.tokens
  and tokenizer.ggml.merges hold them.

  encode: text -> pre-tokens (`pieces`)
  -> each as byte symbols, merged pairwise by rank until no merge applies
  -> ids. Special tokens (<|im_start|>, ...) are not parsed from text.
  """

  def __init__(self, tokens: list[str], merges: list[str], split_digits: bool = False,
               eos_id: int = EOS_ID):
    import regex
    self.tokens, self.vocab_size, self.eos_id = tokens, len(tokens), eos_id
    self.ids = {t: i for i, t in enumerate(tokens)}
    self.ranks = {tuple(m.split(' ', 1)): i for i, m in enumerate(merges)}
    self.symbols = byte_symbols()
    self.bytes = {c: b for b, c in self.symbols.items()}
    self._split = regex.compile(GPT2_SPLIT)
    self._digits = regex.compile(r'(\p{N})') if split_digits else None
    self._cache: dict[str, list[int]] = {}

  def _bpe(self, piece: str) -> list[int]:
    if piece not in self._cache:
      parts = list(piece)
      while len(parts) > 1:
        pairs = [(self.ranks.get(pair, len(self.ranks)), i)
                 for i, pair in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == len(self.ranks):
          break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
      missing = [p for p in parts if p not in self.ids]
      if missing:
        raise ValueError(f'BPE pieces {missing} of {piece!r} are not in the vocabulary')
      self._cache[piece] = [self.ids[p] for p in parts]
    return self._cache[piece]

  def pieces(self, text: str) -> list[str]:
    """The pre-tokens: each digit alone first (split_digits), then GPT2_SPLIT
    within the text between them."""
    segments = self._digits.split(text) if self._digits else [text]
    return [p for i, seg in enumerate(segments)
            for p in ([seg] if self._digits and i % 2 else self._split.findall(seg))]

  def encode(self, text: str) -> np.ndarray:
    ids = []
    for piece in self.pieces(text):
      ids += self._bpe(''.join(self.symbols[b] for b in piece.encode('utf-8')))
    return np.asarray(ids, np.int32)

  def decode(self, ids) -> str:
    data = bytes(self.bytes[c] for i in _text_ids(ids, self.vocab_size, self.eos_id)
                 for c in self.tokens[i] if c in self.bytes)
    return data.decode('utf-8', errors='replace')


class WordPieceTokenizer:
  """BERT's tokenizer (Devlin et al. 2019), as a tokenizer.json of type
  WordPiece with the BertNormalizer and BertPreTokenizer describes it:
  control characters dropped and whitespace made ' ', CJK characters spaced,
  lowercased and accents stripped (uncased); split at whitespace and around
  each punctuation character; each word greedily cut into the longest
  vocabulary pieces from its start ('##' marks a continuation), the whole
  word [UNK] when a cut fails or it is longer than max_chars. encode adds
  no [CLS]/[SEP]: `with_specials` does."""

  def __init__(self, vocab: dict[str, int], *, unk: str = '[UNK]', prefix: str = '##',
               max_chars: int = 100, lowercase: bool = True):
    self.vocab, self.unk, self.prefix, self.max_chars = vocab, unk, prefix, max_chars
    self.lowercase = lowercase
    self.tokens = {i: t for t, i in vocab.items()}
    self.vocab_size = max(vocab.values()) + 1
    self.mask_id = vocab.get('[MASK]', 0)  # masked-LM training masks with it
    self.eos_id = vocab.get('[SEP]', EOS_ID)  # BERT ends each segment with it

  @classmethod
  def from_json(cls, path: str) -> 'WordPieceTokenizer':
    with open(path, encoding='utf-8') as f:
      spec = json.load(f)
    model = spec['model']
    if model.get('type') != 'WordPiece':
      raise ValueError(f'{path}: model type {model.get("type")!r}; readable: WordPiece')
    normalizer = spec.get('normalizer') or {}
    return cls(model['vocab'], unk=model.get('unk_token', '[UNK]'),
               prefix=model.get('continuing_subword_prefix', '##'),
               max_chars=model.get('max_input_chars_per_word', 100),
               lowercase=normalizer.get('lowercase', True))

  def words(self, text: str) -> list[str]:
    """The normalised, pre-tokenized words."""
    import unicodedata
    chars = []
    for c in text:
      cat = unicodedata.category(c)
      if c == '\0' or c == '\ufffd' or (cat.startswith('C') and c not in '\t\n\r'):
        continue
      if c.isspace():
        chars.append(' ')
      elif 0x4E00 <= ord(c) <= 0x9FFF or 0x3400 <= ord(c) <= 0x4DBF or 0xF900 <= ord(c) <= 0xFAFF:
        chars.append(f' {c} ')
      else:
        chars.append(c)
    text = ''.join(chars)
    if self.lowercase:
      text = ''.join(c for c in unicodedata.normalize('NFD', text.lower())
                     if unicodedata.category(c) != 'Mn')
    out = []
    for word in text.split():
      piece = ''
      for c in word:
        o = ord(c)
        if (33 <= o <= 47 or 58 <= o <= 64 or 91 <= o <= 96 or 123 <= o <= 126
            or unicodedata.category(c).startswith('P')):
          out += [piece, c] if piece else [c]
          piece = ''
        else:
          piece += c
      if piece:
        out.append(piece)
    return out

  def _pieces(self, word: str) -> list[str]:
    if len(word) > self.max_chars:
      return [self.unk]
    pieces, start = [], 0
    while start < len(word):
      for end in range(len(word), start, -1):
        piece = (self.prefix if start else '') + word[start:end]
        if piece in self.vocab:
          pieces.append(piece)
          start = end
          break
      else:
        return [self.unk]
    return pieces

  def encode(self, text: str) -> np.ndarray:
    return np.asarray([self.vocab[p] for w in self.words(text) for p in self._pieces(w)],
                      np.int32)

  def with_specials(self, ids) -> np.ndarray:
    """[CLS] ids [SEP], as BERT reads one segment."""
    return np.concatenate([[self.vocab['[CLS]']], ids, [self.vocab['[SEP]']]]).astype(np.int32)

  def decode(self, ids) -> str:
    text = ''
    for i in _text_ids(ids, self.vocab_size, self.eos_id):
      token = self.tokens.get(int(i), self.unk)
      text += token[len(self.prefix):] if token.startswith(self.prefix) else ' ' + token
    return text.strip()


def _train_sentencepiece(path_prefix: str, texts: Iterable[str], vocab_size: int,
                         model_type: str):
  """Writes `<path_prefix>.vocab` and then `<path_prefix>.model`, each atomically."""
  import sentencepiece as spm
  from sentencepiece import sentencepiece_model_pb2
  model = io.BytesIO()
  # Training from an iterator into memory keeps file paths out of the model
  # proto, so equal texts give byte-identical files wherever they are trained;
  # all sentences in order, no sampling, fixed threads: deterministic. Each
  # line is a sentence, as in a training file (long documents are not skipped).
  lines = (line for text in texts for line in text.splitlines() if line.strip())
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, pad_id=PAD_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, unk_id=FIRST_ID, input_sentence_size=0, shuffle_input_sentence=False,
        num_threads=2, minloglevel=2)
  except RuntimeError as e:  # e.g. too few texts for vocab_size pieces
    raise ValueError(f'training a {model_type} sentencepiece model of {vocab_size} pieces '
                     f'for {path_prefix} failed: {e}') from e
  proto = sentencepiece_model_pb2.ModelProto.FromString(model.getvalue())
  vocab = ''.join(f'{p.piece}\t{p.score:g}\n' for p in proto.pieces)
  _atomic_write(path_prefix + '.vocab', vocab.encode('utf-8'))
  _atomic_write(path_prefix + '.model', model.getvalue())


def create(kind: str, *, cache_prefix: str, texts_fn: Callable[[], Iterable[str]],
           vocab_size: int, model_type: str = 'unigram') -> Tokenizer:
  """The tokenizer `kind`, cached under `cache_prefix`; texts_fn() only if needed.

  'char' caches its characters in `<cache_prefix>.chars.json`; 'sentencepiece'
  its model in `<cache_prefix>.model`; vocab_size and model_type are for
  sentencepiece only.
  """
  if kind == 'byte':
    return ByteTokenizer()
  if kind == 'char':
    path = cache_prefix + '.chars.json'
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        return CharTokenizer(json.load(f)['chars'])
    tok = CharTokenizer.from_text(texts_fn())
    _atomic_write(path, json.dumps({'chars': tok.chars}, ensure_ascii=False).encode('utf-8'))
    return tok
  if kind == 'sentencepiece':
    def lazy_texts():
      yield from texts_fn()
    return SentencePieceTokenizer.train_or_load(cache_prefix, lazy_texts(), vocab_size, model_type)
  raise ValueError(f'unknown tokenizer kind {kind!r}; valid kinds: {TOKENIZERS}')
