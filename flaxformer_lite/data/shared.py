"""Where the real corpora are found when `data.manual_dir` is empty.

The tests, the benchmarks and the experiments read Multi30k and Tiny
Shakespeare from one folder holding `multi30k/` and `tiny_shakespeare/`
(../shared/data/README.md says where each file comes from). It is looked for
in $FFL_SHARED_DATA alone when that is set; else in `shared/data` next to
this checkout, then next to the checkout it was cloned from (a fresh
`git clone /path/to/flaxformer_lite` keeps its corpora beside the original).
Only when none holds them are the files downloaded.
"""
from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# data.task -> its folder in the shared data.
FOLDERS = {'multi30k': 'multi30k', 'tiny_shakespeare': 'tiny_shakespeare'}


def _origin_checkout(repo: str) -> str | None:
  """The folder `repo` was cloned from, when its origin is a local path."""
  try:
    url = subprocess.run(['git', 'remote', 'get-url', 'origin'], cwd=repo, capture_output=True,
                         text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  url = url[len('file://'):] if url.startswith('file://') else url
  return url if url and os.path.isdir(url) else None


def candidates(repo: str = REPO) -> list[str]:
  """The folders looked at, in order."""
  if os.environ.get('FFL_SHARED_DATA'):
    return [os.path.abspath(os.path.expanduser(os.environ['FFL_SHARED_DATA']))]
  found = [os.path.join(os.path.dirname(repo), 'shared', 'data')]
  origin = _origin_checkout(repo)
  if origin:
    found.append(os.path.join(os.path.dirname(os.path.abspath(origin)), 'shared', 'data'))
  return found


def find(repo: str = REPO) -> tuple[str | None, list[str]]:
  """(the first folder holding every corpus folder, or None; the folders looked at)."""
  looked_at = candidates(repo)
  for path in looked_at:
    if all(os.path.isdir(os.path.join(path, f)) for f in FOLDERS.values()):
      return os.path.abspath(path), looked_at
  return None, looked_at


def manual_dir(task: str) -> str:
  """The shared folder of `task`'s raw files, or '' (not a shared corpus, or
  no shared data found)."""
  if task not in FOLDERS:
    return ''
  path = os.path.join(find()[0] or '', FOLDERS[task])
  return path if os.path.isdir(path) else ''
