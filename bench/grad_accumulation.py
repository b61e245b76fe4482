"""How far a step's accumulated gradient drifts when micro-batch gradients are summed in bf16 (what ZeRO-1 does with a
bf16 model today: each backward adds into the bf16 .grad) against an fp32 buffer (`data_types.grad_accum_dtype:
fp32`, DeepSpeed's bf16 optimizer), both measured against the same micro-batch gradients summed in fp64. The model
and its backward are bf16 throughout; only the sum differs, so the figure is the accumulation's own error.

    python bench/grad_accumulation.py [--micro-batches 8 64] [--hidden 256] [--layers 4]
"""
import torch

from common import bench_parser, machine_note, parse_args


def relative_error(accumulated, reference):
    """||accumulated - reference|| / ||reference|| over every parameter's gradient, in fp64."""
    difference = sum(float((a.double() - r).pow(2).sum()) for a, r in zip(accumulated, reference))
    return (difference / sum(float(r.pow(2).sum()) for r in reference)) ** 0.5


def accumulation_errors(model, micro_batches, seq, vocab, seed):
    """(bf16 error, fp32 error) of one step of `micro_batches` micro-batches of 2 random sequences."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums = {dtype: [torch.zeros_like(p, dtype=dtype) for p in params]
            for dtype in (torch.bfloat16, torch.float32, torch.float64)}
    generator = torch.Generator().manual_seed(seed)
    for _ in range(micro_batches):
        input_ids = torch.randint(0, vocab, (2, seq), generator=generator)
        (model(input_ids=input_ids, labels=input_ids).loss / micro_batches).backward()
        for p, *accumulators in zip(params, *sums.values()):
            for accumulator in accumulators:
                accumulator.add_(p.grad.to(accumulator.dtype))
            p.grad = None
    reference = sums[torch.float64]
    return relative_error(sums[torch.bfloat16], reference), relative_error(sums[torch.float32], reference)


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3)
    args = parse_args(parser, micro_batches=[2], hidden=32, layers=1, seq=16, seeds=1)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    vocab = 2048
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    print(f"{machine_note()}\nLLaMA hidden {args.hidden}, {args.layers} layers, vocabulary {vocab}, bf16 weights and "
          f"backward; micro-batches of 2 x {args.seq} tokens; {args.seeds} steps (seeds) each")
    for micro_batches in args.micro_batches:
        errors = [accumulation_errors(model, micro_batches, args.seq, vocab, seed) for seed in range(args.seeds)]
        bf16, fp32 = (max(e[i] for e in errors) for i in range(2))
        print(f"  {micro_batches:3d} micro-batches: relative error against fp64, worst of {args.seeds}: bf16 sum "
              f"{bf16:.2e}, fp32 sum {fp32:.2e} ({bf16 / fp32:,.0f}x closer)")


if __name__ == "__main__":
    main()
