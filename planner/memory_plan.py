"""The per-stage memory plan of a run from its config alone (plan_only=true): no GPU, no weights, no processes.

Per stage and per device: weights, gradients and optimizer state for the precision, ZeRO stage, tensor-parallel
and data-parallel degrees; activations with and without activation checkpointing; the optimizer step's
short-lived buffers; the total per device and whether it fits device_memory_gb. With offload_optimizer=cpu, the
optimizer state leaves the device plan for the host plan: per node (gpus_per_node consecutive ranks), each rank's
offloaded state and a per-process runtime, plus the memory-mapped dataset, against host_memory_gb.
The numbers come from the cost model the balanced partition uses (stage_costs.py), so that the plan and the
partition never disagree about a stage; the run's world and stage bounds come with the RunSpec it is given.
"""
import dataclasses
import os

from models.partition import model_parameter_count
from planner.measured_costs import partition_costs_note
from planner.stage_costs import UNMODELLED_DEVICE_SHARE, format_stage_plan, layer_ranges, stage_plan
from planner.workload import describe_workload

GIB = 2 ** 30
RUNTIME_NOTE = (f"not modelled: CUDA context, NCCL buffers, allocator fragmentation (keep ~{UNMODELLED_DEVICE_SHARE:.0%} "
                f"headroom; partition=balanced does)")
# Host memory of one training process apart from the offloaded optimizer: Python, torch with its CUDA and NCCL
# libraries, DeepSpeed, the tokenizer and the data loader (resident set of a GPU training process, typically 3-5 GiB).
HOST_PROCESS_BYTES = 4 * GIB


def describe_stages(spec):
    """The stage plan printed at start-up: layers, parameters, compute and memory per stage."""
    rows = stage_plan(spec.model_config, spec.stage_bounds, spec.workload)
    return (f"pipeline partition '{spec.cfg.partition}'{partition_costs_note(spec.cfg, spec.unit_costs)} for "
            f"{describe_workload(spec.workload)}:\n"
            f"{format_stage_plan(rows)}")


def planned_stage_tflops(spec, stage):
    """The plan's training compute of one stage per micro-batch (TFLOP, this rank's share)."""
    return stage_plan(spec.model_config, spec.stage_bounds, spec.workload)[stage]["tflops_per_micro_batch"]


def memory_plan(spec):
    """Per-stage rows (bytes) for the run's stage bounds, with activations with and without checkpointing."""
    interval = spec.workload.activation_checkpoint_interval
    with_checkpointing = stage_plan(spec.model_config, spec.stage_bounds, dataclasses.replace(
        spec.workload, activation_checkpoint_interval=interval or 1))
    without_checkpointing = stage_plan(spec.model_config, spec.stage_bounds, dataclasses.replace(
        spec.workload, activation_checkpoint_interval=0))
    configured = with_checkpointing if interval else without_checkpointing
    device_bytes = spec.cfg.device_memory_gb * GIB
    return [{**row, "activation_checkpointed_bytes": ckpt["activation_bytes"],
             "activation_full_bytes": full["activation_bytes"], "fits": row["memory_bytes"] <= device_bytes}
            for row, ckpt, full in zip(configured, with_checkpointing, without_checkpointing)]


def dataset_bytes(cfg):
    """The memory-mapped tokenized dataset, shared by a node's ranks through the page cache: estimated as the
    train file's size (about 4 bytes of text per token, stored as 4-byte ids); 0 when the file is not there yet."""
    path = cfg.train_file
    return os.path.getsize(path) if path and os.path.isfile(str(path)) else 0


def devices_per_node(spec):
    return min(int(spec.cfg.gpus_per_node), spec.world_size)


def host_memory_plan(spec, rows):
    """Host bytes per node: gpus_per_node consecutive ranks (DeepSpeed's topology puts a replica's tensor-parallel
    ranks, then data-parallel replicas, then stages next to each other), each with its offloaded optimizer state
    and HOST_PROCESS_BYTES, plus the dataset once; with async_save, each rank's snapshot too, without it the host
    copies of the largest file each rank writes at a save (every rank saves at once)."""
    per_node, world_size = devices_per_node(spec), spec.world_size
    rank_bytes = [sum(rows[stage_of_rank(spec, rank)][key] for key in ("host_bytes", "snapshot_bytes",
                                                                       "save_host_bytes"))
                  + HOST_PROCESS_BYTES for rank in range(world_size)]
    return [sum(rank_bytes[start:start + per_node]) + dataset_bytes(spec.cfg)
            for start in range(0, world_size, per_node)]


def stage_of_rank(spec, rank):
    """DeepSpeed's topology numbers a stage's ranks consecutively, stage 0's first."""
    return rank // (spec.world_size // spec.num_stages)


def snapshot_bytes_of_ranks(spec, ranks):
    """Host bytes of the async_save snapshots of `ranks` (a node's): what they hold from the first save on."""
    rows = stage_plan(spec.model_config, spec.stage_bounds, spec.workload)
    return sum(rows[stage_of_rank(spec, rank)]["snapshot_bytes"] for rank in ranks)


def plan_fits(spec, rows, host_nodes):
    """Whether every device and every node's host memory holds the plan."""
    return all(row["fits"] for row in rows) and max(host_nodes) <= spec.cfg.host_memory_gb * GIB


def format_memory_plan(spec, rows):
    cfg, workload, world_size = spec.cfg, spec.workload, spec.world_size
    interval = workload.activation_checkpoint_interval or 1
    width = max(7, *(len(layer_ranges(row)) for row in rows))
    header = (f"{'stage':>5} {'layers':>{width}} {'params':>8} {'weights':>8} {'grads':>8} {'optim':>8} "
              f"{f'act(ckpt {interval})':>12} {'act(full)':>10} {'step':>7} {'save':>6} {'buffers':>8} "
              f"{'total':>8}  fits")
    tensor = f"{workload.tensor_parallel} tensor-parallel x " if workload.tensor_parallel > 1 else ""
    if workload.context_parallel > 1:
        tensor += f"{workload.context_parallel} context-parallel x "
    per_device = "params and GiB per device" if workload.tensor_parallel > 1 else "GiB per device"
    lines = [f"memory plan: {world_size} devices = {cfg.num_stages} stages x {tensor}{workload.data_parallel} "
             f"data-parallel; {describe_workload(workload)}; partition '{cfg.partition}'"
             f"{partition_costs_note(cfg, spec.unit_costs)}; {per_device}", header]
    for row in rows:
        lines.append(
            f"{row['stage']:>5} {layer_ranges(row):>{width}} {row['parameters'] / 1e9:>7.2f}B "
            f"{row['weights_bytes'] / GIB:>8.1f} {row['gradients_bytes'] / GIB:>8.1f} "
            f"{row['optimizer_bytes'] / GIB:>8.1f} {row['activation_checkpointed_bytes'] / GIB:>12.1f} "
            f"{row['activation_full_bytes'] / GIB:>10.1f} {row['step_bytes'] / GIB:>7.1f} "
            f"{row['save_bytes'] / GIB:>6.1f} {row['buffer_bytes'] / GIB:>8.1f} "
            f"{row['memory_bytes'] / GIB:>8.1f}  {'yes' if row['fits'] else 'NO'}")
    tied = (" (the tied LM head a copy of the embedding where they sit apart)"
            if spec.model_config.tie_word_embeddings and spec.num_stages > 1 else "")
    lines.append(f"model parameters {model_parameter_count(spec.model_config) / 1e9:.2f}B, each tied weight once; "
                 f"params per stage: what each device holds{tied}")
    largest = max(rows, key=lambda row: row["memory_bytes"])
    verdict = "fits" if all(row["fits"] for row in rows) else "does NOT fit"
    lines.append(f"total = weights + optim + buffers + max(grads + activations as configured, step: the optimizer "
                 f"step's peak incl. gradients, grads + save: a save's fp32 gather of one parameter); largest stage "
                 f"{largest['memory_bytes'] / GIB:.1f} GiB: {verdict} in {cfg.device_memory_gb} GiB per device")
    lines.append(RUNTIME_NOTE)
    host_nodes = host_memory_plan(spec, rows)
    host_gb = cfg.host_memory_gb
    largest_node = max(host_nodes)
    offloaded = sum(row["host_bytes"] for row in rows) * (world_size // len(rows))
    snapshot = sum(row["snapshot_bytes"] for row in rows) * (world_size // len(rows))
    save = max(rows[stage_of_rank(spec, rank)]["save_host_bytes"] for rank in range(world_size))
    snapshot = (f" + async_save snapshot {snapshot / len(host_nodes) / GIB:.1f} GiB (in /dev/shm: each rank's "
                f"checkpoint files)" if cfg.async_save else
                f" + a save's host copies of each rank's largest file (up to {save / GIB:.1f} GiB a rank)")
    lines.append(f"host memory per node ({devices_per_node(spec)} devices, "
                 f"{len(host_nodes)} node(s)): offloaded optimizer {offloaded / len(host_nodes) / GIB:.1f} GiB "
                 f"(fp32 master, its gradient, Adam moments, pinned copies){snapshot} + "
                 f"{HOST_PROCESS_BYTES / GIB:.0f} GiB per process + dataset {dataset_bytes(cfg) / GIB:.1f} GiB; "
                 f"largest node {largest_node / GIB:.1f} GiB: "
                 f"{'fits' if largest_node <= host_gb * GIB else 'does NOT fit'} in {host_gb} GiB per node")
    return "\n".join(lines)


def print_memory_plan(spec):
    """Print the plan; returns its per-stage rows (bytes, and whether each stage fits device_memory_gb)."""
    rows = memory_plan(spec)
    print(format_memory_plan(spec, rows), flush=True)
    if spec.workload.pipeline_schedule == "zero_bubble" and not all(row["fits"] for row in rows):
        print(zero_bubble_caps_that_fit(spec), flush=True)
    return rows


def zero_bubble_caps_that_fit(spec):
    """Which zero_bubble_max_waiting values below the configured one fit, with their largest stage."""
    configured = spec.workload.zero_bubble_max_waiting
    fitting = []
    for cap in reversed(range(spec.num_stages - 1 if configured is None else configured)):
        rows = memory_plan(spec.replanned(zero_bubble_max_waiting=cap))
        if all(row["fits"] for row in rows):
            largest = max(row["memory_bytes"] for row in rows)
            fitting.append(f"zero_bubble_max_waiting={cap}: largest stage {largest / GIB:.1f} GiB")
    if not fitting:
        return "zero_bubble: no zero_bubble_max_waiting fits either (pipeline_schedule=1f1b holds the least)"
    return (f"zero_bubble holding fewer micro-batches back for W fits in {spec.cfg.device_memory_gb} GiB per device: "
            + "; ".join(fitting) + " (the bubble of each on paper: python bench/schedule_simulator.py --config "
            "<config> --max-waiting null 0 1 ...)")
