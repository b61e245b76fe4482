"""Tensor parallelism's activation memory on this CPU machine: sequence parallelism, and recomputing its all-gather.

An activation-heavy config (long sequences on a small model) trains a few steps through the real engine and
DeepSpeed config on 2 processes, one stage x tensor_parallel_size=2, in three variants:
  - sequence_parallel=false: the residual stream, the norms and the column-parallel inputs whole on every rank;
  - sequence_parallel=true: the residual stream on 1/2 of the tokens; each column-parallel group (q/k/v, gate/up,
    LM head) all-gathers its input into a fresh tensor, which backward keeps (full tokens, per layer);
  - sequence_parallel=true, recompute_sequence_gather=true: backward keeps this rank's tokens only and gathers them
    again into the TensorParallel's BufferPool, the one buffer every forward and backward gather reuses;
and, as a reference, the same config on 1 process without tensor parallelism.

Per variant: each rank's peak RSS over the steps minus its RSS before the model was built (MiB), the ratio to the
sequence_parallel=false variant, the memory planner's estimate (planner/memory_plan.py, planner/stage_costs.py)
and measured/planned, tokens/s (median step after the first; noisy on a shared machine), and what the pool held
after the steps with how many gathers went through it (evidence that one buffer serves every call).

Workers run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), as bench/memory_plan_check.py does, so that
RSS follows the tensors alive; --default-malloc measures with glibc's defaults instead.

  python bench/tensor_parallel_memory.py [--steps N] [--no-reference] [--default-malloc]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (FIXED_MMAP_THRESHOLD, MIB, bench_parser, machine_note, parse_args,  # noqa: E402,I001
                    peak_rss_bytes, reset_peak_rss, run_config, spawn, train_step_seconds, trainer_engine)

MODEL = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=2048)
SMOKE_MODEL = dict(MODEL, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)  # --smoke's
RUN = ["num_stages=1", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=2",
       "gradient_accumulation_steps=2"]
BASELINE = "tp2, sequence_parallel=false"
VARIANTS = [  # name, processes, overrides
    ("1 process, no tensor parallelism", 1, ["tensor_parallel_size=1"]),
    (BASELINE, 2, ["tensor_parallel_size=2", "sequence_parallel=false"]),
    ("tp2, sequence parallel, gather kept", 2, ["tensor_parallel_size=2", "sequence_parallel=true",
                                                 "recompute_sequence_gather=false"]),
    ("tp2, sequence parallel, gather recomputed", 2, ["tensor_parallel_size=2", "sequence_parallel=true",
                                                       "recompute_sequence_gather=true"]),
]


def count_gathers(parallel):
    """Wrap this rank's TensorParallel.gather_tokens to count its calls, pooled or fresh, and the distinct storages
    the pooled ones wrote into."""
    stats = {"pooled_calls": 0, "pooled_storages": set(), "fresh_calls": 0, "fresh_bytes": 0}
    gather = parallel.gather_tokens

    def counted(x, pooled):
        out = gather(x, pooled)
        if pooled:
            stats["pooled_calls"] += 1
            stats["pooled_storages"].add(out.untyped_storage().data_ptr())
        else:
            stats["fresh_calls"] += 1
            stats["fresh_bytes"] += out.numel() * out.element_size()
        return out

    parallel.gather_tokens = counted
    return stats


def measure(rank, fields, overrides, steps):
    """One rank: train `steps` steps; its peak RSS over them minus the RSS before the model, its step times, the
    pool's buffers and the gather counts."""
    import torch.distributed as dist

    # The same seed on every rank: a tensor-parallel group must see the same micro-batches.
    engine, batches, before_model = trainer_engine(fields, overrides, steps)
    module = engine.module
    gathers = count_gathers(module.parallel)
    reset_peak_rss()
    step_seconds = train_step_seconds(engine, batches, steps)
    peak = peak_rss_bytes() - before_model
    pool = [{"name": name, "dtype": str(dtype).replace("torch.", ""), "elements": buffer.numel(),
             "bytes": buffer.numel() * buffer.element_size()}
            for (name, dtype, _), buffer in module.parallel.buffers._buffers.items()]
    dist.destroy_process_group()
    return {"measured": peak, "step_seconds": step_seconds, "pool": pool,
            "gathers": {**gathers, "pooled_storages": len(gathers["pooled_storages"])}}


def run_variant(fields, overrides, processes, steps):
    from transformers import LlamaConfig

    from planner.memory_plan import memory_plan
    from training.run_spec import plan_spec

    cfg = run_config(RUN + overrides)
    ranks = spawn(measure, processes, fields, RUN + overrides, steps)
    rows = memory_plan(plan_spec(cfg, processes, LlamaConfig(**fields)))
    tokens_per_step = cfg.micro_batch_size * cfg.seq_length * cfg.gradient_accumulation_steps
    timed = ranks[0]["step_seconds"][1:] or ranks[0]["step_seconds"]  # the first step warms up
    return {"ranks": ranks, "planned": rows[0]["memory_bytes"], "planned_activations": rows[0]["activation_bytes"],
            "tokens_per_s": tokens_per_step / statistics.median(timed)}


def describe_pool(result):
    rank0 = result["ranks"][0]
    gathers = rank0["gathers"]
    pool = ", ".join(f"{b['name']} {b['dtype']} {b['elements']:,} elements ({b['bytes'] / MIB:.1f} MiB)"
                     for b in rank0["pool"]) or "empty"
    return (f"pool on rank 0: {pool}; gathers over the steps: {gathers['pooled_calls']} into the pool "
            f"({gathers['pooled_storages']} distinct storage{'s' if gathers['pooled_storages'] != 1 else ''}), "
            f"{gathers['fresh_calls']} into fresh tensors ({gathers['fresh_bytes'] / MIB:.0f} MiB allocated)")


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3, help="training steps per variant (default 3)")
    parser.add_argument("--no-reference", action="store_true", help="skip the 1-process reference")
    parser.add_argument("--default-malloc", action="store_true", help="measure with glibc's default mmap threshold")
    args = parse_args(parser, steps=1, no_reference=True)
    if not args.default_malloc:
        os.environ.update(FIXED_MMAP_THRESHOLD)  # read by each worker's malloc at start-up
    model = SMOKE_MODEL if args.smoke else MODEL
    fields = ", ".join(f"{k}={v}" for k, v in model.items() if k != "max_position_embeddings")
    print(f"model: {fields}; {' '.join(RUN)}; {args.steps} steps; per-rank peak RSS over the steps minus the RSS "
          f"before the model was built", flush=True)
    results = {}
    for name, processes, overrides in VARIANTS:
        if not (args.no_reference and processes == 1):
            results[name] = run_variant(model, overrides, processes, args.steps)
    baseline = max(rank["measured"] for rank in results[BASELINE]["ranks"])
    print(f"{'variant':<42} {'per-rank MiB':>13} {'vs sp=false':>11} {'planned MiB':>11} {'meas/plan':>9} "
          f"{'tokens/s':>8}")
    for name, result in results.items():
        measured = [rank["measured"] for rank in result["ranks"]]
        print(f"{name:<42} {' / '.join(f'{m / MIB:.0f}' for m in measured):>13} {max(measured) / baseline:>11.3f} "
              f"{result['planned'] / MIB:>11.0f} {max(measured) / result['planned']:>9.3f} "
              f"{result['tokens_per_s']:>8.0f}")
    for name, result in results.items():
        if name.startswith("tp2"):
            print(f"{name}: {describe_pool(result)}")
    print(machine_note())


if __name__ == "__main__":
    main()
