#!/usr/bin/env bash
# Quick start:
#   ./launch.sh                                  the embedded default (experiments/reverse.py)
#   ./launch.sh test [PYTEST_ARGS...]            the test suite (pytest-xdist, a worker per core)
#   ./launch.sh EXPERIMENT.py [--workdir=DIR] [--config.a.b=value ...]
#   ./launch.sh --list_attention                 the attention variants and their kwargs
#   ./launch.sh run SCRIPT.py [ARGS...]          any script (e.g. benchmarks/) with this setup
#   ./launch.sh sweep GRID.py [--jobs=N]         a grid of overrides x seeds (flaxformer_lite/sweep.py)
# The first call creates .venv from pyproject.toml; an edited pyproject.toml re-installs it.
# FFL_EXTRAS=cuda (or tpu) adds the accelerator build of jax.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${FFL_VENV:-.venv}"

find_python() {
  for py in "${PYTHON:-}" python3.12 python3.11 python3.10 python3; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "launch.sh: needs Python >= 3.10 (set PYTHON=/path/to/python3)" >&2
  return 2
}

setup_venv() {
  local want have=""
  want=$( (cat pyproject.toml; echo "extras=${FFL_EXTRAS:-}") | sha256sum | cut -d' ' -f1)
  [ -f "$VENV/.pyproject.sha256" ] && have=$(cat "$VENV/.pyproject.sha256")
  if [ "$want" != "$have" ] || [ ! -x "$VENV/bin/python" ]; then
    local py; py=$(find_python)
    echo "launch.sh: installing into $VENV with $py (first run takes a few minutes)" >&2
    [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q -e ".[test${FFL_EXTRAS:+,$FFL_EXTRAS}]" 2>&1 \
      | grep -v "is ignored: it is neither" >&2 || true
    "$VENV/bin/python" -c "import flaxformer_lite, jax, flax, optax, orbax.checkpoint" \
      || { echo "launch.sh: installation into $VENV failed (see above)" >&2; exit 1; }
    echo "$want" > "$VENV/.pyproject.sha256"
  fi
}

setup_venv
PY="$VENV/bin/python"

# glibc malloc (Linux): XLA:CPU mallocs each call's temp buffer. A block above
# glibc's mmap threshold (32 MiB at most by default) is mapped afresh on every
# call and faulted in page by page: a Transformer-base train step ran 16% slower
# (README, "CPU allocator"). One arena with high mmap and trim thresholds keeps
# such blocks in the heap. Variables already set win; FFL_SYSTEM_MALLOC=1 skips.
if [ "$(uname -s)" = Linux ] && [ -z "${FFL_SYSTEM_MALLOC:-}" ]; then
  export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-1}"
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}"
  export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-8589934592}"
fi

if [ "${1:-}" = "test" ]; then
  shift
  # One pytest-xdist worker per core, at most 4 (each holds a JAX process of a
  # few GiB); FFL_TEST_WORKERS overrides, 0 runs in this process.
  cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  workers="${FFL_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
  [ "$workers" -ge 2 ] || workers=0
  exec "$PY" -m pytest -n "$workers" --durations=10 "$@"
fi
if [ "${1:-}" = "run" ]; then
  shift
  [ $# -gt 0 ] || { echo "launch.sh: run needs a script, e.g. ./launch.sh run benchmarks/attention.py" >&2; exit 2; }
  exec "$PY" "$@"
fi

if [ "${1:-}" = "sweep" ]; then
  shift
  exec "$PY" -m flaxformer_lite.sweep "$@"
fi

EXPERIMENT=experiments/reverse.py
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
  EXPERIMENT="$1"; shift
fi
if [ ! -f "${EXPERIMENT%%:*}" ]; then
  echo "launch.sh: experiment file '${EXPERIMENT%%:*}' not found; experiments are: $(ls experiments/*.py | tr '\n' ' ')" >&2
  exit 2
fi
exec "$PY" -m flaxformer_lite.main --config="$EXPERIMENT" "$@"
