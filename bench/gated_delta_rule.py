"""One linear-attention (Gated DeltaNet) token mixer, forward + backward: the pipeline's (models/linear_attention.py,
its chunked rule with the backward written out: models/gated_delta_rule.py) against transformers' own
Qwen3_5GatedDeltaNet on the same weights and tokens, through transformers' torch path (torch_chunk_gated_delta_rule
and the causal_conv1d fallback: flash-linear-attention and causal-conv1d run on GPUs only), at issue 67's size:
hidden 1,024, 8 key heads and 16 value heads of 128 features, a kernel of 4, one row of 2,048 tokens.

CPU seconds (time.process_time, 1 thread) of each contender in interleaved rounds (bench/common.py), the same random
input and output gradient every round; the outputs and gradients of the two mixers compared once, relative to each
tensor's largest magnitude.

  python bench/gated_delta_rule.py [--tokens 2048] [--hidden 1024] [--key-heads 8] [--value-heads 16]
                                   [--head-dim 128] [--kernel 4] [--rounds 9]
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import bench_parser, machine_note, parse_args, round_ratios, spread, timed_rounds  # noqa: E402


def mixers(args):
    """(transformers' Qwen3_5GatedDeltaNet, the pipeline's GatedDeltaNet), the same weights (transformers' own
    initialisation: A_log over its whole spread)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from models.linear_attention import GatedDeltaNet
    config = Qwen3_5TextConfig(hidden_size=args.hidden, linear_num_key_heads=args.key_heads,
                               linear_num_value_heads=args.value_heads, linear_key_head_dim=args.head_dim,
                               linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=args.kernel,
                               num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    reference = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    pipeline = GatedDeltaNet.from_config(config)
    pipeline.load_state_dict(reference.state_dict())
    return reference, pipeline


def step(mixer, x, grad):
    """Forward and backward of one mixer; its output and its input's gradient."""
    x = x.detach().requires_grad_()
    out = mixer(x)
    out.backward(grad)
    return out.detach(), x.grad


def relative_difference(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--key-heads", type=int, default=8)
    parser.add_argument("--value-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128, help="each key and value head's features")
    parser.add_argument("--kernel", type=int, default=4, help="the causal convolution's kernel")
    parser.add_argument("--rounds", type=int, default=9)
    args = parse_args(parser, tokens=100, hidden=32, key_heads=2, value_heads=4, head_dim=16, rounds=1)
    torch.set_num_threads(1)
    reference, pipeline = mixers(args)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=generator)
    grad = torch.randn(1, args.tokens, args.hidden, generator=generator)
    contenders = {"transformers": lambda: step(reference, x, grad), "pipeline": lambda: step(pipeline, x, grad)}
    for function in contenders.values():  # warm-up
        function()
    seconds = timed_rounds(contenders, args.rounds, clock=time.process_time)
    print(f"one Gated DeltaNet mixer forward + backward, {args.tokens} tokens, hidden {args.hidden}, "
          f"{args.key_heads} key / {args.value_heads} value heads of {args.head_dim}, kernel {args.kernel}, fp32, "
          f"1 thread, {args.rounds} interleaved rounds (CPU s):")
    for name, values in seconds.items():
        print(f"  {name:12} CPU s {spread(values)}")
    print(f"  speed-up over transformers: {round_ratios(seconds['transformers'], seconds['pipeline'])}")
    for mixer in (reference, pipeline):
        mixer.zero_grad()
    (out, x_grad), (ref_out, ref_x_grad) = step(pipeline, x, grad), step(reference, x, grad)
    theirs = dict(reference.named_parameters())
    weight_grad, worst = max((relative_difference(p.grad, theirs[name].grad), name)
                             for name, p in pipeline.named_parameters())
    print(f"  max |pipeline - transformers| / max |transformers|: output {relative_difference(out, ref_out):.2e}, "
          f"input gradient {relative_difference(x_grad, ref_x_grad):.2e}, weight gradients {weight_grad:.2e} "
          f"({worst})")
    print(f"  transformers' median {statistics.median(seconds['transformers']):.3f} CPU s")
    print(machine_note())


if __name__ == "__main__":
    main()
