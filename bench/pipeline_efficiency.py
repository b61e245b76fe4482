"""Pipeline efficiency: p stages against what p cores deliver, for each pipeline schedule (1F1B, zero_bubble),
next to the 1F1B bound m / (m + p - 1) and the schedule simulator's prediction.

For p stages (one process each, one thread each; default p = 2) and m micro-batches per step (default 4, 8, 16):
- pipeline: tokens/s of the p-stage engine (the trainer's: models/pipeline.py, training/pipeline_engine.py) on one
  global batch of m micro-batches, under each schedule;
- cores: p copies of the one-stage engine (one process, one thread each) training the same global batch at the
  same time, their tokens/s summed: what p cores really deliver at this load;
- ratio = pipeline / cores; efficiency = ratio / (m / (m + p - 1)): 1.0 is 1F1B losing nothing beyond its bubble;
- predicted: bench/schedule_simulator.py's step time from the F, B, W times measured in this run per stage (ForwardPass,
  BackwardPass and BackwardWeightPass instructions; under 1F1B the backward is B + W) plus the optimizer's time,
  as a ratio, beside the measured one;
- peak RSS per stage during the timed steps (each schedule and m in fresh processes), and its rise over the RSS
  before them (activations and gradients). Every process runs with glibc's mmap threshold fixed, as
  bench/memory_plan_check.py does, so that RSS follows the live tensors rather than heap fragments.
Then where each stage's time goes: compute (forward, backward), optimizer (gradient reduction and step), send,
receive (a receive waits for the peer: bubble, imbalance and transfer), batch loading and the engine's own
overhead (the rest of the wall time: schedule and Python between instructions).

The model is sized so that a stage's micro-batch costs at least 50 ms on one thread, and split so that stages do
equal work (the LM head weighs about one decoder layer here, so it counts as one).

  python bench/pipeline_efficiency.py [--steps 3] [--stages 2] [--micro-batches 4 8 16] [--schedules 1f1b zero_bubble]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (machine_note, peak_rss_bytes, random_micro_batches, reset_peak_rss, rss_bytes,  # noqa: E402
                    run_config, spawn, train_step_seconds)
from memory_plan_check import FIXED_MMAP_THRESHOLD  # noqa: E402
from schedule_simulator import predict  # noqa: E402

MODEL = dict(vocab_size=3072, hidden_size=256, intermediate_size=688, num_hidden_layers=7, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024)
SEQ_LENGTH, MICRO_BATCH = 128, 4
# Decoder layers per stage: the LM head (with norm and loss) on the last stage counts as one decoder layer.
PARTITIONS = {1: [7], 2: [4, 3], 4: [2, 2, 2, 1]}
CATEGORIES = {"ForwardPass": "compute", "BackwardPass": "compute", "BackwardWeightPass": "compute",
              "OptimizerStep": "optimizer",
              "ReduceGrads": "optimizer", "ReduceTiedGrads": "optimizer", "SendActivation": "send",
              "SendGrad": "send", "RecvActivation": "receive", "RecvGrad": "receive", "LoadMicroBatch": "load"}


def overrides(num_stages, micro_batches, schedule):
    return [f"num_stages={num_stages}", "precision=fp32", "zero_stage=0", f"seq_length={SEQ_LENGTH}",
            f"micro_batch_size={MICRO_BATCH}", f"gradient_accumulation_steps={micro_batches}",
            f"partition={PARTITIONS[num_stages]}", "lr_scheduler=constant", f"pipeline_schedule={schedule}"]


def build_engine(num_stages, micro_batches, schedule="1f1b"):
    import deepspeed
    from transformers import LlamaConfig

    from models.pipeline import build_pipeline_module
    from training.config import deepspeed_config
    from training.distributed import parallel_topology
    from training.pipeline_engine import use_zero_bubble

    cfg = run_config(overrides(num_stages, micro_batches, schedule))
    module = build_pipeline_module(LlamaConfig(**MODEL), parallel_topology(num_stages),
                                   partition=list(cfg.partition))
    ds_config, _ = deepspeed_config(cfg, total_steps=10**6)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=ds_config)
    return use_zero_bubble(engine) if cfg.pipeline_schedule == "zero_bubble" else engine


def time_instructions(engine):
    """Wrap the engine's instruction handlers with timers; returns ({category: s}, {instruction name: s})."""
    spent, by_instruction = {}, {}
    timed_map = {}
    for instruction, handler in engine._INSTRUCTION_MAP.items():
        category = CATEGORIES.get(instruction.__name__, "other")

        def timed(self, *args, _handler=handler, _category=category, _name=instruction.__name__, **kwargs):
            start = time.perf_counter()
            _handler(self, *args, **kwargs)
            seconds = time.perf_counter() - start
            spent[_category] = spent.get(_category, 0.0) + seconds
            by_instruction[_name] = by_instruction.get(_name, 0.0) + seconds
        timed_map[instruction] = timed
    engine._INSTRUCTION_MAP = timed_map
    return spent, by_instruction


def timed_steps(engine, batches, steps, barrier):
    """Warm up, wait for the others, then time steps; returns (median step seconds, time by category, mean step
    seconds, time by instruction, peak RSS and RSS before the steps)."""
    engine.train_batch(batches)
    spent, by_instruction = time_instructions(engine)
    barrier()
    reset_peak_rss()
    start_rss = rss_bytes()
    durations = train_step_seconds(engine, batches, steps)
    return (statistics.median(durations), {k: v / steps for k, v in spent.items()}, sum(durations) / steps,
            {k: v / steps for k, v in by_instruction.items()}, peak_rss_bytes(), start_rss)


def pipeline_worker(rank, num_stages, micro_batch_counts, steps, out_dir, schedule):
    import torch.distributed as dist

    from training.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    results = {}
    for micro_batches in micro_batch_counts:
        engine = build_engine(num_stages, micro_batches, schedule)
        batches = random_micro_batches(MODEL["vocab_size"], SEQ_LENGTH, MICRO_BATCH, seed=rank)
        median, spent, mean, by_instruction, peak, start_rss = timed_steps(engine, batches, steps, dist.barrier)
        results[micro_batches] = {"stage": engine.stage_id, "step_s": median, "mean_step_s": mean, "spent": spent,
                                  "instructions": by_instruction, "peak_rss": peak, "start_rss": start_rss}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def replica_worker(rank, micro_batch_counts, steps, out_path, ready_dir, copies):
    """One of the copies of the one-stage loop; copies start timing together (a file barrier)."""
    from training.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    results = {}
    for micro_batches in micro_batch_counts:
        engine = build_engine(1, micro_batches)
        batches = random_micro_batches(MODEL["vocab_size"], SEQ_LENGTH, MICRO_BATCH)

        def file_barrier():
            open(os.path.join(ready_dir, f"{micro_batches}-{os.getpid()}"), "w").close()
            while len([n for n in os.listdir(ready_dir) if n.startswith(f"{micro_batches}-")]) < copies:
                time.sleep(0.01)
        median = timed_steps(engine, batches, steps, file_barrier)[0]
        results[micro_batches] = median
    with open(out_path, "w") as f:
        json.dump(results, f)


def run_pipeline(num_stages, micro_batch_counts, steps, schedule):
    """{m: [result per rank]}; fresh processes for each m, so that each peak RSS is that run's alone."""
    results = {}
    for m in micro_batch_counts:
        with tempfile.TemporaryDirectory() as out_dir:
            spawn(pipeline_worker, num_stages, num_stages, [m], steps, out_dir, schedule)
            results[m] = [json.load(open(os.path.join(out_dir, f"rank{r}.json")))[str(m)] for r in range(num_stages)]
    return results


def run_replicas(copies, micro_batch_counts, steps):
    """copies one-stage loops at once, each its own process and world; returns {m: [step seconds per copy]}."""
    with tempfile.TemporaryDirectory() as work:
        outs = [os.path.join(work, f"copy{i}.json") for i in range(copies)]
        command = [sys.executable, os.path.abspath(__file__), "--replica", "--steps", str(steps), "--ready-dir", work,
                   "--copies", str(copies), "--micro-batches", *map(str, micro_batch_counts)]
        procs = [subprocess.Popen(command + ["--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for out in outs]
        if any(proc.wait() for proc in procs):
            raise RuntimeError("a replica failed; run it alone: " + " ".join(command + ["--out", outs[0]]))
        results = [json.load(open(out)) for out in outs]
    return {m: [result[str(m)] for result in results] for m in micro_batch_counts}


def stage_times(ranks, m):
    """Measured F, B, W seconds per micro-batch of each stage, and the step's time outside the schedule."""
    times, overhead = [], 0.0
    for rank in sorted(ranks, key=lambda r: r["stage"]):
        spent = rank["instructions"]
        times.append({"F": spent.get("ForwardPass", 0.0) / m, "B": spent.get("BackwardPass", 0.0) / m,
                      "W": spent.get("BackwardWeightPass", 0.0) / m})
        overhead = max(overhead, rank["spent"].get("optimizer", 0.0) + rank["spent"].get("load", 0.0))
    return times, overhead


def report(num_stages, micro_batch_counts, pipelines, replicas):
    """One row per m and schedule: measured ratio against the cores, the 1F1B bound, the simulator's prediction."""
    tokens = lambda m: m * MICRO_BATCH * SEQ_LENGTH  # noqa: E731
    rows = []
    for m in micro_batch_counts:
        cores = sum(tokens(m) / seconds for seconds in replicas[m])
        bound = m / (m + num_stages - 1)
        for schedule, pipeline in pipelines.items():
            step = max(rank["step_s"] for rank in pipeline[m])
            times, overhead = stage_times(pipeline[m], m)
            predicted = predict(num_stages, m, times, overhead)[schedule][0]
            ratio, predicted_ratio = tokens(m) / step / cores, tokens(m) / predicted / cores
            rows.append((m, schedule, ratio, predicted_ratio))
            print(f"p={num_stages} m={m:>2} {schedule:<12} {num_stages} cores {cores:>6.0f} tok/s  pipeline "
                  f"{tokens(m) / step:>6.0f} tok/s  ratio {ratio:.3f} (simulated {predicted_ratio:.3f}; step "
                  f"{step:.3f} s, simulated {predicted:.3f} s, {100 * (predicted / step - 1):+.1f}%)  1F1B bound "
                  f"{bound:.3f}  efficiency vs bound {ratio / bound:.3f}", flush=True)
    return rows


def print_memory(num_stages, micro_batch_counts, pipelines):
    print("peak RSS per stage during the timed steps, MiB (rise over the RSS before them):")
    for m in micro_batch_counts:
        for schedule, pipeline in pipelines.items():
            stages = sorted(pipeline[m], key=lambda r: r["stage"])
            print(f"  p={num_stages} m={m:>2} {schedule:<12} " + "  ".join(
                f"stage {r['stage']}: {r['peak_rss'] / 2**20:.0f} (+{(r['peak_rss'] - r['start_rss']) / 2**20:.0f})"
                for r in stages))


def print_fbw(num_stages, m, pipelines):
    for schedule, pipeline in pipelines.items():
        times, overhead = stage_times(pipeline[m], m)
        print(f"  measured per micro-batch, {schedule}: " + "; ".join(
            f"stage {s}: F {1e3 * t['F']:.1f} B {1e3 * t['B']:.1f} W {1e3 * t['W']:.1f} ms"
            for s, t in enumerate(times)) + f"; optimizer and loads {1e3 * overhead:.0f} ms/step")


def print_breakdown(num_stages, m, ranks):
    names = ["compute", "optimizer", "send", "receive", "load"]
    names += ["other"] if any("other" in rank["spent"] for rank in ranks) else []
    print(f"where the time goes, p={num_stages} m={m} (% of mean step wall time per stage):")
    print("  stage " + "".join(f"{name:>10}" for name in names) + f"{'engine':>10}")
    for rank in sorted(ranks, key=lambda r: r["stage"]):
        wall = rank["mean_step_s"]
        spent = dict(rank["spent"])
        engine = wall - sum(spent.values())
        print(f"  {rank['stage']:>5} " + "".join(f"{100 * spent.get(name, 0) / wall:>9.1f}%" for name in names)
              + f"{100 * engine / wall:>9.1f}%")
    print(f"  the bubble alone idles each stage {100 * (num_stages - 1) / (m + num_stages - 1):.1f}% of a step")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zero_bubble"], choices=["1f1b", "zero_bubble"])
    parser.add_argument("--default-malloc", action="store_true", help="glibc's default mmap threshold")
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ready-dir", help=argparse.SUPPRESS)
    parser.add_argument("--copies", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        spawn(replica_worker, 1, args.micro_batches, args.steps, args.out, args.ready_dir, args.copies)
        return
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = FIXED_MMAP_THRESHOLD  # read by each worker's malloc at start-up
    print(f"model: {MODEL}; seq_length {SEQ_LENGTH}, micro-batch {MICRO_BATCH}, fp32, 1 thread per process; "
          f"median of {args.steps} steps after one warm-up")
    for num_stages in args.stages:
        replicas = run_replicas(num_stages, args.micro_batches, args.steps)
        pipelines = {schedule: run_pipeline(num_stages, args.micro_batches, args.steps, schedule)
                     for schedule in args.schedules}
        report(num_stages, args.micro_batches, pipelines, replicas)
        print_memory(num_stages, args.micro_batches, pipelines)
        for m in args.micro_batches:
            for schedule, pipeline in pipelines.items():
                print(f"{schedule}:", end=" ")
                print_breakdown(num_stages, m, pipeline[m])
            print_fbw(num_stages, m, pipelines)
    print(machine_note())


if __name__ == "__main__":
    main()
