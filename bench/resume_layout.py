"""Resuming a ~1B-parameter training checkpoint, optimizer state included, on another parallel layout.

1. Makes a random LLaMA of about 1B parameters (bench/load_memory.py's), converts it, and trains it 1 step on
   2 pipeline stages (fp32; ZeRO-0, as ZeRO-1's extra fp32 copy would not fit this machine's 24 GiB): the trainer
   writes its checkpoint (layer files and per-layer optimizer state:
   16 bytes per parameter).
2. Resumes that checkpoint on 2 processes, each building its share and loading the whole training state through the
   trainer's own path (training/resume.py: load_start_state): on the layout that wrote it (2 stages), and on another
   (1 stage x tensor parallel 2: every layer's weights, master weights and moments cut in halves). Per rank: wall
   time and the peak RSS while loading above the RSS before it (the engine built and its optimizer state allocated,
   as from the first step on), against the largest layer's optimizer-state file (the bound: a small factor of it).
3. Against copying the same bytes (read every file of the checkpoint, write them elsewhere), and DeepSpeed's
   ds_to_universal.py on the same checkpoint (its offline conversion to a layout-free form).

  python bench/resume_layout.py [--work-dir DIR]
"""
import json
import os
import shutil
import tempfile
import time

from common import (MIB, ROOT, bench_parser, launch_training, machine_note, parse_args, peak_rss_bytes,  # noqa: E402
                    reset_peak_rss, rss_bytes, run_python, spawn)
from load_memory import (MODEL, SMOKE_MODEL, SMOKE_SHARD_SIZE, SHARD_SIZE, copy_seconds, make_model,  # noqa: E402
                         parameter_count)

WRITE_LAYOUT = dict(num_stages=2, zero_stage=0)
RESUME_LAYOUTS = {"2 stages (as written)": WRITE_LAYOUT,
                  "1 stage x tensor parallel 2": dict(num_stages=1, tensor_parallel_size=2, zero_stage=0)}


def run_overrides(work, **layout):
    values = dict(model_name_or_path=os.path.join(work, "ds"), train_file=os.path.join(work, "train.jsonl"),
                  eval_file="null", output_dir=os.path.join(work, "run"), seq_length=32, micro_batch_size=1,
                  gradient_accumulation_steps=1, max_steps=1, precision="fp32", learning_rate=1e-4, warmup_steps=1,
                  export_hf="false", save_total_limit=1, **{"data.format": "pretokenized"}, **layout)
    return [f"{key}={value}" for key, value in values.items()]


def write_data(work, vocab_size):
    with open(os.path.join(work, "train.jsonl"), "w") as f:
        for row in range(8):
            f.write(json.dumps({"input_ids": [(row * 31 + i) % vocab_size for i in range(32)]}) + "\n")


def resume_rank(rank, overrides):
    """Build this rank's engine for the layout, then time and measure loading the whole training state."""
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from checkpoints.optimizer_state import MasterState
    from cluster.distributed import init_distributed
    from training.loop import build_engine
    from training.resume import load_start_state
    from training.run_spec import run_spec

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = compose(config_name="base", overrides=overrides)
    spec = run_spec(cfg, 2)
    init_distributed(spec.cfg.dist_timeout_minutes)
    engine, _ = build_engine(spec, total_steps=2)
    dist.barrier()
    start = time.perf_counter()
    MasterState(engine)  # Adam's moments exist from the first step on: allocated here, before the load
    create_seconds = time.perf_counter() - start
    dist.barrier()
    reset_peak_rss()
    before, start = rss_bytes(), time.perf_counter()
    load_start_state(engine, spec)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    dist.barrier()
    dist.destroy_process_group()
    return {"create_seconds": create_seconds, "seconds": seconds, "before": before, "peak": peak}


def checkpoint_files(tag_dir):
    return {name: os.path.getsize(os.path.join(tag_dir, name)) for name in os.listdir(tag_dir)}


def bench_universal(tag_dir, work):
    """DeepSpeed's offline conversion of the same checkpoint; (seconds, peak RSS) or the error it stops with."""
    result, peak, seconds = run_python(["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                                        "--output_folder", os.path.join(work, "universal"), "--num_extract_workers",
                                        "1", "--num_merge_workers", "1"], check=False)
    if result.returncode:
        return [line for line in result.stderr.splitlines() if line.strip()][-1]
    return seconds, peak


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--work-dir", help="where the model and its checkpoint go (default: a temporary directory)")
    args = parse_args(parser)
    fields, shard_size = (SMOKE_MODEL, SMOKE_SHARD_SIZE) if args.smoke else (MODEL, SHARD_SIZE)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        spawn(make_model, 1, os.path.join(work, "hf"), fields, shard_size)
        run_python(["convert2ckpt.py", "--model_name_or_path", os.path.join(work, "hf"), "--output_dir",
                    os.path.join(work, "ds")])
        shutil.rmtree(os.path.join(work, "hf"))
        write_data(work, fields["vocab_size"])
        launch_training(2, run_overrides(work, **WRITE_LAYOUT))
        tag_dir = os.path.join(work, "run", "global_step1")
        files = checkpoint_files(tag_dir)
        total = sum(files.values())
        largest_state = max(size for name, size in files.items() if name.endswith("optim_states.pt"))
        print(f"model: {parameter_count(fields) / 1e9:.2f}B parameters, trained 1 step on 2 stages, fp32; "
              f"checkpoint {total / MIB:.0f} MiB in {len(files)} files, largest layer optimizer state "
              f"{largest_state / MIB:.0f} MiB", flush=True)
        for label, layout in RESUME_LAYOUTS.items():
            ranks = spawn(resume_rank, 2, run_overrides(work, resume=tag_dir, **layout))
            added = [(r["peak"] - r["before"]) for r in ranks]
            print(f"resume on {label}: load {max(r['seconds'] for r in ranks):.1f} s (after allocating the optimizer "
                  f"state, {max(r['create_seconds'] for r in ranks):.1f} s); per-rank peak RSS while loading "
                  f"+{[round(a / MIB) for a in added]} MiB above the built engine and its optimizer state "
                  f"({[round(r['before'] / MIB) for r in ranks]} MiB) = {max(added) / largest_state:.2f}x the largest "
                  f"layer's optimizer-state file", flush=True)
        copied_seconds, copy_peak = copy_seconds(tag_dir, ".pt", work)  # the page cache as warm as for the resumes
        print(f"copying the same {total / MIB:.0f} MiB (read, write): {copied_seconds:.1f} s, peak RSS "
              f"{copy_peak / MIB:.0f} MiB", flush=True)
        universal = bench_universal(tag_dir, work)
        if isinstance(universal, tuple):
            print(f"DeepSpeed ds_to_universal.py on it: {universal[0]:.1f} s, peak RSS {universal[1] / MIB:.0f} MiB "
                  f"(then a load on the new layout)")
        else:
            print(f"DeepSpeed ds_to_universal.py on it does not run: {universal}")
    print(machine_note())

if __name__ == "__main__":
    main()
