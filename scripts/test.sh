#!/usr/bin/env bash
# Sets up and runs the whole test suite on the CPU (gloo, several processes on one machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
python -m pytest -q --durations=10 tests "$@"
