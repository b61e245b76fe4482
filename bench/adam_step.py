"""torch's AdamW step, per-tensor loop (`fused: false`) against its fused kernel (`fused: true`, conf/base.yaml's
default): wall time of one step over SmolLM2-135M's parameters (bench/trainer_profile.py's smollm2 shape, random
gradients, one thread, steps interleaved) and the peak RSS one step adds on a single 50M-element fp32 tensor (a fresh
process per variant): the two fp32 temporaries the planner counts for the unfused step (planner/training_state.py).

  python bench/adam_step.py [--rounds 10] [--workload smollm2] [--elements 50000000]
"""
import statistics

import torch

from common import MIB, bench_parser, machine_note, parse_args, peak_rss_rise, spawn, timed_rounds, spread
from trainer_profile import WORKLOADS

VARIANTS = {"per-tensor loop": False, "fused": True}


def parameters_of(workload):
    from transformers import LlamaConfig, LlamaForCausalLM
    fields, _, _ = WORKLOADS[workload]
    parameters = list(LlamaForCausalLM(LlamaConfig(**fields)).parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter) * 1e-3
    return parameters


def step_rise_mib(rank, fused, elements):
    """Peak RSS one AdamW step adds over a tensor whose moments already exist (the second step onwards)."""
    parameter = torch.nn.Parameter(torch.zeros(elements))
    parameter.grad = torch.ones(elements)
    optimizer = torch.optim.AdamW([parameter], fused=fused)
    optimizer.step()
    return peak_rss_rise(optimizer.step) / MIB


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="smollm2", help="the parameters' shape")
    parser.add_argument("--elements", type=int, default=50_000_000, help="the peak RSS step's tensor")
    args = parse_args(parser, rounds=1, workload="tiny", elements=100_000)
    torch.set_num_threads(1)
    parameters = parameters_of(args.workload)
    optimizers = {name: torch.optim.AdamW(parameters, lr=1e-6, fused=fused) for name, fused in VARIANTS.items()}
    for optimizer in optimizers.values():  # allocates the moments
        optimizer.step()
    seconds = timed_rounds({name: optimizer.step for name, optimizer in optimizers.items()}, args.rounds)
    count = sum(p.numel() for p in parameters)
    print(f"AdamW step over {count / 1e6:.1f}M parameters ({args.workload}), 1 thread, {args.rounds} interleaved "
          f"rounds (ms):")
    for name, values in seconds.items():
        print(f"  {name:16} {spread([1e3 * v for v in values], 1)}")
    loop, fused = (statistics.median(seconds[name]) for name in VARIANTS)
    print(f"  fused speed-up: {loop / fused:.2f}x")
    rises = {fused: spawn(step_rise_mib, 1, fused, args.elements)[0] for fused in VARIANTS.values()}
    print(f"peak RSS added by one step on a {args.elements / 1e6:g}M-element fp32 tensor "
          f"({args.elements * 4 / MIB:.0f} MiB): per-tensor loop {rises[False]:.0f} MiB, fused {rises[True]:.0f} MiB")
    print(machine_note())

if __name__ == "__main__":
    main()
