#!/usr/bin/env bash
# One command that proves a GPU run: the checks in tests/gpu (bf16 conversion, training, resume, offload, LoRA,
# export, token shards, DPO against TRL and throughput on one GPU; NCCL pipeline, tensor and context parallelism on
# two) launch the trainer and the converter as a user would, then print one line per check: name, PASS / FAIL /
# SKIP, key figure. Exits non-zero if a check fails; without a CUDA device every check is skipped and it exits 0.
# Needs the CUDA build of torch and the requirements installed (README, "Install on a GPU cluster"). One H200: 5
# minutes (bench/README.md, "GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
# One run's files, left for a look after it and replaced by the next (the 1B model's checkpoint alone is 15 GB;
# pytest's own temporary directories keep the last three runs).
exec python -m pytest -q --tb=short -m gpu --basetemp "${TMPDIR:-/tmp}/gpu_check" tests/gpu "$@"
