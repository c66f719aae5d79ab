#!/usr/bin/env bash
# One prepared accelerator check (benchmarks/gpu_check.py says what it runs),
# in the project's environment, or with FFL_PYTHON=python3 in the machine's own:
#   benchmarks/gpu_check.sh                 # about 9 minutes on one H100
#   benchmarks/gpu_check.sh --quick         # tiny sizes, any machine
#   benchmarks/gpu_check.sh --skip tests smollm2 --budget 300 --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."
exec ./launch.sh run benchmarks/gpu_check.py "$@"
