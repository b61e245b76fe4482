"""Context parallelism on the CPU: per-rank activation memory and tokens/s of 1 stage x context 2 against the same 2
processes holding whole sequences (1 stage x 2 data-parallel), the same global batch on the same cores.

Both layouts are built in one launch of 2 processes (gloo, 1 thread each) and their steps interleaved, so the noise
of a shared machine falls on both alike. Activation memory: the bytes autograd keeps for backward over one
micro-batch's forward on one rank (unique storages, saved-tensor hooks, the weights left out), which is what the
split divides.

    python bench/context_parallel.py [--seq 4096] [--rounds 5] [--steps 2]
"""
import argparse
import os
import statistics
import time

import torch

from common import saved_activation_bytes, spawn  # noqa: E402

LAYOUTS = {"whole sequences (2 data-parallel)": 1, "context 2": 2}  # name: context_parallel_size
GLOBAL_SEQUENCES = 4  # per step, both layouts


def model_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768)


def micro_batch(seq, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (1, seq), generator=generator)
    ones = torch.ones_like(input_ids)
    return (input_ids, ones, torch.arange(seq)[None]), input_ids.clone()


def worker(rank, seq, rounds, steps, out_path):
    import json

    import deepspeed

    from models.pipeline import build_pipeline_module
    from cluster.distributed import init_distributed, parallel_topology

    init_distributed(timeout_minutes=10)
    config = model_config()
    engines = {}
    for name, context in LAYOUTS.items():
        torch.manual_seed(0)
        module = build_pipeline_module(config, parallel_topology(1), context_parallel_size=context, row_layout="full")
        replicas = 2 // context
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GLOBAL_SEQUENCES // replicas,
            "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
        replica, _ = module.context.replica(engine.grid.data_parallel_id, 2)
        batches = [module.context.split_micro_batch(micro_batch(seq, config.vocab_size, seed=replica * 100 + i))
                   for i in range(GLOBAL_SEQUENCES // replicas)]
        engines[name] = (engine, module, batches)
    results = {name: {"activation_bytes": saved_activation_bytes(module, batches[0]), "step_s": []}
               for name, (engine, module, batches) in engines.items()}
    for name, (engine, _, batches) in engines.items():  # warm-up
        engine.train_batch(iter(batches))
    for _ in range(rounds):
        for name, (engine, _, batches) in engines.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                engine.train_batch(iter(batches))
            results[name]["step_s"].append((time.perf_counter() - start) / steps)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    import json
    import tempfile
    out_path = os.path.join(tempfile.mkdtemp(), "results.json")
    spawn(worker, 2, args.seq, args.rounds, args.steps, out_path)
    results = json.load(open(out_path))
    tokens = GLOBAL_SEQUENCES * args.seq
    whole, split = (results[name] for name in LAYOUTS)
    print(f"1 stage, 2 processes x 1 thread, seq {args.seq}, {GLOBAL_SEQUENCES} sequences per step, fp32, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    for name, result in results.items():
        rates = [tokens / s for s in result["step_s"]]
        print(f"  {name:<36} activations per rank {result['activation_bytes'] / 2**20:8.1f} MiB   tokens/s median "
              f"{statistics.median(rates):8.0f} (min {min(rates):.0f}, max {max(rates):.0f})")
    ratios = [w / s for w, s in zip(whole["step_s"], split["step_s"])]
    print(f"context 2 / whole: activations {split['activation_bytes'] / whole['activation_bytes']:.3f}x, "
          f"tokens/s median {statistics.median(ratios):.3f}x (per round {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
