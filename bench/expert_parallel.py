"""Expert parallelism on the CPU: a training step of 2 stages x 2 data-parallel ranks with each sparse layer's
experts split over the 2 (expert_parallel_size=2) against the same run with every expert on both (replicated), at
Qwen3-30B-A3B's routing shape at a small width (64 experts, top-8, every layer sparse), the same global batch on the
same 4 one-thread processes: CPU seconds per step (the 4 ranks' together, time.process_time) and each rank's expert
weights. Both engines are the trainer's (training/loop.py build_engine: ZeRO-1, fp32, clipping), built in one launch,
their steps interleaved in rounds, so the noise of a shared machine falls on both alike.

    python bench/expert_parallel.py [--rounds 5] [--steps 2]
"""
import time

from common import (bench_parser, in_rounds, machine_note, parse_args, round_ratios, spawn, spread, steps_together,
                    trainer_engine)

LAYOUTS = {"experts replicated": 1, "expert parallel 2": 2}  # name: expert_parallel_size
SIZES = {"full": dict(hidden_size=256, num_experts=64, moe_intermediate_size=128, seq_length=256),
         "smoke": dict(hidden_size=32, num_experts=8, moe_intermediate_size=16, seq_length=16)}


def model_config(size):
    from transformers import Qwen3MoeConfig
    shape = SIZES[size]
    return Qwen3MoeConfig(vocab_size=2048, hidden_size=shape["hidden_size"], num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=shape["hidden_size"] // 8,
                          num_experts=shape["num_experts"], num_experts_per_tok=8,
                          moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True,
                          max_position_embeddings=4096, output_router_logits=True)


def worker(rank, size, rounds, steps):
    import torch
    engines = {}
    for name, experts in LAYOUTS.items():
        torch.manual_seed(0)
        engine, batches, _ = trainer_engine(model_config(size), [
            "num_stages=2", "zero_stage=1", "precision=fp32", f"seq_length={SIZES[size]['seq_length']}",
            "micro_batch_size=2", "gradient_accumulation_steps=4", "lr_scheduler=constant", "max_grad_norm=1.0",
            "partition=uniform", f"expert_parallel_size={experts}"], 10**6)
        engines[name] = (engine, batches)
    expert_bytes = {name: sum(p.nbytes for p in engine.module.parameters() if hasattr(p, "expert_slice"))
                    for name, (engine, _) in engines.items()}
    for engine, batches in engines.values():  # warm-up
        engine.train_batch(batches)
    seconds = in_rounds({name: lambda e=engine, b=batches: steps_together(e, lambda: b, steps, time.process_time)
                         for name, (engine, batches) in engines.items()}, rounds)
    torch.distributed.destroy_process_group()
    return {name: {"cpu_s": seconds[name], "expert_bytes": expert_bytes[name]} for name in engines}


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", choices=SIZES, default="full")
    args = parse_args(parser, size="smoke", rounds=1, steps=1)
    ranks = spawn(worker, 4, args.size, args.rounds, args.steps)
    shape = SIZES[args.size]
    print(f"2 stages x 2 data-parallel, 4 processes x 1 thread, {shape['num_experts']} experts top-8, hidden "
          f"{shape['hidden_size']}, seq {shape['seq_length']}, 2 x 4 micro-batches per rank, ZeRO-1 fp32, "
          f"{args.rounds} interleaved rounds of {args.steps} steps; {machine_note()}")
    totals = {name: [sum(rank[name]["cpu_s"][i] for rank in ranks) for i in range(args.rounds)] for name in LAYOUTS}
    for name in LAYOUTS:
        print(f"  {name:<20} CPU s per step (4 ranks) {spread(totals[name])}   expert weights per rank "
              f"{ranks[0][name]['expert_bytes'] / 2**20:.1f} MiB")
    replicated, split = LAYOUTS
    print(f"expert parallel 2 / replicated: CPU s per step {round_ratios(totals[split], totals[replicated])}, "
          f"expert weights per rank {ranks[0][split]['expert_bytes'] / ranks[0][replicated]['expert_bytes']:.3f}x")


if __name__ == "__main__":
    main()
