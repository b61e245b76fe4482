"""The memory planner (planner/memory_plan.py) against measured peak RSS on this CPU machine.

For small configs, each stage's process trains a few steps through the real engine and DeepSpeed config; its
model memory is the peak RSS over those steps minus the RSS before the model was built (the Python, torch and
DeepSpeed baseline). Prints planned and measured memory per stage and their ratio; target: within 15%.

glibc's malloc raises its mmap threshold as large blocks are freed, after which freed tensors stay in the heap as
fragments and RSS overstates live memory by up to a third; the workers therefore run with the threshold fixed
(MALLOC_MMAP_THRESHOLD_), so that RSS follows the tensors alive, as a GPU's allocated-memory figure does.
--default-malloc measures with glibc's defaults instead.

  python bench/memory_plan_check.py [--default-malloc] [--only zero_bubble ...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (FIXED_MMAP_THRESHOLD, bench_parser, machine_note, parse_args, peak_rss_bytes,  # noqa: E402,I001
                    reset_peak_rss, run_config, spawn, trainer_engine)

STEPS = 2
TOLERANCE = 0.15
# Weights-heavy: a 32k vocabulary on a small trunk. Activations-heavy: long sequences on a small model.
WEIGHTS_HEAVY = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
ACTIVATIONS_HEAVY = dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
SMOKE_MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048)  # every case's model at the smoke size
SMOKE_CASES = ["2 stages, bf16, ZeRO-1"]  # the smoke size's case
CASES = [
    ("weights, 1 stage, fp32, ZeRO-0", WEIGHTS_HEAVY,
     ["num_stages=1", "precision=fp32", "zero_stage=0", "seq_length=256", "micro_batch_size=2",
      "gradient_accumulation_steps=2"]),
    ("activations, 1 stage, fp32, ZeRO-0", ACTIVATIONS_HEAVY,
     ["num_stages=1", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=4",
      "gradient_accumulation_steps=2"]),
    ("activations, 2 stages, fp32, ZeRO-0", ACTIVATIONS_HEAVY,
     ["num_stages=2", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=4",
      "gradient_accumulation_steps=4"]),
    ("activations, 2 stages, fp32, ZeRO-0, zero_bubble", ACTIVATIONS_HEAVY,
     ["num_stages=2", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=4",
      "gradient_accumulation_steps=4", "pipeline_schedule=zero_bubble"]),
    # Checkpointed layers keep a hidden state per micro-batch; one waiting for W keeps all its linear layers' tensors.
    ("activations, 2 stages, checkpointing, 1f1b", ACTIVATIONS_HEAVY,
     ["num_stages=2", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=4",
      "gradient_accumulation_steps=4", "activation_checkpoint_interval=1"]),
    ("activations, 2 stages, checkpointing, zero_bubble", ACTIVATIONS_HEAVY,
     ["num_stages=2", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=4",
      "gradient_accumulation_steps=4", "activation_checkpoint_interval=1", "pipeline_schedule=zero_bubble"]),
    ("activations, 2 stages, checkpointing, zero_bubble_max_waiting=0", ACTIVATIONS_HEAVY,
     ["num_stages=2", "precision=fp32", "zero_stage=0", "seq_length=1024", "micro_batch_size=4",
      "gradient_accumulation_steps=4", "activation_checkpoint_interval=1", "pipeline_schedule=zero_bubble",
      "zero_bubble_max_waiting=0"]),
    # Data-parallel without ZeRO: the gradient all-reduce's flat copy of every gradient.
    ("weights, 1 stage x 2 data-parallel, fp32, ZeRO-0", WEIGHTS_HEAVY,
     ["num_stages=1", "plan_world_size=2", "precision=fp32", "zero_stage=0", "seq_length=32", "micro_batch_size=1",
      "gradient_accumulation_steps=2"]),
    # A small reduce bucket: torch.empty's untouched pages cost no RSS on the CPU but are allocated on a GPU.
    # Gradients summed in fp32 (the default: DeepSpeed's bf16 optimizer) and in bf16 (ZeRO-1's optimizer).
    ("weights, 2 stages, bf16, ZeRO-1, checkpointing", WEIGHTS_HEAVY,
     ["num_stages=2", "precision=bf16", "zero_stage=1", "seq_length=512", "micro_batch_size=2",
      "gradient_accumulation_steps=4", "activation_checkpoint_interval=1",
      "+deepspeed.zero_optimization.reduce_bucket_size=1000000"]),
    ("weights, 2 stages, bf16 sums, ZeRO-1, checkpointing", WEIGHTS_HEAVY,
     ["num_stages=2", "precision=bf16", "grad_accum_dtype=bf16", "zero_stage=1", "seq_length=512",
      "micro_batch_size=2", "gradient_accumulation_steps=4", "activation_checkpoint_interval=1",
      "+deepspeed.zero_optimization.reduce_bucket_size=1000000"]),
    # Offloaded, fp32 sums: ZeRO-1's fp32 grad_accum on the device.
    ("weights, 1 stage, bf16, ZeRO-1 offloaded, checkpointing", WEIGHTS_HEAVY,
     ["num_stages=1", "precision=bf16", "zero_stage=1", "offload_optimizer=cpu", "seq_length=512",
      "micro_batch_size=2", "gradient_accumulation_steps=4", "activation_checkpoint_interval=1",
      "+deepspeed.zero_optimization.reduce_bucket_size=1000000"]),
]


def measure(rank, model_fields, overrides):
    """One rank: train STEPS steps; (its stage, its peak RSS over the steps minus the RSS before the model)."""
    import torch.distributed as dist

    engine, batches, before_model = trainer_engine(model_fields, overrides, STEPS)
    reset_peak_rss()  # the window is training, as the plan's
    for _ in range(STEPS):
        engine.train_batch(batches)
    dist.destroy_process_group()
    return engine.stage_id, peak_rss_bytes() - before_model


def measured_stages(model_fields, overrides, world_size):
    """{stage: its peak RSS over STEPS steps minus the RSS before the model, the largest of its ranks'}."""
    measured = {}
    for stage, peak in spawn(measure, world_size, model_fields, overrides):
        measured[stage] = max(peak, measured.get(stage, 0))
    return measured


def check_case(name, model_fields, overrides):
    from transformers import LlamaConfig

    from planner.memory_plan import memory_plan
    from training.run_spec import plan_spec

    cfg = run_config(overrides)
    world_size = cfg.plan_world_size or cfg.num_stages
    measured = measured_stages(model_fields, overrides, world_size)
    rows = memory_plan(plan_spec(cfg, world_size, LlamaConfig(**model_fields)))
    results = []
    for row in rows:
        planned = row["memory_bytes"] + row["host_bytes"]  # on this machine device and host memory are one RSS
        ratio = measured[row["stage"]] / planned
        results.append((name, row["stage"], planned, measured[row["stage"]], ratio))
    return results


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--default-malloc", action="store_true", help="measure with glibc's default mmap threshold")
    parser.add_argument("--only", nargs="+", default=[""], help="only the cases whose name contains one of these")
    args = parse_args(parser, only=SMOKE_CASES)
    if not args.default_malloc:
        os.environ.update(FIXED_MMAP_THRESHOLD)  # read by each worker's malloc at start-up
    print(f"{'case':<64} {'stage':>5} {'planned MiB':>12} {'measured MiB':>13} {'measured/planned':>17}")
    worst = 0.0
    for name, model_fields, overrides in (case for case in CASES if any(only in case[0] for only in args.only)):
        for case, stage, planned, measured, ratio in check_case(name, SMOKE_MODEL if args.smoke else model_fields,
                                                                overrides):
            worst = max(worst, abs(ratio - 1))
            print(f"{case:<64} {stage:>5} {planned / 2**20:>12.0f} {measured / 2**20:>13.0f} {ratio:>17.3f}",
                  flush=True)
    verdict = "met" if worst <= TOLERANCE else "NOT met"
    print(f"largest deviation: {worst:.1%} (target <= {TOLERANCE:.0%}: {verdict}); {machine_note()}")


if __name__ == "__main__":
    main()
