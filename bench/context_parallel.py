"""Context parallelism on the CPU: per-rank activation memory and tokens/s of 1 stage x context 2 against the same 2
processes holding whole sequences (1 stage x 2 data-parallel), the same global batch on the same cores.

Both layouts are built in one launch of 2 processes (gloo, 1 thread each) and their steps interleaved, so the noise
of a shared machine falls on both alike. Activation memory: the bytes autograd keeps for backward over one
micro-batch's forward on one rank (unique storages, saved-tensor hooks, the weights left out), which is what the
split divides.

    python bench/context_parallel.py [--seq 4096] [--rounds 5] [--steps 2]
"""

import torch

from common import (bench_parser, in_rounds, parse_args, round_ratios, saved_activation_bytes, spawn, spread,
                    steps_together)

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


def worker(rank, seq, rounds, steps):
    import deepspeed

    from models.loss import split_micro_batch
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
        batches = [split_micro_batch(module.context, micro_batch(seq, config.vocab_size, seed=replica * 100 + i))
                   for i in range(GLOBAL_SEQUENCES // replicas)]
        engines[name] = (engine, module, batches)
    activations = {name: saved_activation_bytes(module, batches[0]) for name, (_, module, batches) in engines.items()}
    for engine, _, batches in engines.values():  # warm-up
        engine.train_batch(iter(batches))
    seconds = in_rounds({name: lambda e=engine, b=batches: steps_together(e, lambda: iter(b), steps)
                         for name, (engine, _, batches) in engines.items()}, rounds)
    torch.distributed.destroy_process_group()
    return {name: {"activation_bytes": activations[name], "step_s": seconds[name]} for name in engines}


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parse_args(parser, seq=64, rounds=1, steps=1)
    results = spawn(worker, 2, args.seq, args.rounds, args.steps)[0]
    tokens = GLOBAL_SEQUENCES * args.seq
    whole, split = (results[name] for name in LAYOUTS)
    print(f"1 stage, 2 processes x 1 thread, seq {args.seq}, {GLOBAL_SEQUENCES} sequences per step, fp32, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    for name, result in results.items():
        rates = [tokens / s for s in result["step_s"]]
        print(f"  {name:<36} activations per rank {result['activation_bytes'] / 2**20:8.1f} MiB   tokens/s "
              f"{spread(rates, 0)}")
    print(f"context 2 / whole: activations {split['activation_bytes'] / whole['activation_bytes']:.3f}x, "
          f"tokens/s {round_ratios(whole['step_s'], split['step_s'])}")


if __name__ == "__main__":
    main()
