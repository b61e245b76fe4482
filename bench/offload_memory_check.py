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
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_note, run_config, spawn  # noqa: E402,I001
from memory_plan_check import FIXED_MMAP_THRESHOLD, TOLERANCE, WEIGHTS_HEAVY, measure  # noqa: E402

CASES = [
    ("weights, 1 stage, fp32, ZeRO-1, offload", ["num_stages=1", "precision=fp32"]),
    ("weights, 2 stages, bf16, ZeRO-1, offload, checkpointing",
     ["num_stages=2", "precision=bf16", "activation_checkpoint_interval=1"]),
]
COMMON = ["zero_stage=1", "offload_optimizer=cpu", "seq_length=256", "micro_batch_size=2",
          "gradient_accumulation_steps=2", "+deepspeed.zero_optimization.reduce_bucket_size=1000000"]
ADAM_PARAMETERS = 50_000_000


def check_case(name, overrides):
    from transformers import LlamaConfig

    from planner.memory_plan import memory_plan
    from training.run_spec import plan_spec

    cfg = run_config(overrides)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(measure, cfg.num_stages, WEIGHTS_HEAVY, overrides, out_dir)
        measured = {}
        for rank in range(cfg.num_stages):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                result = json.load(f)
            measured[result["stage"]] = result["measured"]
    rows = memory_plan(plan_spec(cfg, cfg.num_stages, LlamaConfig(**WEIGHTS_HEAVY)))
    return [(name, row["stage"], row["memory_bytes"], row["host_bytes"], measured[row["stage"]]) for row in rows]


def cpu_adam_rate():
    """Parameters per second of one DeepSpeedCPUAdam step on one thread (median of 5 after a warm-up)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(1)
    start = time.perf_counter()
    param = torch.nn.Parameter(torch.randn(ADAM_PARAMETERS))
    param.grad = torch.randn(ADAM_PARAMETERS)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-4, adamw_mode=True)
    optimizer.step()
    load_seconds = time.perf_counter() - start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return ADAM_PARAMETERS / sorted(times)[2], load_seconds


def main():
    os.environ["MALLOC_MMAP_THRESHOLD_"] = FIXED_MMAP_THRESHOLD
    print(f"{'case':<56} {'stage':>5} {'device MiB':>11} {'host MiB':>9} {'measured MiB':>13} "
          f"{'measured/planned':>17}")
    worst = 0.0
    for name, overrides in CASES:
        for case, stage, device, host, measured in check_case(name, COMMON + overrides):
            ratio = measured / (device + host)
            worst = max(worst, abs(ratio - 1))
            print(f"{case:<56} {stage:>5} {device / 2**20:>11.0f} {host / 2**20:>9.0f} {measured / 2**20:>13.0f} "
                  f"{ratio:>17.3f}", flush=True)
    print(f"largest deviation: {worst:.1%} (target <= {TOLERANCE:.0%}: {'met' if worst <= TOLERANCE else 'NOT met'})")
    rate, load_seconds = cpu_adam_rate()
    print(f"CPU Adam: {rate / 1e6:.0f} M parameters/s on one core ({ADAM_PARAMETERS / 1e6:.0f} M fp32 parameters, "
          f"median of 5 steps; first step incl. loading the built op {load_seconds:.1f} s); {machine_note()}")


if __name__ == "__main__":
    main()
