"""What summing a bf16 run's micro-batch gradients in fp32 costs (grad_accum_dtype=fp32, the default, against bf16):
step time and peak memory through the trainer's engine (training/loop.py build_engine: ZeRO-1, torch's fused
AdamW, the chunked loss), one process, 1 stage. Its accuracy: bench/grad_accumulation.py.

Each measurement is a fresh process (its peak memory is its own): the model is built, --warm-up steps run, then
--steps timed steps. Rounds alternate the two settings, in reverse order every other round, so that the machine's
drift falls on both. Peak memory: on a GPU torch's peak allocated bytes over the run (the model included); on the
CPU the peak RSS over the run minus the RSS before the model, with glibc's mmap threshold fixed so that RSS follows
the live tensors (bench/memory_plan_check.py). Step time: the median of the timed steps, and of the rounds.

    python bench/grad_accumulation_cost.py [--rounds 3] [--micro-batches 8] [--shape small|1b|tiny]
    DS_ACCELERATOR=cuda python bench/grad_accumulation_cost.py --shape 1b       # on one GPU
"""
import argparse
import json
import os
import statistics

from common import (FIXED_MMAP_THRESHOLD, MIB, bench_parser, in_rounds, machine_note, parse_args,  # noqa: E402
                    peak_rss_bytes, round_ratios, run_python, single_rank_env, spread, train_step_seconds,
                    trainer_engine)

SHAPES = {  # (model, seq_length, micro_batch_size)
    "small": (dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256), 256, 2),
    # TinyLlama-1.1B's shape, as the GPU check's throughput check (tests/gpu/test_one_gpu.py)
    "1b": (dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048), 2048, 4),
    "tiny": (dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32), 32, 2),  # --smoke
}
SUMS = ("bf16", "fp32")


def measure(shape, sums, micro_batches, warm_up, steps):
    """One process: {peak_bytes, step_seconds} of `steps` steps after `warm_up`, gradients summed in `sums`."""
    import torch
    from deepspeed.accelerator import get_accelerator

    model, seq_length, micro_batch = SHAPES[shape]
    engine, batches, before_model = trainer_engine(model, [
        "precision=bf16", "zero_stage=1", f"grad_accum_dtype={sums}", f"seq_length={seq_length}",
        f"micro_batch_size={micro_batch}", f"gradient_accumulation_steps={micro_batches}", "lr_scheduler=constant"],
        warm_up + steps)
    train_step_seconds(engine, batches, warm_up)
    seconds = statistics.median(train_step_seconds(engine, batches, steps))
    on_gpu = get_accelerator().device_name() == "cuda"
    peak = torch.cuda.max_memory_allocated() if on_gpu else peak_rss_bytes() - before_model
    return {"peak_bytes": peak, "step_seconds": seconds}


def measured_in_a_fresh_process(args, sums):
    result, _, _ = run_python([__file__, "--measure", sums, "--shape", args.shape, "--micro-batches",
                               args.micro_batches, "--warm-up", args.warm_up, "--steps", args.steps],
                              single_rank_env(**FIXED_MMAP_THRESHOLD))
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-up", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--measure", choices=SUMS, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parse_args(parser, shape="tiny", micro_batches=2, rounds=1, warm_up=1, steps=1)
    if args.measure:
        print(json.dumps(measure(args.shape, args.measure, args.micro_batches, args.warm_up, args.steps)))
        return
    results = in_rounds({sums: lambda s=sums: measured_in_a_fresh_process(args, s) for sums in SUMS}, args.rounds)
    model, seq_length, micro_batch = SHAPES[args.shape]
    print(f"{machine_note()}; DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', 'cpu')}\n{args.shape} LLaMA "
          f"(hidden {model['hidden_size']}, {model['num_hidden_layers']} layers), bf16, ZeRO-1, 1 stage, "
          f"{args.micro_batches} micro-batches of {micro_batch} x {seq_length}; {args.rounds} rounds, "
          f"{args.steps} timed steps after {args.warm_up}")
    for sums in SUMS:
        seconds = [r["step_seconds"] for r in results[sums]]
        peaks = [r["peak_bytes"] / MIB for r in results[sums]]
        print(f"  sums in {sums}: step {spread(seconds)} s, peak {spread(peaks, 0)} MiB")
    extra = [(f["peak_bytes"] - b["peak_bytes"]) / MIB for f, b in zip(results["fp32"], results["bf16"])]
    fp32, bf16 = ([r["step_seconds"] for r in results[sums]] for sums in ("fp32", "bf16"))
    print(f"  fp32 / bf16 step time: {round_ratios(fp32, bf16)}; fp32 - bf16 peak per round: "
          f"{', '.join(f'{e:+,.0f}' for e in extra)} MiB")


if __name__ == "__main__":
    main()
