"""torch's AdamW step, per-tensor loop (`fused: false`) against its fused kernel (`fused: true`, conf/base.yaml's
default): wall time of one step over SmolLM2-135M's parameters (bench/trainer_profile.py's smollm2 shape, random
gradients, one thread, steps interleaved) and the peak RSS one step adds on a single 50M-element fp32 tensor (a fresh
process per variant): the two fp32 temporaries the planner counts for the unfused step (planner/training_state.py).

  python bench/adam_step.py [--rounds 10]
"""
import argparse
import statistics
import time

from common import MIB, machine_note, peak_rss_bytes, reset_peak_rss, spawn
from trainer_profile import WORKLOADS

import torch

VARIANTS = {"per-tensor loop": False, "fused": True}


def smollm2_parameters():
    from transformers import LlamaConfig, LlamaForCausalLM
    fields, _, _ = WORKLOADS["smollm2"]
    parameters = list(LlamaForCausalLM(LlamaConfig(**fields)).parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter) * 1e-3
    return parameters


def step_rise_mib(rank, fused, elements, out):
    """Peak RSS one AdamW step adds over a tensor whose moments already exist (the second step onwards)."""
    torch.set_num_threads(1)
    parameter = torch.nn.Parameter(torch.zeros(elements))
    parameter.grad = torch.ones(elements)
    optimizer = torch.optim.AdamW([parameter], fused=fused)
    optimizer.step()
    reset_peak_rss()
    before = peak_rss_bytes()
    optimizer.step()
    out[fused] = (peak_rss_bytes() - before) / MIB


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    parameters = smollm2_parameters()
    optimizers = {name: torch.optim.AdamW(parameters, lr=1e-6, fused=fused) for name, fused in VARIANTS.items()}
    seconds = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds + 1):  # round 0 allocates the moments: left out
        for name, optimizer in (optimizers.items() if round_ % 2 else reversed(optimizers.items())):
            start = time.perf_counter()
            optimizer.step()
            if round_:
                seconds[name].append(time.perf_counter() - start)
    count = sum(p.numel() for p in parameters)
    print(f"AdamW step over {count / 1e6:.1f}M parameters, 1 thread, {args.rounds} interleaved rounds (ms, median "
          f"and range):")
    for name, values in seconds.items():
        print(f"  {name:16} {statistics.median(values) * 1e3:7.1f}  ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})")
    loop, fused = (statistics.median(seconds[name]) for name in VARIANTS)
    print(f"  fused speed-up: {loop / fused:.2f}x")
    import multiprocessing
    rises = multiprocessing.Manager().dict()
    for fused in VARIANTS.values():
        spawn(step_rise_mib, 1, fused, 50_000_000, rises)
    print(f"peak RSS added by one step on a 50M-element fp32 tensor ({50e6 * 4 / MIB:.0f} MiB): per-tensor loop "
          f"{rises[False]:.0f} MiB, fused {rises[True]:.0f} MiB")
    print(machine_note())


if __name__ == "__main__":
    main()
