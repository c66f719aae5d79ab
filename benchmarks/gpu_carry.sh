#!/usr/bin/env bash
# Prepares .gpu_carry/ for benchmarks/gpu_check.sh on a machine that has JAX
# but no internet (a lent GPU): the wheels its Python lacks (pytest too, for the
# check's tests section), for Python 3.12
# on x86_64, nanoGPT's source and the shared corpora. On that machine:
#   python3 -m pip install -q --no-deps --no-index --no-build-isolation .gpu_carry/wheels/*
#   python3 -m pip install -q --no-deps --no-index .gpu_carry/tokamax/* || true
#   FFL_PYTHON=python3 FFL_SHARED_DATA=$PWD/.gpu_carry/data benchmarks/gpu_check.sh --call 1 --out DIR
#   (then --call 2; benchmarks/README.md gives each call's command)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_carry/wheels .gpu_carry/data
pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .gpu_carry/wheels \
  ml_collections tensorflow-datasets array-record tensorboardX dm-tree immutabledict \
  simple-parsing tensorflow-metadata termcolor toml docstring-parser googleapis-common-protos \
  importlib_resources pytest pytest-xdist execnet pluggy iniconfig pygments
pip download -q --no-deps --no-binary=:all: -d .gpu_carry/wheels promise  # no wheel exists
# tokamax (a Pallas kernel library; jax >= 0.11.1) for gpu_check's attention-only
# table, apart: its install may fail without failing the rest.
mkdir -p .gpu_carry/tokamax
pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .gpu_carry/tokamax \
  tokamax einshape jaxtyping wadler-lindig qwix pydantic pydantic-core annotated-types \
  typing-inspection immutabledict
# nanoGPT's own train.py for gpu_check's side-by-side section (read, never committed)
if [ ! -f .gpu_carry/nanogpt/train.py ]; then
  git clone -q --depth 1 https://github.com/karpathy/nanoGPT .gpu_carry/nanogpt ||
    echo "gpu_carry.sh: could not clone nanoGPT; put a copy in .gpu_carry/nanogpt (gpu_check skips it)" >&2
fi
data="${FFL_SHARED_DATA:-../shared/data}"
cp -r "$data"/multi30k "$data"/tiny_shakespeare .gpu_carry/data/
du -sh .gpu_carry
