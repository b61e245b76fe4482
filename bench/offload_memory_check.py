"""Optimizer offload: the planner's host figure against measured peak RSS, and CPU Adam's rate, on this CPU.

1. Each stage's process trains a few steps with offload_optimizer=cpu through the real engine (as
   bench/memory_plan_check.py does, same malloc setting). On a CPU the device and the host are the same memory, so
   the measured peak RSS minus the pre-model RSS is compared with the plan's device total plus its host figure for
   the offloaded optimizer (host_bytes); the pre-model RSS is this machine's per-process runtime (the plan's
   HOST_PROCESS_BYTES stands for a GPU process's). Target: within 15%.
2. DeepSpeed's CPU Adam (the step offload runs) on one flat fp32 partition, one thread: parameters per second per
   core.

  python bench/offload_memory_check.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FIXED_MMAP_THRESHOLD, bench_parser, machine_note, parse_args, run_config, timed  # noqa: E402,I001
from memory_plan_check import SMOKE_MODEL, TOLERANCE, WEIGHTS_HEAVY, measured_stages  # noqa: E402

CASES = [
    ("weights, 1 stage, fp32, ZeRO-1, offload", ["num_stages=1", "precision=fp32"]),
    ("weights, 2 stages, bf16, ZeRO-1, offload, checkpointing",
     ["num_stages=2", "precision=bf16", "activation_checkpoint_interval=1"]),
]
COMMON = ["zero_stage=1", "offload_optimizer=cpu", "seq_length=256", "micro_batch_size=2",
          "gradient_accumulation_steps=2", "+deepspeed.zero_optimization.reduce_bucket_size=1000000"]


def check_case(name, model_fields, overrides):
    from transformers import LlamaConfig

    from planner.memory_plan import memory_plan
    from training.run_spec import plan_spec

    cfg = run_config(overrides)
    measured = measured_stages(model_fields, overrides, cfg.num_stages)
    rows = memory_plan(plan_spec(cfg, cfg.num_stages, LlamaConfig(**model_fields)))
    return [(name, row["stage"], row["memory_bytes"], row["host_bytes"], measured[row["stage"]]) for row in rows]


def cpu_adam_rate(parameters):
    """Parameters per second of one DeepSpeedCPUAdam step on one thread (median of 5 after a warm-up), and the
    seconds of that warm-up (loading the built op included)."""
    import statistics

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(1)

    def first_step():
        param = torch.nn.Parameter(torch.randn(parameters))
        param.grad = torch.randn(parameters)
        optimizer = DeepSpeedCPUAdam([param], lr=1e-4, adamw_mode=True)
        optimizer.step()
        return optimizer
    optimizers = []
    load_seconds = timed(lambda: optimizers.append(first_step()))
    return parameters / statistics.median(timed(optimizers[0].step) for _ in range(5)), load_seconds


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--adam-parameters", type=int, default=50_000_000, help="CPU Adam's flat partition")
    args = parse_args(parser, adam_parameters=100_000)
    os.environ.update(FIXED_MMAP_THRESHOLD)
    print(f"{'case':<56} {'stage':>5} {'device MiB':>11} {'host MiB':>9} {'measured MiB':>13} "
          f"{'measured/planned':>17}")
    worst = 0.0
    for name, overrides in CASES[-1:] if args.smoke else CASES:  # the smoke size: the 2-stage case
        for case, stage, device, host, measured in check_case(name, SMOKE_MODEL if args.smoke else WEIGHTS_HEAVY,
                                                              COMMON + overrides):
            ratio = measured / (device + host)
            worst = max(worst, abs(ratio - 1))
            print(f"{case:<56} {stage:>5} {device / 2**20:>11.0f} {host / 2**20:>9.0f} {measured / 2**20:>13.0f} "
                  f"{ratio:>17.3f}", flush=True)
    print(f"largest deviation: {worst:.1%} (target <= {TOLERANCE:.0%}: {'met' if worst <= TOLERANCE else 'NOT met'})")
    rate, load_seconds = cpu_adam_rate(args.adam_parameters)
    print(f"CPU Adam: {rate / 1e6:.0f} M parameters/s on one core ({args.adam_parameters / 1e6:g} M fp32 parameters, "
          f"median of 5 steps; first step incl. loading the built op {load_seconds:.1f} s); {machine_note()}")

if __name__ == "__main__":
    main()
