#!/usr/bin/env bash
# The whole story on 2 CPU processes, in a few minutes, nothing downloaded:
# set up, make a tiny LLaMA and its tokenizer from a generated corpus, convert it, train 2 pipeline stages
# (loss printed as it goes down), export to Hugging Face format, and generate with plain transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
WORK=work/tiny
if [ -e "$WORK" ]; then echo "replacing the previous demo in $WORK"; rm -rf "$WORK"; fi
python scripts/make_tiny_llama.py --output_dir "$WORK"
python convert2ckpt.py --model_name_or_path "$WORK/hf" --output_dir "$WORK/ds"
deepspeed --num_gpus 2 trainer_pipe.py -cp conf -cn tiny
python scripts/generate.py --model_dir "$WORK/run/hf" --prompt "The big sailor"
echo "loss curve: $WORK/run/loss.png   metrics: $WORK/run/metrics.jsonl   checkpoints: $WORK/run"
