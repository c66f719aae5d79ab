#!/usr/bin/env bash
# Sets up .venv once (from pyproject.toml; an edited pyproject.toml re-installs
# it), then runs an experiment, the tests, a script or a sweep in it. The
# usage text below is the reference for the commands and flags.
set -euo pipefail
case "${FFL_PYTHON:-}" in  # a path relative to the caller's folder, before the cd
  /*|"") ;;
  */*) FFL_PYTHON="$PWD/$FFL_PYTHON" ;;
esac
cd "$(dirname "$0")"

usage() {
  cat <<'USAGE'
Usage: ./launch.sh [EXPERIMENT.py] [FLAGS...]   train and evaluate an experiment
       ./launch.sh test [PYTEST_ARGS...]        the test suite
       ./launch.sh run SCRIPT.py [ARGS...]      a script (e.g. benchmarks/*.py) in
       ./launch.sh run -m MODULE [ARGS...]      this setup; -c CODE works too
       ./launch.sh sweep GRID.py [--jobs=N]     a grid of overrides x seeds
                                                (./launch.sh sweep --help)
       ./launch.sh fetch NAME                   a pretrained model into the cache
                                                (minilm, smollm2; flaxformer_lite/pretrained.py)
       ./launch.sh --list_attention             the attention variants and options
       ./launch.sh --help | -h | help           this text

EXPERIMENT.py defaults to experiments/reverse.py (reverse random sequences;
a few minutes on a laptop CPU). Each experiment file's docstring gives its
command and the numbers it should reach.

Flags of an experiment:
  --config.a.b=value     set one config value; the value parses as the type of
                         the key, e.g.
                           ./launch.sh --config.model.attention=shaw \
                             --config.model.attention_kwargs.max_distance=8
  --workdir=DIR          checkpoints, metrics.jsonl, TensorBoard events and
                         config.json; the same command again resumes from the
                         newest checkpoint. Default: workdirs/EXPERIMENT without
                         --config overrides, else
                         workdirs/EXPERIMENT-KEY=VALUE,...-HASH (the overrides,
                         keys shortened; HASH = 6 hex digits of their sha256)
                         (the run logs its workdir as its first line)
  --devices=N            N simulated CPU devices (appends
                         --xla_force_host_platform_device_count=N to XLA_FLAGS);
                         also among a sweep's flags and before run or test.
                         On a GPU host add JAX_PLATFORMS=cpu
  --allow_config_change  resume a workdir whose config.json differs
  --local_processes=N    N JAX processes on this machine (a multi-host job)
  --multihost            jax.distributed.initialize() first (TPU pod, SLURM)

Data: the synthetic tasks are generated from a seed. A real corpus is read
from --config.data.manual_dir=DIR; left empty, from $FFL_SHARED_DATA, else
../shared/data next to this checkout or the one it was cloned from, else it
is downloaded (README, "Data").

Progress goes to stdout (./launch.sh > run.log keeps it), warnings and errors
to stderr. Exit codes: 0 done; 2 bad flag, config or data (nothing compiled,
nothing saved overwritten); 3 non-finite loss (the last good checkpoint kept);
after SIGINT or SIGTERM 0 (every step trained is saved; the same command
resumes), 130 a second SIGINT (143 a second SIGTERM) stopped it at once,
without a checkpoint.

Environment: FFL_EXTRAS=cuda (or tpu) installs the accelerator build of jax;
FFL_VENV=DIR another venv (default .venv); FFL_SYSTEM_MALLOC=1 keeps glibc's
malloc defaults; JAX_PLATFORMS=cpu ignores any accelerator.
FFL_PYTHON=python3 runs in that interpreter as it is (a GPU/TPU machine or
container that came with JAX, often offline): no venv, no pip; this checkout
goes on PYTHONPATH. A package the command needs that does not import (every
command: jax, flax, optax, orbax-checkpoint, absl-py, ml-collections, numpy;
test: also pytest, pytest-xdist and the suite's imports) is named with its pip
install line, exit 2. The synthetic tasks need neither tensorflow-datasets
(generated in memory) nor tensorboardX (metrics.jsonl only).
USAGE
}

# --devices=N before the command, or anywhere among an experiment's or a
# sweep's flags (all of which are ours; a script's or pytest's are not).
devices=""
while [ $# -gt 0 ] && [[ "$1" == --devices* ]]; do
  devices="$1"; shift
done
subcommand="${1:-}"
case "$subcommand" in
  -h|--help|help) usage; exit 0 ;;
esac
if [ "$subcommand" != test ] && [ "$subcommand" != run ]; then
  rest=()
  for arg in "$@"; do
    case "$arg" in
      --devices*) devices="$arg" ;;
      -h|--help) if [ "$subcommand" = sweep ]; then rest+=("$arg"); else usage; exit 0; fi ;;
      *) rest+=("$arg") ;;
    esac
  done
  set -- ${rest[@]+"${rest[@]}"}
fi
if [ -n "$devices" ]; then
  if ! [[ "$devices" =~ ^--devices=[1-9][0-9]*$ ]]; then
    echo "launch.sh: '$devices': give the number of devices as --devices=N, N >= 1 (./launch.sh --help)" >&2
    exit 2
  fi
  # Read by XLA when JAX creates its CPU client; a count already in XLA_FLAGS is overridden.
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=${devices#--devices=}"
fi

EXPERIMENT=experiments/reverse.py
if [ "$subcommand" != test ] && [ "$subcommand" != run ] && [ "$subcommand" != sweep ] &&
   [ "$subcommand" != fetch ]; then
  if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    EXPERIMENT="$1"; shift
  fi
  if [ ! -f "${EXPERIMENT%%:*}" ]; then
    echo "launch.sh: experiment file '${EXPERIMENT%%:*}' not found; experiments are: $(ls experiments/*.py | tr '\n' ' ')(./launch.sh --help for the commands)" >&2
    exit 2
  fi
fi

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
    "$VENV/bin/python" -m pip install -q --no-compile --upgrade pip >&2
    # setuptools' notice on every editable install of a flat layout is not an error.
    PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" \
      "$VENV/bin/python" -m pip install -q --no-compile -e ".[test${FFL_EXTRAS:+,$FFL_EXTRAS}]" 2>&1 \
      | grep -v "is ignored: it is neither" >&2 || true
    "$VENV/bin/python" -c "import flaxformer_lite, jax, flax, optax, orbax.checkpoint" \
      || { echo "launch.sh: installation into $VENV failed (see above)" >&2; exit 1; }
    # The packages' bytecode, written once here on all cores (pip's own step
    # is serial): where PYTHONDONTWRITEBYTECODE is set, Python never writes
    # it, and every process (each test worker, each run a test starts) would
    # compile jax, flax and the rest from source again (tests/README.md).
    "$VENV/bin/python" -m compileall -q -j 0 \
      "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null \
      || echo "launch.sh: some of $VENV's modules did not byte-compile; they compile as imported" >&2
    echo "$want" > "$VENV/.pyproject.sha256"
  fi
}

# Import name=distribution; pyproject.toml gives each one's version specifier.
CORE="jax=jax flax=flax optax=optax orbax.checkpoint=orbax-checkpoint absl=absl-py
      ml_collections=ml-collections numpy=numpy"
TFDS="tensorflow_datasets=tensorflow-datasets importlib_resources=importlib_resources
      array_record=array-record"

# FFL_PYTHON: the modules a command needs, or the pip line for those that do not import.
check_imports() {  # LABEL MODULE=DISTRIBUTION...
  "$PY" - "$@" <<'PY'
import importlib, os, re, shlex, sys
if sys.version_info < (3, 10):
  sys.exit(f'launch.sh: FFL_PYTHON is Python {sys.version.split()[0]}; it needs >= 3.10')
label, pairs = sys.argv[1], [pair.split('=') for pair in sys.argv[2:]]
missing, broken = [], []
for module, dist in pairs:
  try:
    importlib.import_module(module)
  except ImportError:
    missing.append((module, dist))
  except Exception as e:  # installed, but its import fails (e.g. mismatched versions)
    broken.append(f'{module} ({type(e).__name__}: {e})')
python = shlex.quote(os.environ['FFL_PYTHON'])
if missing:
  with open('pyproject.toml') as f:
    text = f.read()
  found = [re.search(r'"(%s(?:[<>=!~][^"]*)?)"' % re.escape(dist), text) for _, dist in missing]
  specs = ' '.join(shlex.quote(m.group(1) if m else dist) for m, (_, dist) in zip(found, missing))
  print(f'launch.sh: FFL_PYTHON={python} cannot import {", ".join(m for m, _ in missing)} '
        f'(needed by {label}); install with\n  {python} -m pip install {specs}\n'
        f'or leave FFL_PYTHON unset (launch.sh then sets up .venv).', file=sys.stderr)
if broken:
  print(f'launch.sh: FFL_PYTHON={python} has {"; ".join(broken)}, needed by {label}, '
        f'installed but failing to import.', file=sys.stderr)
sys.exit(2 if missing or broken else 0)
PY
}

if [ -n "${FFL_PYTHON:-}" ]; then
  if ! command -v "$FFL_PYTHON" >/dev/null 2>&1; then
    echo "launch.sh: FFL_PYTHON=$FFL_PYTHON is not a command (give python3 or a path)" >&2
    exit 2
  fi
  PY="$FFL_PYTHON"
  # In place of the venv's editable install of this checkout.
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  case "${1:-}" in
    test)
      # The suite's other imports; the tests that read TFDS skip without it, except on CI.
      needs="$CORE pytest=pytest xdist=pytest-xdist sentencepiece=sentencepiece regex=regex
             sacrebleu=sacrebleu tensorboardX=tensorboardX matplotlib=matplotlib"
      if [ "${CI:-}" = true ]; then needs="$needs $TFDS"; fi ;;
    sweep) needs="$CORE matplotlib=matplotlib" ;;  # its plots
    *) needs="$CORE" ;;
  esac
  case "${1:-}" in
    test|run|sweep|fetch) label="./launch.sh $1" ;;
    *) label="$EXPERIMENT" ;;
  esac
  check_imports "$label" $needs || exit 2  # $needs unquoted: one word per module
else
  setup_venv
  PY="$VENV/bin/python"
fi

# glibc malloc (Linux): XLA:CPU mallocs each call's temp buffer. A block above
# glibc's mmap threshold (32 MiB at most by default) is mapped afresh on every
# call and faulted in page by page: a Transformer-base train step ran 16% slower
# (benchmarks/KERNELS.md, "CPU allocator"). One arena with high mmap and trim thresholds keeps
# such blocks in the heap. Blocks of 1 GiB and more are still mapped: kept in
# the heap, a freed one is split by smaller requests, the next call's buffer no
# longer fits, and the heap grows by about a buffer at every step.
# Variables already set win; FFL_SYSTEM_MALLOC=1 skips.
if [ "$(uname -s)" = Linux ] && [ -z "${FFL_SYSTEM_MALLOC:-}" ]; then
  export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-1}"
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1073741824}"
  export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-8589934592}"
fi

if [ "${1:-}" = "test" ]; then
  shift
  # pytest-xdist workers: one more than the cores, at most 4 (each holds a JAX
  # process of a few GiB): about a fifth of the suite's time goes to waiting
  # on subprocesses (runs, signals, several processes), which the extra
  # worker fills. One core: in this process. FFL_TEST_WORKERS overrides.
  cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  workers="${FFL_TEST_WORKERS:-$(( cores < 2 ? 0 : cores < 4 ? cores + 1 : 4 ))}"
  [ "$workers" -ge 2 ] || workers=0
  # worksteal: a worker that runs out takes tests queued for the others, so
  # the slow ones do not leave the end of the run to one worker.
  dist=(); [ "$workers" -ge 2 ] && dist=(--dist worksteal)
  exec "$PY" -m pytest -n "$workers" "${dist[@]}" --durations=10 "$@"
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
if [ "${1:-}" = "fetch" ]; then
  shift
  exec "$PY" -m flaxformer_lite.pretrained fetch "$@"
fi

exec "$PY" -m flaxformer_lite.main --config="$EXPERIMENT" "$@"
