"""One mixture-of-experts block, forward and backward, the pipeline's (models/moe.py: the choices sorted by expert,
each projection one grouped GEMM, no host sync) against transformers' own block on the same weights and tokens:
its default (`grouped_mm`) and its loop over the experts the tokens hit (`eager`, a host sync per layer), at
Qwen3-30B-A3B's routing shape at a small width (64 experts, top-8, renormalised; hidden 256, experts 128 wide),
2,048 tokens, fp32, one thread: CPU seconds (time.process_time), contenders interleaved in rounds. Target: the
pipeline's block at ≥ 1.3× transformers' loop.

    python bench/moe_block.py [--rounds 7] [--tokens 2048]
"""
import time

from common import bench_parser, parse_args, round_ratios, spread, timed_rounds

import torch  # noqa: E402

SHAPES = {"full": dict(hidden_size=256, moe_intermediate_size=128, num_experts=64, num_experts_per_tok=8),
          "smoke": dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)}


def blocks(shape):
    """{name: block(hidden [1, T, H]) -> output}, every block holding the same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from models.moe import MoEBlock
    config = Qwen3MoeConfig(norm_topk_prob=True, output_router_logits=False, **SHAPES[shape])
    torch.manual_seed(0)
    theirs = {}
    for implementation in ("grouped_mm", "eager"):
        config._experts_implementation = implementation
        theirs[implementation] = Qwen3MoeSparseMoeBlock(config)
    weights = {key: torch.randn_like(value) * 0.02 for key, value in theirs["grouped_mm"].state_dict().items()}
    for block in theirs.values():
        block.load_state_dict(weights)
    ours = MoEBlock(config)
    ours.load_state_dict(weights)
    return {"pipeline": lambda x: ours(x, torch.ones(x.shape[:2], dtype=torch.long))[0],  # every token real
            "transformers grouped_mm": theirs["grouped_mm"], "transformers eager": theirs["eager"]}


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shape", choices=SHAPES, default="full")
    args = parse_args(parser, shape="smoke", rounds=1, tokens=64)
    torch.set_num_threads(1)
    contenders = blocks(args.shape)
    x = torch.randn(1, args.tokens, SHAPES[args.shape]["hidden_size"], requires_grad=True)
    grad = torch.randn_like(x)
    outputs = {name: block(x) for name, block in contenders.items()}
    worst = max((out - outputs["transformers eager"]).abs().max().item() for out in outputs.values())

    def step(block):
        x.grad = None
        block(x).backward(grad)
    seconds = timed_rounds({name: lambda b=block: step(b) for name, block in contenders.items()}, args.rounds,
                           clock=time.process_time)
    shape = SHAPES[args.shape]
    print(f"{shape['num_experts']} experts top-{shape['num_experts_per_tok']}, hidden {shape['hidden_size']}, "
          f"experts {shape['moe_intermediate_size']} wide, {args.tokens} tokens, fp32, 1 thread, forward + backward, "
          f"{args.rounds} interleaved rounds; outputs within {worst:.1e} of each other")
    for name, values in seconds.items():
        print(f"  {name:<24} CPU s {spread(values, 4)}")
    for name in ("transformers eager", "transformers grouped_mm"):
        print(f"pipeline speed-up over {name}: {round_ratios(seconds[name], seconds['pipeline'])}")


if __name__ == "__main__":
    main()
