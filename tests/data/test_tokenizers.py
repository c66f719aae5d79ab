"""Char, byte and sentencepiece tokenizers: round trips, special ids, caching."""
import gzip
import itertools
import os
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.data import tokenizers
from flaxformer_lite.models import BOS_ID, EOS_ID, PAD_ID

NUM_TRAIN, NUM_HELD_OUT, VOCAB = 3000, 200, 500
UNICODE = 'Grüße aus Köln — 東京, naïve café ☕ 🚀!\n\ttab'


def _never_iterated():
  raise AssertionError('texts were read: the cached model was retrained')
  yield  # pylint: disable=unreachable


@pytest.fixture(scope='module')
def corpus(shared_raw_files):
  """(train, held_out): the first Multi30k train sentences, English + German."""
  paths = [os.path.join(shared_raw_files, 'multi30k', f'train.{lang}.gz') for lang in ('en', 'de')]
  train, held_out = [], []
  for path in paths:
    with gzip.open(path, 'rt', encoding='utf-8') as f:
      lines = [line.rstrip('\n') for line in itertools.islice(f, NUM_TRAIN + NUM_HELD_OUT)]
    train += lines[:NUM_TRAIN]
    held_out += lines[NUM_TRAIN:]
  return train, held_out


@pytest.fixture(scope='module')
def sp_models(corpus, tmp_path_factory):
  """model_type -> a sentencepiece tokenizer of VOCAB pieces trained on the corpus."""
  directory = tmp_path_factory.mktemp('spm')
  return {t: tokenizers.SentencePieceTokenizer.train_or_load(
      str(directory / t), corpus[0], VOCAB, t) for t in tokenizers.SP_MODEL_TYPES}


@pytest.fixture(params=tokenizers.SP_MODEL_TYPES)
def sp(request, sp_models):
  return sp_models[request.param]


@pytest.fixture(params=['char', 'byte', *tokenizers.SP_MODEL_TYPES])
def any_tokenizer(request, corpus, sp_models):
  if request.param == 'char':
    return tokenizers.CharTokenizer.from_text(corpus[0])
  if request.param == 'byte':
    return tokenizers.ByteTokenizer()
  return sp_models[request.param]


def test_char_round_trip_and_ids():
  tok = tokenizers.CharTokenizer.from_text(UNICODE)
  assert tok.chars == ''.join(sorted(set(UNICODE)))
  assert tok.vocab_size == 3 + len(tok.chars)
  ids = tok.encode(UNICODE)
  assert ids.dtype == np.int32 and ids.shape == (len(UNICODE),)
  assert ids.min() >= 3 and ids.max() < tok.vocab_size
  assert tok.decode(ids) == UNICODE
  assert tokenizers.CharTokenizer.from_text(['ba', 'ca']).chars == 'abc'


def test_char_unknown_characters():
  tok = tokenizers.CharTokenizer('abc')
  with pytest.raises(ValueError, match=r"3 character\(s\).*\['x', 'z'\]"):
    tok.encode('abxzx')
  skip = tokenizers.CharTokenizer('abc', unknown='skip')
  assert skip.decode(skip.encode('axbz')) == 'ab'
  with pytest.raises(ValueError, match='sorted'):
    tokenizers.CharTokenizer('ba')


def test_byte_round_trip():
  tok = tokenizers.ByteTokenizer()
  assert tok.vocab_size == 259
  ids = tok.encode(UNICODE)
  assert ids.dtype == np.int32 and len(ids) == len(UNICODE.encode('utf-8'))
  assert ids.min() >= 3 and ids.max() < 259
  assert tok.decode(ids) == UNICODE
  assert tok.decode(tok.encode('é')[:1]) == '\ufffd'  # a cut character is replaced


def test_sentencepiece_round_trip_on_held_out_sentences(sp, corpus):
  """Exact for every held-out sentence whose characters all occur in training;
  an unseen character becomes unk (3). Normalisation collapses whitespace."""
  train, held_out = corpus
  seen = set(''.join(train))
  assert sp.vocab_size == VOCAB
  known = [s for s in held_out if set(s) <= seen]
  assert len(known) > 0.9 * len(held_out)
  for s in known:
    ids = sp.encode(s)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert sp.decode(ids) == s
  for s in set(held_out) - set(known):
    assert 3 in sp.encode(s)
  assert sp.decode(sp.encode('  Ein  Hund \t rennt. ')) == 'Ein Hund rennt.'


def test_encode_never_emits_special_ids(any_tokenizer, corpus):
  for s in corpus[0][:300]:
    ids = any_tokenizer.encode(s)
    assert ids.min() >= 3 and ids.max() < any_tokenizer.vocab_size


def test_decode_stops_at_eos_and_skips_pad_and_bos(any_tokenizer):
  text = 'A dog runs.'
  ids = any_tokenizer.encode(text).tolist()
  other = any_tokenizer.encode('Two men.').tolist()
  hand_built = [BOS_ID, PAD_ID] + ids[:2] + [PAD_ID] + ids[2:] + [EOS_ID] + other + [PAD_ID] * 3
  for form in (hand_built, np.array(hand_built), jnp.array(hand_built)):
    assert any_tokenizer.decode(form) == text
  assert any_tokenizer.decode([EOS_ID] + ids) == ''
  assert any_tokenizer.decode(ids + [any_tokenizer.vocab_size + 5]) == text


def test_sentencepiece_is_cached_and_deterministic(sp, corpus, tmp_path):
  again = tokenizers.SentencePieceTokenizer.train_or_load(
      sp.model_file[:-len('.model')], _never_iterated(), VOCAB, sp.model_type)
  sample = corpus[1][:50]
  assert [again.encode(s).tolist() for s in sample] == [sp.encode(s).tolist() for s in sample]
  fresh = str(tmp_path / 'fresh')
  tokenizers.SentencePieceTokenizer.train_or_load(fresh, iter(corpus[0]), VOCAB, sp.model_type)
  with open(sp.model_file, 'rb') as a, open(fresh + '.model', 'rb') as b:
    assert a.read() == b.read()
  assert sorted(os.listdir(tmp_path)) == ['fresh.model', 'fresh.vocab']  # no temp files left
  with pytest.raises(ValueError, match='delete it or use another prefix'):
    tokenizers.SentencePieceTokenizer.train_or_load(fresh, _never_iterated(), VOCAB + 8,
                                                    sp.model_type)


def test_racing_trainers_write_one_model(corpus, tmp_path):
  prefix, results = str(tmp_path / 'race'), []
  def train():
    results.append(tokenizers.SentencePieceTokenizer.train_or_load(
        prefix, corpus[0][:1000], 200, 'bpe'))
  threads = [threading.Thread(target=train) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(results) == 2
  assert results[0].encode('A dog runs.').tolist() == results[1].encode('A dog runs.').tolist()
  assert sorted(os.listdir(tmp_path)) == ['race.model', 'race.vocab']


def test_bad_arguments_name_the_valid_values(tmp_path):
  with pytest.raises(ValueError, match="'unigram', 'bpe'"):
    tokenizers.SentencePieceTokenizer.train_or_load(str(tmp_path / 'x'), ['a'], 100, 'word')
  with pytest.raises(ValueError, match='vocab_size must be >= 16'):
    tokenizers.SentencePieceTokenizer.train_or_load(str(tmp_path / 'x'), ['a'], 4, 'bpe')
  with pytest.raises(ValueError, match='Vocabulary size too high'):  # sentencepiece's reason
    tokenizers.SentencePieceTokenizer.train_or_load(str(tmp_path / 'x'), ['a b c'], 100, 'bpe')
  assert not os.listdir(tmp_path)
  with pytest.raises(ValueError, match="'sentencepiece', 'char', 'byte'"):
    tokenizers.create('wordpiece', cache_prefix=str(tmp_path / 'x'), texts_fn=list,
                      vocab_size=100, model_type='bpe')


def test_create_caches_and_reads_texts_only_when_needed(sp, tmp_path):
  prefix = str(tmp_path / 'char')
  char = tokenizers.create('char', cache_prefix=prefix, texts_fn=lambda: ['héllo', 'wörld'],
                           vocab_size=0, model_type='unigram')
  assert os.path.exists(prefix + '.chars.json')
  cached = tokenizers.create('char', cache_prefix=prefix, texts_fn=_never_iterated,
                             vocab_size=0, model_type='unigram')
  assert cached.chars == char.chars == 'dhlorwéö'
  byte = tokenizers.create('byte', cache_prefix=prefix, texts_fn=_never_iterated,
                           vocab_size=0, model_type='unigram')
  assert byte.vocab_size == 259
  loaded = tokenizers.create('sentencepiece', cache_prefix=sp.model_file[:-len('.model')],
                             texts_fn=_never_iterated, vocab_size=VOCAB, model_type=sp.model_type)
  assert loaded.encode('A dog runs.').tolist() == sp.encode('A dog runs.').tolist()


def test_loading_a_tokenizer_imports_no_model_code():
  """Token ids live on the ground floor (flaxformer_lite/tokens.py): reading
  text needs neither Flax's layers nor the attention registry."""
  code = ('import sys; import flaxformer_lite.data.tokenizers; '
          'print(sorted(m for m in ("flax.linen", "flaxformer_lite.models", '
          '"flaxformer_lite.layers", "flaxformer_lite.attention") if m in sys.modules))')
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == '[]'
