"""LoRA against full fine-tuning on the same model and cores: training tokens/s, peak memory, checkpoint and adapter
size on disk.

A LLaMA shape with random weights (scripts/make_tiny_llama.py's corpus and tokenizer), fp32, 1 stage on 1 process
with 1 thread, the trainer as a user launches it (`python trainer_pipe.py ...`, the launcher's environment). In
interleaved rounds each contender trains `--steps` steps; tokens/s is the median of the logged per-step figures
after the first, peak memory the process's maximum RSS (os.wait4's ru_maxrss, Python and torch included), and the
sizes those of the final checkpoint's tag directory and of its export (convert2ckpt.py --to_hf: the peft adapter,
or the whole model).

  python bench/lora.py [--hidden 256] [--layers 4] [--rank 16] [--rounds 3] [--steps 8]
"""
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (MIB, bench_parser, demo_model, in_rounds, machine_note, parse_args, run_python,  # noqa: E402
                    single_rank_env)


def run_trainer(work, name, rank, steps, seq_length):
    """One 1-process run; returns (median tokens/s after the first step, peak RSS bytes, checkpoint bytes,
    adapter or export bytes)."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    overrides = [f"model_name_or_path={os.path.join(work, 'ds')}", f"train_file={os.path.join(work, 'train.txt')}",
                 f"output_dir={out}", f"seq_length={seq_length}", "micro_batch_size=4", "gradient_accumulation_steps=4",
                 "precision=fp32", "zero_stage=0", f"max_steps={steps}", "logging_steps=1", "save_total_limit=1",
                 "lr_scheduler=constant", "warmup_steps=1", "export_hf=false", f"lora.rank={rank}",
                 f"data.cache_dir={os.path.join(work, 'cache')}"]
    _, peak, _ = run_python(["trainer_pipe.py", "-cp", "conf", "-cn", "base", *overrides],
                            single_rank_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rates = [r["tokens_per_sec"] for r in map(json.loads, f) if "tokens_per_sec" in r]
    # Exported apart, so that the peak is training's (a LoRA export imports peft).
    run_python(["convert2ckpt.py", "--to_hf", "--ckpt_dir", out, "--output_dir", os.path.join(out, "hf")])
    return (statistics.median(rates[1:]), peak, directory_bytes(os.path.join(out, f"global_step{steps}")),
            directory_bytes(os.path.join(out, "hf")))


def directory_bytes(path):
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parse_args(parser, hidden=32, layers=1, rank=2, seq=32, rounds=1, steps=2)
    work = tempfile.mkdtemp(prefix="bench_lora_")
    try:
        demo_model(work, train_lines=300 if args.smoke else 4000, vocab_size=512, hidden_size=args.hidden,
                   num_hidden_layers=args.layers)
        contenders = {"full": 0, f"lora r{args.rank}": args.rank}

        def trained(name):
            result = run_trainer(work, name.replace(" ", "_"), contenders[name], args.steps, args.seq)
            rate, peak, checkpoint, export = result
            print(f"{name:>9}: {rate:8.0f} tokens/s, peak RSS {peak / MIB:7.0f} MiB, checkpoint "
                  f"{checkpoint / MIB:7.2f} MiB, export {export / MIB:7.2f} MiB", flush=True)
            return result
        full, lora = in_rounds({name: lambda n=name: trained(n) for name in contenders}, args.rounds).values()
        rate_ratio = statistics.median(l[0] / f[0] for f, l in zip(full, lora))
        peak_ratio = statistics.median(l[1] / f[1] for f, l in zip(full, lora))
        print(f"hidden {args.hidden}, {args.layers} layers, vocab 512, seq {args.seq}, 4x4 micro-batches, fp32, "
              f"1 process x 1 thread; LoRA rank {args.rank} on every projection")
        print(f"LoRA / full: tokens/s {rate_ratio:.3f}x (per round "
              f"{', '.join(f'{l[0] / f[0]:.3f}' for f, l in zip(full, lora))}), peak RSS {peak_ratio:.3f}x "
              f"({statistics.median(l[1] for l in lora) / MIB:.0f} vs {statistics.median(f[1] for f in full) / MIB:.0f}"
              f" MiB), checkpoint {lora[-1][2] / MIB:.2f} vs {full[-1][2] / MIB:.2f} MiB, peft adapter "
              f"{lora[-1][3] / MIB:.2f} MiB vs exported model {full[-1][3] / MIB:.2f} MiB")
        print(machine_note())
    finally:
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    main()
