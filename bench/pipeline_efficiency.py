"""Pipeline efficiency: p stages against what p cores deliver, next to the 1F1B bound m / (m + p - 1).

For p = 2 and 4 stages (one process each, one thread each) and m = 2, 4, 8, 16 micro-batches per step:
- pipeline: tokens/s of the p-stage engine on one global batch of m micro-batches;
- cores: p copies of the one-stage engine (one process, one thread each) training the same global batch at the
  same time, their tokens/s summed: what p cores really deliver at this load;
- efficiency = (pipeline / cores) / (m / (m + p - 1)): 1.0 is a schedule that loses nothing beyond the bubble.
Then where each stage's time goes: compute (forward, backward), optimizer (gradient reduction and step), send,
receive (a receive waits for the peer: bubble, imbalance and transfer), batch loading and the engine's own
overhead (the rest of the wall time: schedule and Python between instructions).

The model is sized so that a stage's micro-batch costs at least 50 ms on one thread, and split so that stages do
equal work (the LM head weighs about one decoder layer here, so it counts as one).

  python bench/pipeline_efficiency.py [--steps 3] [--stages 2 4] [--micro-batches 2 4 8 16]
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
from common import machine_note, random_micro_batches, run_config, spawn, train_step_seconds  # noqa: E402

MODEL = dict(vocab_size=3072, hidden_size=256, intermediate_size=688, num_hidden_layers=7, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024)
SEQ_LENGTH, MICRO_BATCH = 128, 4
# Decoder layers per stage: the LM head (with norm and loss) on the last stage counts as one decoder layer.
PARTITIONS = {1: [7], 2: [4, 3], 4: [2, 2, 2, 1]}
CATEGORIES = {"ForwardPass": "compute", "BackwardPass": "compute", "OptimizerStep": "optimizer",
              "ReduceGrads": "optimizer", "ReduceTiedGrads": "optimizer", "SendActivation": "send",
              "SendGrad": "send", "RecvActivation": "receive", "RecvGrad": "receive", "LoadMicroBatch": "load"}


def overrides(num_stages, micro_batches):
    return [f"num_stages={num_stages}", "precision=fp32", "zero_stage=0", f"seq_length={SEQ_LENGTH}",
            f"micro_batch_size={MICRO_BATCH}", f"gradient_accumulation_steps={micro_batches}",
            f"partition={PARTITIONS[num_stages]}", "lr_scheduler=constant"]


def build_engine(num_stages, micro_batches):
    import deepspeed
    from transformers import LlamaConfig

    from models.pipeline import build_pipeline_module
    from training.config import deepspeed_config
    from training.distributed import parallel_topology

    cfg = run_config(overrides(num_stages, micro_batches))
    module = build_pipeline_module(LlamaConfig(**MODEL), parallel_topology(num_stages),
                                   partition=list(cfg.partition))
    ds_config, _ = deepspeed_config(cfg, total_steps=10**6)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=ds_config)
    return engine


def time_instructions(engine):
    """Wrap the engine's instruction handlers (the 1F1B schedule's steps) with timers; returns {category: s}."""
    spent = {}
    timed_map = {}
    for instruction, handler in engine._INSTRUCTION_MAP.items():
        category = CATEGORIES.get(instruction.__name__, "other")

        def timed(self, *args, _handler=handler, _category=category, **kwargs):
            start = time.perf_counter()
            _handler(self, *args, **kwargs)
            spent[_category] = spent.get(_category, 0.0) + time.perf_counter() - start
        timed_map[instruction] = timed
    engine._INSTRUCTION_MAP = timed_map
    return spent


def timed_steps(engine, batches, steps, barrier):
    """Warm up, wait for the others, then time steps; returns (median step seconds, time by category)."""
    engine.train_batch(batches)
    spent = time_instructions(engine)
    barrier()
    durations = train_step_seconds(engine, batches, steps)
    return statistics.median(durations), {k: v / steps for k, v in spent.items()}, sum(durations) / steps


def pipeline_worker(rank, num_stages, micro_batch_counts, steps, out_dir):
    import torch.distributed as dist

    from training.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    results = {}
    for micro_batches in micro_batch_counts:
        engine = build_engine(num_stages, micro_batches)
        batches = random_micro_batches(MODEL["vocab_size"], SEQ_LENGTH, MICRO_BATCH, seed=rank)
        median, spent, mean = timed_steps(engine, batches, steps, dist.barrier)
        results[micro_batches] = {"stage": engine.stage_id, "step_s": median, "mean_step_s": mean, "spent": spent}
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
        median, _, _ = timed_steps(engine, batches, steps, file_barrier)
        results[micro_batches] = median
    with open(out_path, "w") as f:
        json.dump(results, f)


def run_pipeline(num_stages, micro_batch_counts, steps):
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(pipeline_worker, num_stages, num_stages, micro_batch_counts, steps, out_dir)
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(num_stages)]
    return {m: [rank[str(m)] for rank in ranks] for m in micro_batch_counts}


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


def report(num_stages, micro_batch_counts, pipeline, replicas):
    tokens = lambda m: m * MICRO_BATCH * SEQ_LENGTH  # noqa: E731
    rows = []
    for m in micro_batch_counts:
        cores = sum(tokens(m) / seconds for seconds in replicas[m])
        piped = tokens(m) / max(rank["step_s"] for rank in pipeline[m])
        bound = m / (m + num_stages - 1)
        rows.append((m, cores, piped, piped / cores, bound, piped / cores / bound))
        print(f"p={num_stages} m={m:>2}  {num_stages} cores {cores:>7.0f} tok/s  pipeline {piped:>7.0f} tok/s  "
              f"ratio {piped / cores:.3f}  1F1B bound {bound:.3f}  efficiency vs bound {piped / cores / bound:.3f}",
              flush=True)
    return rows


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
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ready-dir", help=argparse.SUPPRESS)
    parser.add_argument("--copies", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        spawn(replica_worker, 1, args.micro_batches, args.steps, args.out, args.ready_dir, args.copies)
        return
    print(f"model: {MODEL}; seq_length {SEQ_LENGTH}, micro-batch {MICRO_BATCH}, fp32, 1 thread per process; "
          f"median of {args.steps} steps after one warm-up")
    for num_stages in args.stages:
        replicas = run_replicas(num_stages, args.micro_batches, args.steps)
        pipeline = run_pipeline(num_stages, args.micro_batches, args.steps)
        report(num_stages, args.micro_batches, pipeline, replicas)
        for m in args.micro_batches:
            print_breakdown(num_stages, m, pipeline[m])
    print(machine_note())


if __name__ == "__main__":
    main()
