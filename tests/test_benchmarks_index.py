"""benchmarks/README.md is an index: short, every script in benchmarks/ listed
with its command and where its numbers are; and every relative link of the
documents that hold the numbers (the index, benchmarks/RESULTS.md and
KERNELS.md, tests/README.md, the top-level README.md) resolves to a file that
exists and, where it names one, to a heading of that file."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX = os.path.join(REPO, 'benchmarks', 'README.md')
DOCUMENTS = ('benchmarks/README.md', 'benchmarks/RESULTS.md', 'benchmarks/KERNELS.md',
             'tests/README.md', 'README.md')
MAX_LINES = 250

LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def _prose(text: str) -> str:
  """The text without fenced blocks and inline code spans (no links there)."""
  text = re.sub(r'^```.*?^```', '', text, flags=re.M | re.S)
  return re.sub(r'`[^`\n]*`', '', text)


def slug(heading: str) -> str:
  """A heading's anchor as GitHub writes it: lower case, punctuation dropped,
  spaces to hyphens."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def anchors(path: str) -> set[str]:
  """The anchors of a markdown file's headings (a repeated one gets -1, -2, ...)."""
  with open(path) as f:
    text = re.sub(r'^```.*?^```', '', f.read(), flags=re.M | re.S)
  seen, out = {}, set()
  for heading in re.findall(r'^#{1,6} (.+)$', text, flags=re.M):
    base = slug(heading)
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f'{base}-{n}')
  return out


def broken_links(path: str) -> list[str]:
  """Each relative link of the markdown file at path whose file, or heading,
  does not exist."""
  with open(path) as f:
    text = _prose(f.read())
  problems = []
  for target in LINK.findall(text):
    if re.match(r'^[a-z]+:', target):  # http:, https:, mailto:
      continue
    file, _, anchor = target.partition('#')
    resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
    if not os.path.exists(resolved):
      problems.append(f'{os.path.relpath(path, REPO)}: {target}: no file {resolved}')
    elif anchor and (not resolved.endswith('.md') or anchor not in anchors(resolved)):
      problems.append(f'{os.path.relpath(path, REPO)}: {target}: no heading #{anchor}')
  return problems


def scripts() -> list[str]:
  paths = glob.glob(os.path.join(REPO, 'benchmarks', '*.py'))
  paths += glob.glob(os.path.join(REPO, 'benchmarks', '*.sh'))
  return sorted(os.path.basename(p) for p in paths)


def index_entries(text: str) -> dict[str, str]:
  """The index's entries: {script: its item's text}, an item being a list item
  that starts '- **[NAME](NAME)**' and runs to the next item or heading."""
  entries = {}
  for match in re.finditer(r'^- \*\*\[([^\]]+)\]\(([^)]+)\)\*\*(.*?)(?=^- |^#|\Z)', text,
                           flags=re.M | re.S):
    name, target, body = match.groups()
    assert name == target, f'{name} links to {target}'
    entries[name] = body
  return entries


def test_the_index_is_short():
  with open(INDEX) as f:
    lines = f.read().splitlines()
  assert len(lines) <= MAX_LINES, (
      f'benchmarks/README.md has {len(lines)} lines (at most {MAX_LINES})')


def test_every_script_is_in_the_index_with_its_command_and_results():
  with open(INDEX) as f:
    entries = index_entries(f.read())
  assert scripts(), 'no scripts found in benchmarks/'
  missing = [s for s in scripts() if s not in entries]
  assert not missing, f'benchmarks/README.md does not list {missing}'
  extra = set(entries) - set(scripts())
  assert not extra, f'benchmarks/README.md lists scripts that benchmarks/ lacks: {extra}'
  for name, body in entries.items():
    commands = re.findall(r'`([^`\n]+)`', body)
    assert any(f'benchmarks/{name}' in c for c in commands), (
        f'{name}: no command (a code span naming benchmarks/{name}) in its entry')
    assert '?' in body, f'{name}: its entry asks no question'

    results = body.split('→', 1)
    assert len(results) == 2 and LINK.search(results[1]), (
        f'{name}: no link to its results after the →')


@pytest.mark.parametrize('document', DOCUMENTS)
def test_every_relative_link_resolves(document):
  path = os.path.join(REPO, document)
  assert os.path.exists(path), document
  assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
  assert slug("chunked_attention.py: the chunked kernel against each variant's dense form") == (
      'chunked_attentionpy-the-chunked-kernel-against-each-variants-dense-form')
  assert slug('Relative or absolute positions? Shaw et al. 2018') == (
      'relative-or-absolute-positions-shaw-et-al-2018')
  (tmp_path / 'other.md').write_text('# Title\n\n## A section\n\n## A section\n')
  doc = tmp_path / 'doc.md'
  doc.write_text('# Doc\n\n[ok](other.md#a-section) [ok](other.md#a-section-1) [ok](#doc)\n'
                 '[gone](missing.md) [no heading](other.md#nope) [self](#nope)\n'
                 '`[code](missing.md)` https://example.com [web](https://example.com/x#y)\n'
                 '```\n[fenced](missing.md)\n```\n')
  problems = broken_links(str(doc))
  assert len(problems) == 3, problems
  assert 'missing.md' in problems[0] and 'other.md#nope' in problems[1] and '#nope' in problems[2]
