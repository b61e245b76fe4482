#!/usr/bin/env bash
# The whole story on 2 CPU processes, in a few minutes, nothing downloaded:
# set up, make a tiny LLaMA and its tokenizer from a generated corpus, convert it, train 2 pipeline stages
# (loss printed as it goes down), score it with lm-eval before, during and after training, export to Hugging Face
# format, and generate with plain transformers. After the installs its output fits on one screen.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
WORK=work/tiny
say() { printf '== %s\n' "$*"; }
if [ -e "$WORK" ]; then rm -rf "$WORK"; fi
say "demo: a tiny LLaMA made here, converted, trained as 2 pipeline stages on 2 CPU processes, scored and exported"
python scripts/make_tiny_llama.py --output_dir "$WORK"
python convert2ckpt.py --model_name_or_path "$WORK/hf" --output_dir "$WORK/ds"
# lm-eval tasks over held-out lines (docs/evaluation.md): scored on the untrained model's export (step 0), in the
# training loop every eval_steps, and on the final checkpoint's export again (the same numbers as the loop's): which of
# 2-4 continuations comes next (accuracy rises) and the held-out lines' bits per byte and word perplexity (they fall)
python scripts/make_demo_tasks.py --text "$WORK/eval.txt" --output_dir "$WORK/tasks"
TASKS="$WORK/tasks/demo_cloze.yaml,$WORK/tasks/demo_lines.yaml"
# evaluate_lm.py prints lm-eval's table, then where the scores went: the last line is enough here
SCORE=(python evaluate_lm.py --tasks "$TASKS" --max_length 128 --dtype float32 --bootstrap_iters 0 --output_dir "$WORK/run")
say "lm-eval on the untrained model (its Hugging Face export)"
HF_DATASETS_OFFLINE=1 "${SCORE[@]}" --ckpt_dir "$WORK/ds" | tail -n 1
say "training: deepspeed --num_gpus 2 trainer_pipe.py -cp conf -cn tiny (60 steps; evaluation and lm-eval every 20)"
HF_DATASETS_OFFLINE=1 deepspeed --quiet --num_gpus 2 trainer_pipe.py -cp conf -cn tiny logging_steps=10 \
    "eval_tasks=[$TASKS]"
say "lm-eval on the trained model's export"
HF_DATASETS_OFFLINE=1 "${SCORE[@]}" --ckpt_dir "$WORK/run" | tail -n 1
say "the scores before, during and after training (lm_eval.jsonl)"
python -c "import json
for r in map(json.loads, open('$WORK/run/lm_eval.jsonl')):
    print(f'step {r[\"step\"]:2d} {r[\"source\"]:9s} cloze accuracy {r[\"lm_eval/demo_cloze/acc\"]:.3f}, '
          f'held-out lines: {r[\"lm_eval/demo_lines/bits_per_byte\"]:.3f} bits per byte, '
          f'word perplexity {r[\"lm_eval/demo_lines/word_perplexity\"]:.1f}')"
say "generating from the export with plain transformers"
python scripts/generate.py --model_dir "$WORK/run/hf" --prompt "The big sailor"
say "results in $WORK/run"
echo "loss curve: $WORK/run/loss.png   lm-eval scores: $WORK/run/lm_eval.png   metrics: $WORK/run/metrics.jsonl"
echo "the Hugging Face export: $WORK/run/hf   checkpoints: $WORK/run/global_step30, global_step60"
