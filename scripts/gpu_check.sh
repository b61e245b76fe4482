#!/usr/bin/env bash
# One command that proves a GPU run: the checks in tests/gpu (bf16 conversion, training, resume, offload, LoRA,
# export, token shards, DPO against TRL and throughput on one GPU; the mixtures of experts' and latent attention's
# bf16 evaluation against transformers, their experts' path and host syncs, MLA's SDPA kernel and a Qwen3-MoE
# stage's tokens/s; the hybrids' linear attention through flash-linear-attention against its torch path, and the
# tokens/s of each; NCCL pipeline, tensor, context and expert parallelism on two) launch the trainer and the
# converter as a user would, then print one line per check: name, PASS / FAIL / SKIP, key figure. Exits non-zero if
# a check fails, or if the machine has a GPU (nvidia-smi lists one, or a /dev/nvidia device exists) that torch
# cannot use (a CPU build of torch, a driver older than its CUDA); only a machine without a GPU skips every check
# and exits 0. Needs the CUDA build of torch and the requirements installed
# (README, "Install on a GPU cluster"). One H200: about 7.5 minutes, 6 without the throughput checks
# (-k "not throughput"; bench/README.md, "GPU check"), before the mixture-of-experts checks were added (not yet
# timed on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

gpus_listed=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
device_nodes=$( (compgen -G "/dev/nvidia[0-9]*" || true) | wc -l)
# A GPU listed that torch cannot use fails here; no GPU that torch can use, and none listed, skips every check here,
# before pytest imports the checks (their imports alone cost more than this answer).
torch_sees_a_gpu=$(python - "$gpus_listed" "$device_nodes" <<'EOF'
import sys

import torch

if not torch.cuda.is_available() and (int(sys.argv[1]) or int(sys.argv[2])):
    try:
        torch.cuda.init()
        reason = "torch.cuda.is_available() is false"
    except Exception as error:  # torch's own words: a CPU build, a driver too old, no device visible
        reason = str(error).strip().splitlines()[0]
    listed = f"nvidia-smi lists {sys.argv[1]} GPU(s)" if int(sys.argv[1]) else "/dev/nvidia* exists"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    sys.exit(f"gpu_check: FAIL: {listed}, but torch {torch.__version__} ({build}) cannot use it: {reason}; install "
             f"the CUDA build of torch for this driver (README, 'Install on a GPU cluster')")
print(torch.cuda.is_available())
EOF
)
if [[ "$torch_sees_a_gpu" == False ]]; then
    echo "no CUDA device found (torch.cuda.is_available() is false): every check skipped"
    exit 0
fi
# One run's files, left for a look after it and replaced by the next (the 1B model's checkpoint alone is 15 GB;
# pytest's own temporary directories keep the last three runs).
exec python -m pytest -q --tb=short -m gpu --basetemp "${TMPDIR:-/tmp}/gpu_check" tests/gpu "$@"
