#!/usr/bin/env bash
# Sets up and runs the whole test suite on the CPU (gloo, several processes on one machine).
# `bash scripts/test.sh quick`: every module's fast checks (nothing launched or trained; about a minute).
# Further arguments go to pytest (e.g. `bash scripts/test.sh quick -k partition`; `-n 0`: one process, no workers).
# 2 pytest-xdist workers, one a core of a 2-core CI host; loadgroup keeps the tests that share a module-scoped
# fixture on one worker (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pip install -q -r requirements-dev.txt  # pytest, and TRL as the preference tests' reference
export DS_ACCELERATOR=cpu
if [ "${1:-}" = quick ]; then
    shift
    set -- -m "not slow" "$@"
fi
python -m pytest -q -n 2 --dist loadgroup --durations=10 --cpu-durations=10 tests "$@"
