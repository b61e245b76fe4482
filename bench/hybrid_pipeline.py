"""Two pipeline stages end to end, a small Qwen3.5 (Gated DeltaNet hybrid: three linear-attention layers to one
gated full-attention layer) beside a LLaMA of the same width and depth: the trainer's engine (training/loop.py,
random weights, fp32) on 2 processes of this CPU, one thread each, training steps of random packed-free rows.

Per step: the wall seconds (both ranks started together) and each rank's CPU seconds (time.process_time), in
interleaved rounds (bench/common.py in_rounds), and tokens/s = micro-batches x rows x seq_length / wall seconds.
The two models share hidden size, layers, attention heads, MLP width and vocabulary; the hybrid's linear attention
has --key-heads key heads and --value-heads value heads of --head-dim features.

  python bench/hybrid_pipeline.py [--hidden 256] [--layers 8] [--seq 512] [--micro-batches 4] [--rounds 5]
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, machine_note, parse_args, run_config, spawn  # noqa: E402

VOCAB, HEADS, KV_HEADS = 1024, 8, 2


def configs(args):
    from transformers import LlamaConfig, Qwen3_5TextConfig
    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=args.seq, tie_word_embeddings=False)
    head_dim = args.hidden // HEADS
    return {"llama": LlamaConfig(**common),
            "qwen3_5": Qwen3_5TextConfig(**common, head_dim=head_dim, linear_num_key_heads=args.key_heads,
                                         linear_num_value_heads=args.value_heads, linear_key_head_dim=args.head_dim,
                                         linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=4,
                                         full_attention_interval=4)}


def worker(rank, args_dict):
    import argparse

    import torch
    import torch.distributed as dist

    from cluster.distributed import init_distributed
    from training.loop import build_engine
    from training.run_spec import plan_spec
    args = argparse.Namespace(**args_dict)
    init_distributed(timeout_minutes=10)
    cfg = run_config(["num_stages=2", "precision=fp32", "zero_stage=0", f"seq_length={args.seq}",
                      "micro_batch_size=1", f"gradient_accumulation_steps={args.micro_batches}",
                      "partition=uniform", "lr_scheduler=constant", "data.format=pretokenized"])
    engines = {name: build_engine(plan_spec(cfg, 2, config), 10 ** 6, layer_loader=None)[0]
               for name, config in configs(args).items()}
    generator = torch.Generator().manual_seed(0)

    def batches():
        ids = torch.randint(0, VOCAB, (1, args.seq), generator=generator)
        return iter([((ids, torch.ones_like(ids), torch.arange(args.seq)[None]), ids)] * args.micro_batches)

    def step(engine):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        engine.train_batch(batches())
        dist.barrier()
        return time.perf_counter() - wall, time.process_time() - cpu

    for engine in engines.values():  # warm-up: the first step's allocations
        step(engine)
    results = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name in list(engines)[::1 if round_index % 2 == 0 else -1]:
            results[name].append(step(engines[name]))
    return results


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_args(parser, layers=4, seq=128, micro_batches=2, rounds=1, hidden=64)
    ranks = spawn(worker, 2, vars(args))
    tokens = args.micro_batches * args.seq
    print(machine_note())
    print(f"2 stages, hidden {args.hidden}, {args.layers} layers, {HEADS} heads ({KV_HEADS} key/value), seq "
          f"{args.seq}, {args.micro_batches} micro-batches of 1 row, fp32; {args.rounds} interleaved rounds")
    rates = {}
    for name in ranks[0]:
        walls = [max(rank[name][i][0] for rank in ranks) for i in range(args.rounds)]
        cpus = [[rank[name][i][1] for i in range(args.rounds)] for rank in ranks]
        rates[name] = [tokens / wall for wall in walls]
        print(f"{name:8s} tokens/s median {statistics.median(rates[name]):,.0f} (min {min(rates[name]):,.0f}, max "
              f"{max(rates[name]):,.0f}); CPU s a step: stage 0 {statistics.median(cpus[0]):.3f}, stage 1 "
              f"{statistics.median(cpus[1]):.3f}")
    ratios = [q / l for q, l in zip(rates["qwen3_5"], rates["llama"])]
    print(f"qwen3_5 / llama tokens/s per round: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f})")


if __name__ == "__main__":
    main()
