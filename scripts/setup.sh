#!/usr/bin/env bash
# Installs the project's dependencies into the current Python environment, CPU build of torch first
# (an unpinned torch would pull a multi-GB CUDA build). On GPU clusters install the CUDA torch wheel that matches
# your driver instead (see README), then `pip install -r requirements.txt`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -r requirements.txt
python -m pip install -q -r requirements-eval.txt   # lm-eval: eval_tasks, evaluate_lm.py and their tests
# Build DeepSpeed's CPU Adam once (offload_optimizer=cpu; ~1 min), cached in ~/.cache/torch_extensions.
python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
