"""flaxformer_lite/embed.py: mean pooling and normalisation by hand, the
embeddings of all-MiniLM-L6-v2 (./launch.sh fetch minilm) against the ones
pooled from Hugging Face transformers' BertModel's hidden states
(tests/golden/minilm.json), and the command end to end."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from flaxformer_lite import embed, pretrained

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fetched(name):
  """The model's path in the cache, fetched by the project's command; the
  test is skipped, saying why, where the package index cannot be reached."""
  try:
    return pretrained.fetch(name)
  except pretrained.PretrainedError as e:
    pytest.skip(f'{name} is not in {pretrained.cache_dir()} and could not be fetched: {e}')


def _launch(*args):
  """./launch.sh run -m flaxformer_lite.embed ARGS in this test's venv (so
  that launch.sh neither builds nor reinstalls one)."""
  venv = os.path.dirname(os.path.dirname(sys.executable))
  if not os.path.isfile(os.path.join(venv, '.pyproject.sha256')):
    pytest.skip(f'{venv} was not made by launch.sh (it would install a new one)')
  return subprocess.run(['bash', 'launch.sh', 'run', '-m', 'flaxformer_lite.embed', *args],
                        cwd=REPO, env={**os.environ, 'FFL_VENV': venv}, capture_output=True,
                        text=True, timeout=300)


def test_sentence_embeddings_are_the_normalised_mean_of_the_masked_in_tokens():
  """Against loops, on rows with 2, 5 and no real tokens; a NaN at a padded
  position (whatever a model leaves there) does not leak in."""
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(3, 5, 4)).astype(np.float32)
  mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
  hidden[0, 3] = np.nan
  want = np.zeros((3, 4))
  for i in range(3):
    real = [hidden[i, j].astype(np.float64) for j in range(5) if mask[i, j]]
    if real:
      mean = sum(real) / len(real)
      want[i] = mean / np.sqrt(sum(x * x for x in mean))
  for m in (mask, mask.astype(bool)):
    got = np.asarray(embed.sentence_embeddings(hidden, m))
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope='module')
def minilm():
  """(path, golden, the golden texts' embeddings): one batch, one compile."""
  path = _fetched('minilm')
  with open(os.path.join(REPO, 'tests', 'golden', 'minilm.json')) as f:
    golden = json.load(f)
  return path, golden, embed.embed(golden['texts'], path)


def test_minilm_embeddings_pool_bertmodels_hidden_states(minilm):
  """The golden texts (6, 9 and 17 tokens) go through as one padded batch;
  each embedding is the normalised mean of BertModel's hidden states of its
  unpadded text, and so are their cosine similarities, to 1e-4."""
  path, golden, got = minilm
  ids = embed.tokenize(pretrained.tokenizer(path), golden['texts'], 256)
  assert ids.shape == (3, 17)
  for row, want in zip(ids, golden['ids']):  # the checkpoint's own tokens, then [PAD]s
    assert row.tolist() == want + [0] * (17 - len(want))
  means = np.stack([np.asarray(h, np.float64).mean(axis=0) for h in golden['hidden']])
  want = means / np.linalg.norm(means, axis=1, keepdims=True)
  assert got.shape == (3, 384) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, atol=1e-4)
  np.testing.assert_allclose(got @ got.T, want @ want.T, atol=1e-4)


# The command printing its matrix for the README's three sentences:
# tests/test_readme.py runs it as written and checks the table.


def test_a_bad_model_is_named_with_what_is_valid():
  r = _launch('--model=no_such_model', 'A text.')
  assert r.returncode == 2
  assert "'no_such_model'" in r.stderr and 'minilm' in r.stderr, r.stderr
  assert r.stdout == ''
