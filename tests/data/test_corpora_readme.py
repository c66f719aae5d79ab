"""flaxformer_lite/data/README.md names each corpus file with its sha256: the
files found hold exactly those bytes."""
import hashlib
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, 'flaxformer_lite', 'data', 'README.md')


def test_every_corpus_file_matches_its_checksum(shared_data):
  rows = re.findall(r'^\| ([\w/.]+) \| ([0-9a-f]{64}) \|$', open(README).read(), re.M)
  assert {name.split('/')[0] for name, _ in rows} == {'multi30k', 'tiny_shakespeare'}
  assert len(rows) == 7
  for name, digest in rows:
    with open(os.path.join(shared_data, name), 'rb') as f:
      assert hashlib.sha256(f.read()).hexdigest() == digest, name
