"""One mixture-of-experts block, forward + backward: the pipeline's (models/moe.py) against transformers' own
Qwen3-MoE block on the same weights and tokens, at Qwen3-30B-A3B's routing shape (128 experts, top-8,
norm_topk_prob) at a small width. transformers' block runs its default experts implementation (grouped_mm: sort,
one grouped GEMM per projection, unsort), and as a second reference its eager loop over the experts it hits.

CPU seconds (time.process_time, 1 thread) of each contender in interleaved rounds (bench/common.py), the same
random input and output gradient every round; the outputs and gradients of the two blocks compared once.

  python bench/moe_block.py [--tokens 2048] [--hidden 256] [--expert-size 96] [--experts 128] [--top-k 8] [--rounds 9]
"""
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import bench_parser, machine_note, parse_args, round_ratios, spread, timed_rounds  # noqa: E402


def blocks(args):
    """(transformers' Qwen3-MoE block, eager transformers' block, the pipeline's block), the same weights."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from models.moe import MoEBlock
    config = Qwen3MoeConfig(hidden_size=args.hidden, intermediate_size=args.hidden,
                            moe_intermediate_size=args.expert_size, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, norm_topk_prob=True, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=64,
                            output_router_logits=False)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).model.layers[0].mlp
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,  # its own config: the
                                             experts_implementation="eager").model.layers[0].mlp  # block reads it
    eager.load_state_dict(reference.state_dict())
    pipeline = MoEBlock(config)
    pipeline.load_state_dict(reference.state_dict())
    return reference, eager, pipeline


def step(block, x, grad, pipeline=False):
    """Forward and backward of one block; its input's gradient."""
    x = x.detach().requires_grad_()
    out = block(x, torch.ones(x.shape[:2], dtype=torch.long))[0] if pipeline else block(x)  # every token real
    out.backward(grad)
    return out.detach(), x.grad


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-size", type=int, default=96, help="each expert's intermediate width")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parse_args(parser, tokens=64, hidden=32, expert_size=16, experts=8, top_k=2, rounds=1)
    torch.set_num_threads(1)
    reference, eager, pipeline = blocks(args)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=generator)
    grad = torch.randn(1, args.tokens, args.hidden, generator=generator)
    contenders = {"transformers (grouped_mm)": lambda: step(reference, x, grad),
                  "transformers (eager loop)": lambda: step(eager, x, grad),
                  "pipeline": lambda: step(pipeline, x, grad, pipeline=True)}
    for function in contenders.values():  # warm-up
        function()
    seconds = timed_rounds(contenders, args.rounds, clock=time.process_time)
    print(f"one MoE block forward + backward, {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
          f"{args.expert_size}, top-{args.top_k}, fp32, 1 thread, {args.rounds} interleaved rounds (CPU ms):")
    for name, values in seconds.items():
        print(f"  {name:26} {spread([1e3 * v for v in values], 1)}")
    for name in ("transformers (grouped_mm)", "transformers (eager loop)"):
        print(f"  speed-up over {name}: {round_ratios(seconds[name], seconds['pipeline'])}")
    for block in (reference, pipeline):
        block.zero_grad()
    (out, x_grad), (ref_out, ref_x_grad) = step(pipeline, x, grad, pipeline=True), step(reference, x, grad)
    theirs = dict(reference.named_parameters())
    weight_grad = max((p.grad - theirs[name].grad).abs().max().item() for name, p in pipeline.named_parameters())
    print(f"  max |pipeline - transformers|: output {(out - ref_out).abs().max().item():.2e}, input gradient "
          f"{(x_grad - ref_x_grad).abs().max().item():.2e}, weight gradients {weight_grad:.2e}")
    print(f"  transformers' median {statistics.median(seconds['transformers (grouped_mm)']):.4f} CPU s")
    print(machine_note())


if __name__ == "__main__":
    main()
