"""A DPO step against an SFT step on the same pairs, and the reference pass's cost, through the trainer's engine.

The same model (bench/layer_overhead.py's shape: 4 layers of hidden 256, 8k vocabulary), the same random pairs
(prompt 64 tokens, responses of 96 and 64, seq_length 256), one stage, fp32, one thread:
  - sft: chosen and rejected as two SFT rows each (the loss on the responses), micro-batch of 4 rows;
  - dpo: objective=dpo, micro-batch of 2 pairs (the same 4 rows), reference log-probabilities given;
  - reference pass: evaluation/reference.py's forward-only pass over the step's pairs (on an engine of its own,
    as in the trainer, where it runs before any training step).
Speed: tokens/s of each step (rows x seq_length per second), median of interleaved rounds in one process. Memory: the
peak RSS rise of one step after a warm-up step, each in a fresh process (freed memory stays with the allocator).

  python bench/preference.py [--rounds 8]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MIB, bench_parser, machine_note, parse_args, peak_rss_rise, spawn, timed_rounds  # noqa: E402
from layer_overhead import MODEL, SMOKE_MODEL, init_like_transformers  # noqa: E402

SEQ_LENGTH, PROMPT, RESPONSES, PAIRS_PER_MICRO_BATCH, MICRO_BATCHES, PAIRS = 256, 64, (96, 64), 2, 4, 64


def random_pairs(vocab_size, count, seed=0):
    """Rows of preference pairs as data/packing.py's cut_pairs makes them."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        prompt = torch.randint(0, vocab_size, (PROMPT,), generator=generator).tolist()
        pair = {}
        for side, length in zip(("chosen", "rejected"), RESPONSES):
            response = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
            pair[f"{side}_input_ids"] = prompt + response
            pair[f"{side}_labels"] = [-100] * PROMPT + response
        pairs.append(pair)
    return pairs


def build(objective, config):
    """(engine, micro-batch maker) of one stage for `objective` (sft or dpo), as training/loop.py builds it."""
    import deepspeed

    from common import run_config
    from data.collator import collate_causal_lm, collate_preference
    from deepspeed_internals.access import skip_gradient_allreduce
    from models.pipeline import build_pipeline_module
    from models.preference import PreferenceSettings
    from training.deepspeed_config import deepspeed_config
    from cluster.distributed import parallel_topology

    rows_per_micro_batch = 2 * PAIRS_PER_MICRO_BATCH
    micro_batch = PAIRS_PER_MICRO_BATCH if objective == "dpo" else rows_per_micro_batch
    cfg = run_config(["num_stages=1", "precision=fp32", "zero_stage=0", f"seq_length={SEQ_LENGTH}",
                      f"micro_batch_size={micro_batch}", f"gradient_accumulation_steps={MICRO_BATCHES}",
                      "lr_scheduler=constant"])
    module = build_pipeline_module(config, parallel_topology(1), loss_chunk_tokens=cfg.loss_chunk_tokens,
                                   objective=PreferenceSettings(objective), row_layout="padded")
    init_like_transformers(module, config)
    ds_config, _ = deepspeed_config(cfg, total_steps=10**6)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=ds_config)
    skip_gradient_allreduce(engine)

    def micro_batch_of(pairs):
        if objective == "dpo":
            return collate_preference([dict(p, ref_chosen_logps=-300.0, ref_rejected_logps=-200.0) for p in pairs],
                                      SEQ_LENGTH, 0)
        rows = [{"input_ids": p[f"{side}_input_ids"], "labels": p[f"{side}_labels"]}
                for p in pairs for side in ("chosen", "rejected")]
        return collate_causal_lm(rows, SEQ_LENGTH, 0)
    return engine, micro_batch_of


def step(engine, micro_batch_of, pairs):
    """One training step over `pairs` (MICRO_BATCHES micro-batches), the loss the global batch's mean."""
    from training.token_mean import global_loss_units, token_mean_micro_batches
    micro_batches = [micro_batch_of(pairs[k:k + PAIRS_PER_MICRO_BATCH])
                     for k in range(0, PAIRS_PER_MICRO_BATCH * MICRO_BATCHES, PAIRS_PER_MICRO_BATCH)]
    engine.train_batch(iter(token_mean_micro_batches(engine, micro_batches, global_loss_units(engine, micro_batches))))


def reference_pass(engine, pairs):
    """evaluation/reference.py's pass over `pairs` (the DPO engine's weights)."""
    from types import SimpleNamespace

    from evaluation.reference import compute_reference
    cfg = SimpleNamespace(micro_batch_size=PAIRS_PER_MICRO_BATCH, gradient_accumulation_steps=MICRO_BATCHES,
                          seq_length=SEQ_LENGTH)
    compute_reference(engine, pairs, len(pairs), cfg, pad_id=0)


def speed(rank, fields, rounds):
    """{contender: [seconds of each round]}: the SFT and DPO steps and the reference pass, after a warm-up."""
    from transformers import LlamaConfig

    from cluster.distributed import init_distributed
    init_distributed(timeout_minutes=30)
    config = LlamaConfig(**fields)
    pairs = random_pairs(config.vocab_size, PAIRS)
    contenders = {objective: build(objective, config) for objective in ("sft", "dpo")}
    work = {objective: (lambda e=engine, m=make: step(e, m, pairs)) for objective, (engine, make) in
            contenders.items()}
    # its own engine: DeepSpeed's eval_batch adds to the loss total of a train_batch before it, unreset
    reference_engine, _ = build("dpo", config)
    work["reference pass"] = lambda: reference_pass(reference_engine, pairs[:PAIRS_PER_MICRO_BATCH * MICRO_BATCHES])
    for function in work.values():  # warm-up
        function()
    return timed_rounds(work, rounds)


def memory(rank, fields, objective):
    """The peak RSS rise of a step, after a warm-up step, in MiB."""
    from transformers import LlamaConfig

    from cluster.distributed import init_distributed
    init_distributed(timeout_minutes=30)
    config = LlamaConfig(**fields)
    pairs = random_pairs(config.vocab_size, PAIRS)
    engine, make = build(objective, config)
    step(engine, make, pairs)  # warm-up: optimizer state, first-use allocations
    return peak_rss_rise(lambda: step(engine, make, pairs)) / MIB


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    args = parse_args(parser, rounds=1)
    fields = SMOKE_MODEL if args.smoke else MODEL
    times = spawn(speed, 1, fields, args.rounds)[0]
    step_pairs = PAIRS_PER_MICRO_BATCH * MICRO_BATCHES
    tokens = step_pairs * 2 * SEQ_LENGTH
    rates = {name: tokens / statistics.median(values) for name, values in times.items()}
    print(f"{step_pairs} pairs per step ({step_pairs * 2} rows of {SEQ_LENGTH}), one stage, fp32, 1 thread, "
          f"median of {args.rounds} interleaved rounds")
    for name, rate in rates.items():
        spread = f"{min(times[name]):.3f}-{max(times[name]):.3f} s"
        print(f"{name:<16} {rate:>8.0f} tokens/s   {rate / rates['sft']:.3f}x the SFT step   ({spread})")
    print(machine_note())
    for objective in ("sft", "dpo"):
        print(f"{objective}: a step's peak RSS rise {spawn(memory, 1, fields, objective)[0]:.1f} MiB (fresh process, "
              "after a warm-up step)")

if __name__ == "__main__":
    main()
