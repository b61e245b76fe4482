"""What the attention mask costs: one stage's saved activations and forward + backward time on rows of one padded
document (plain causal attention, no mask tensor: models/attention.py) against the same rows holding two packed
documents (an additive seq x seq mask, kept for backward), at the same length and padding, on the CPU; then the
planner's mask figure at longer sequences.

    python bench/attention_mask.py [--seq 4096] [--rounds 5] [--planned 4096 32768]
"""
import torch

from common import MIB, bench_parser, machine_note, parse_args, saved_activation_bytes, spawn, spread, timed_rounds

PADDING = 0.25  # of each row


def model_config(seq):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq)


def rows(seq, vocab, documents):
    """One row: `documents` documents of equal length, then padding, in the collator's format."""
    real = int(seq * (1 - PADDING))
    lengths = [real // documents] * (documents - 1) + [real - real // documents * (documents - 1)]
    document_ids = torch.cat([torch.full((n,), k + 1) for k, n in enumerate(lengths)] + [torch.zeros(seq - real)])
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(lengths[-1], lengths[-1] + seq - real)])
    input_ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    labels = torch.where(document_ids[None] > 0, input_ids, -100)
    return (input_ids, document_ids[None].long(), positions[None]), labels


def worker(rank, seq, rounds):
    from models.pipeline import build_pipeline_module
    from cluster.distributed import init_distributed, parallel_topology

    init_distributed(timeout_minutes=10)
    config = model_config(seq)
    cases = {"one document + padding (is_causal)": ("padded", rows(seq, config.vocab_size, 1)),
             "two packed documents (mask)": ("packed", rows(seq, config.vocab_size, 2))}
    modules = {}
    for name, (layout, _) in cases.items():  # the run's row layout decides the mask (data/collator.py row_layout)
        torch.manual_seed(0)
        modules[name] = build_pipeline_module(config, parallel_topology(1), loss_chunk_tokens=1024, row_layout=layout)
    saved = {name: saved_activation_bytes(modules[name], batch) for name, (_, batch) in cases.items()}

    def forward_backward(module, inputs, labels):
        module.loss_fn(module(inputs), labels).backward()
        module.zero_grad(set_to_none=True)
    seconds = timed_rounds({name: lambda m=modules[name], b=batch: forward_backward(m, *b)
                            for name, (_, batch) in cases.items()}, rounds)
    torch.distributed.destroy_process_group()
    return {name: {"saved_bytes": saved[name], "seconds": seconds[name]} for name in cases}


def planned_mask_bytes(seq, precision):
    from planner.stage_costs import LayerCosts
    from planner.workload import Workload
    from transformers import LlamaConfig
    costs = LayerCosts(LlamaConfig(max_position_embeddings=seq), Workload(seq_length=seq, precision=precision,
                                                                          document_masks=True))
    return costs.document_mask_bytes


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--planned", type=int, nargs="*", default=[4096, 32768])
    args = parse_args(parser, seq=64, rounds=1, planned=[128])
    results = spawn(worker, 1, args.seq, args.rounds)[0]
    print(f"{machine_note()}\n1 stage of 2 decoder layers (hidden 256), 1 row of {args.seq} tokens "
          f"({PADDING:.0%} padding), fp32, 1 thread, {args.rounds} interleaved rounds")
    for name, result in results.items():
        print(f"  {name:<36} saved activations {result['saved_bytes'] / MIB:8.1f} MiB   forward+backward "
              f"{spread(result['seconds'])} s")
    causal, masked = results.values()
    print(f"  the mask's saved bytes: {(masked['saved_bytes'] - causal['saved_bytes']) / MIB:.1f} MiB "
          f"(seq^2 x 4 bytes = {args.seq ** 2 * 4 / MIB:.1f} MiB)")
    for seq in args.planned:
        print(f"planned, bf16, micro-batch 1, seq {seq}: the mask of packed documents "
              f"{planned_mask_bytes(seq, 'bf16') / MIB:,.0f} MiB per micro-batch in flight; rows of one document: 0")

if __name__ == "__main__":
    main()
