#!/usr/bin/env bash
# One prepared accelerator check (benchmarks/gpu_check.py says what it runs),
# in the project's environment, or with FFL_PYTHON=python3 in the machine's own,
# as calls that each fit one command on a lent GPU machine (their budgets:
# gpu_check.py's CALLS; benchmarks/README.md gives the commands):
#   benchmarks/gpu_check.sh --call 1 --out DIR   # recipe, nanogpt, tests: 305 s
#   benchmarks/gpu_check.sh --call 2 --out DIR   # kernels, mha, mfu, smollm2: 310 s
#   benchmarks/gpu_check.sh --quick              # every call, tiny sizes, any machine
#   benchmarks/gpu_check.sh --only recipe        # one section again, with its budget
set -euo pipefail
cd "$(dirname "$0")/.."
exec ./launch.sh run benchmarks/gpu_check.py "$@"
