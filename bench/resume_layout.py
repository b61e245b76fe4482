"""Resuming a ~1B-parameter training checkpoint, optimizer state included, on another parallel layout.

1. Makes a random LLaMA of about 1B parameters (bench/load_memory.py's), converts it, and trains it 1 step on
   2 pipeline stages (fp32; ZeRO-0, as ZeRO-1's extra fp32 copy would not fit this machine's 24 GiB): the trainer
   writes its checkpoint (layer files and per-layer optimizer state:
   16 bytes per parameter).
2. Resumes that checkpoint on 2 processes, each building its share and loading the whole training state through the
   trainer's own path (training/start_point.py: load_start_state): on the layout that wrote it (2 stages), and on another
   (1 stage x tensor parallel 2: every layer's weights, master weights and moments cut in halves). Per rank: wall
   time and the peak RSS while loading above the RSS before it (the engine built and its optimizer state allocated,
   as from the first step on), against the largest layer's optimizer-state file (the bound: a small factor of it).
3. Against copying the same bytes (read every file of the checkpoint, write them elsewhere), and DeepSpeed's
   ds_to_universal.py on the same checkpoint (its offline conversion to a layout-free form).

  python bench/resume_layout.py [--work-dir DIR]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MIB, ROOT, machine_note, peak_rss_bytes, reset_peak_rss, rss_bytes, spawn  # noqa: E402
from load_memory import COPY_SHARDS, MODEL, make_model, parameter_count, timed_subprocess  # noqa: E402

from tests.launch import launch_trainer  # noqa: E402

WRITE_LAYOUT = dict(num_stages=2, zero_stage=0)
RESUME_LAYOUTS = {"2 stages (as written)": WRITE_LAYOUT,
                  "1 stage x tensor parallel 2": dict(num_stages=1, tensor_parallel_size=2, zero_stage=0)}


def run_overrides(work, **layout):
    values = dict(model_name_or_path=os.path.join(work, "ds"), train_file=os.path.join(work, "train.jsonl"),
                  eval_file="null", output_dir=os.path.join(work, "run"), seq_length=32, micro_batch_size=1,
                  gradient_accumulation_steps=1, max_steps=1, precision="fp32", learning_rate=1e-4, warmup_steps=1,
                  export_hf="false", save_total_limit=1, **{"data.format": "pretokenized"}, **layout)
    return [f"{key}={value}" for key, value in values.items()]


def write_data(work):
    with open(os.path.join(work, "train.jsonl"), "w") as f:
        for row in range(8):
            f.write(json.dumps({"input_ids": [(row * 31 + i) % MODEL["vocab_size"] for i in range(32)]}) + "\n")


def resume_rank(rank, overrides, out_dir, name):
    """Build this rank's engine for the layout, then time and measure loading the whole training state."""
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from checkpoints.optimizer_state import MasterState
    from cluster.distributed import init_distributed
    from training.loop import build_engine
    from training.start_point import load_start_state
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
    with open(os.path.join(out_dir, f"{name}{rank}.json"), "w") as f:
        json.dump({"create_seconds": create_seconds, "seconds": seconds, "before": before, "peak": peak_rss_bytes()},
                  f)
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_files(tag_dir):
    return {name: os.path.getsize(os.path.join(tag_dir, name)) for name in os.listdir(tag_dir)}


def bench_copy(tag_dir, work):
    """Read every file of the checkpoint and write the same bytes (the page cache as warm as for the resumes)."""
    copy_dir = os.path.join(work, "copy")
    script = COPY_SHARDS.replace('name.endswith(".safetensors")', 'name.endswith(".pt")')
    for _ in range(2):
        shutil.rmtree(copy_dir, ignore_errors=True)
        os.makedirs(copy_dir)
        seconds, peak = timed_subprocess([sys.executable, "-c", script, tag_dir, copy_dir])
    shutil.rmtree(copy_dir)
    return seconds, peak


def bench_universal(tag_dir, work):
    """DeepSpeed's offline conversion of the same checkpoint; (seconds, peak RSS) or the error it stops with."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
               "--output_folder", os.path.join(work, "universal"), "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
    try:
        return timed_subprocess(command)
    except RuntimeError as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        return lines[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", help="where the model and its checkpoint go (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        spawn(make_model, 1, os.path.join(work, "hf"))
        subprocess.run([sys.executable, "convert2ckpt.py", "--model_name_or_path", os.path.join(work, "hf"),
                        "--output_dir", os.path.join(work, "ds")], cwd=ROOT, check=True, capture_output=True)
        shutil.rmtree(os.path.join(work, "hf"))
        write_data(work)
        trained = launch_trainer(2, run_overrides(work, **WRITE_LAYOUT), config="base", timeout=3600)
        if trained.returncode:
            raise RuntimeError(trained.stdout[-3000:] + trained.stderr[-3000:])
        tag_dir = os.path.join(work, "run", "global_step1")
        files = checkpoint_files(tag_dir)
        total = sum(files.values())
        largest_state = max(size for name, size in files.items() if name.endswith("optim_states.pt"))
        print(f"model: {parameter_count() / 1e9:.2f}B parameters, trained 1 step on 2 stages, fp32; "
              f"checkpoint {total / MIB:.0f} MiB in {len(files)} files, largest layer optimizer state "
              f"{largest_state / MIB:.0f} MiB", flush=True)

        out_dir = os.path.join(work, "figures")
        os.makedirs(out_dir)
        for index, (label, layout) in enumerate(RESUME_LAYOUTS.items()):
            spawn(resume_rank, 2, run_overrides(work, resume=tag_dir, **layout), out_dir, f"layout{index}-")
            ranks = [json.load(open(os.path.join(out_dir, f"layout{index}-{rank}.json"))) for rank in range(2)]
            added = [(r["peak"] - r["before"]) for r in ranks]
            print(f"resume on {label}: load {max(r['seconds'] for r in ranks):.1f} s (after allocating the optimizer "
                  f"state, {max(r['create_seconds'] for r in ranks):.1f} s); per-rank peak RSS while loading "
                  f"+{[round(a / MIB) for a in added]} MiB above the built engine and its optimizer state "
                  f"({[round(r['before'] / MIB) for r in ranks]} MiB) = {max(added) / largest_state:.2f}x the largest "
                  f"layer's optimizer-state file", flush=True)
        copy_seconds, copy_peak = bench_copy(tag_dir, work)
        print(f"copying the same {total / MIB:.0f} MiB (read, write): {copy_seconds:.1f} s, peak RSS "
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
