"""The per-stage memory plan of a run from its config alone (plan_only=true): no GPU, no weights, no processes.

Per stage and per device: weights, gradients and optimizer state for the precision, ZeRO stage, tensor-parallel
and data-parallel degrees;
activations with and without activation checkpointing (1F1B keeps up to num_stages - stage micro-batches in
flight); the optimizer step's short-lived buffers; the total per device and whether it fits device_memory_gb.
With offload_optimizer=cpu, the optimizer state leaves the device plan for the host plan: per node (gpus_per_node
consecutive ranks), each rank's offloaded state and a per-process runtime, plus the memory-mapped dataset, against
host_memory_gb.
The numbers come from models/partition.py's cost model, the one the balanced partition uses. The world is
num_stages x tensor_parallel_size x data-parallel devices.
"""
import dataclasses
import os

from omegaconf import OmegaConf
from transformers import AutoConfig

from models.partition import (PRECISION_BYTES, Workload, check_tensor_parallel, describe_workload, stage_bounds,
                              stage_plan)
from models.llama import check_model_config
from models.pipeline import build_pipeline_layers
from training.config import ConfigError, check_offload, data_parallel_size, offload_device

GIB = 2 ** 30
RUNTIME_NOTE = "not modelled: CUDA context, NCCL buffers, allocator fragmentation (keep ~10% headroom)"
# Host memory of one training process apart from the offloaded optimizer: Python, torch with its CUDA and NCCL
# libraries, DeepSpeed, the tokenizer and the data loader (resident set of a GPU training process, typically 3-5 GiB).
HOST_PROCESS_BYTES = 4 * GIB


def tensor_parallel_size(cfg):
    """cfg.tensor_parallel_size; 1 for configs written before tensor parallelism (or setting it null)."""
    size = cfg.get("tensor_parallel_size", 1)
    return 1 if size is None else int(size)


def plan_world_size(cfg):
    """Devices to plan for: plan_world_size, else the launched world size, else one data-parallel replica."""
    return cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", cfg.num_stages * tensor_parallel_size(cfg)))


def workload_from_cfg(cfg, world_size):
    """The run's Workload for the cost model (models/partition.py)."""
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    zero = ds.get("zero_optimization", {})
    optimizer_params = ds.get("optimizer", {}).get("params", {})
    return Workload(seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
                    micro_batches=cfg.gradient_accumulation_steps, precision=cfg.precision,
                    zero_stage=cfg.zero_stage,
                    data_parallel=data_parallel_size(world_size, cfg.num_stages, tensor_parallel_size(cfg)),
                    activation_checkpoint_interval=cfg.activation_checkpoint_interval,
                    reduce_bucket_size=int(zero.get("reduce_bucket_size", Workload.reduce_bucket_size)),
                    torch_adam=bool(optimizer_params.get("torch_adam", False)),
                    tensor_parallel=tensor_parallel_size(cfg),
                    sequence_parallel=bool(cfg.get("sequence_parallel", True)),
                    recompute_sequence_gather=bool(cfg.get("recompute_sequence_gather", False)),
                    offload_optimizer=offload_device(cfg) == "cpu",
                    pipeline_schedule=cfg.get("pipeline_schedule", "1f1b"),
                    zero_bubble_max_waiting=cfg.get("zero_bubble_max_waiting"))


def load_plan_model_config(cfg):
    """The model config to plan for: config.json in model_name_or_path (a Hugging Face or a converted directory;
    no weights are read), else the published config written into the run config's model_config node."""
    path = cfg.model_name_or_path
    if os.path.isfile(os.path.join(str(path), "config.json")):
        config = AutoConfig.from_pretrained(path)
    elif cfg.get("model_config"):
        fields = OmegaConf.to_container(cfg.model_config, resolve=True)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        raise ConfigError(f"plan_only needs a model config: '{path}' has no config.json and model_config is not "
                          f"set; point model_name_or_path at a Hugging Face or converted directory.")
    check_model_config(config)
    return config


def configured_partition(cfg):
    """cfg.partition as models/partition.py takes it: a method name or a list of decoder layers per stage."""
    return cfg.partition if isinstance(cfg.partition, str) else list(cfg.partition)


def configured_stage_bounds(cfg, model_config, workload):
    """[first layer of each stage..., layer count]: the bounds models/pipeline.py computes for this run."""
    class_names = [spec.typename.__name__ for spec in build_pipeline_layers(model_config)]
    return stage_bounds(model_config, cfg.num_stages, configured_partition(cfg), workload, class_names)


def memory_plan(cfg, model_config, world_size):
    """Per-stage rows (bytes) for the configured partition, with activations with and without checkpointing."""
    stages = cfg.num_stages
    if cfg.precision not in PRECISION_BYTES:
        raise ConfigError(f"precision '{cfg.precision}' is not one of {tuple(PRECISION_BYTES)}.")
    check_offload(cfg)
    workload = workload_from_cfg(cfg, world_size)  # checks the world size against stages x tensor-parallel
    if model_config.num_hidden_layers < stages:
        raise ConfigError(f"num_stages={stages} is more than the model's {model_config.num_hidden_layers} layers.")
    try:
        check_tensor_parallel(model_config, workload)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    bounds = configured_stage_bounds(cfg, model_config, workload)
    interval = workload.activation_checkpoint_interval
    with_checkpointing = stage_plan(model_config, bounds,
                                    dataclasses.replace(workload, activation_checkpoint_interval=interval or 1))
    without_checkpointing = stage_plan(model_config, bounds,
                                       dataclasses.replace(workload, activation_checkpoint_interval=0))
    configured = with_checkpointing if interval else without_checkpointing
    device_bytes = cfg.device_memory_gb * GIB
    rows = []
    for row, ckpt, full in zip(configured, with_checkpointing, without_checkpointing):
        rows.append({**row, "activation_checkpointed_bytes": ckpt["activation_bytes"],
                     "activation_full_bytes": full["activation_bytes"],
                     "fits": row["memory_bytes"] <= device_bytes})
    return workload, rows


def dataset_bytes(cfg):
    """The memory-mapped tokenized dataset, shared by a node's ranks through the page cache: estimated as the
    train file's size (about 4 bytes of text per token, stored as 4-byte ids); 0 when the file is not there yet."""
    path = cfg.get("train_file")
    return os.path.getsize(path) if path and os.path.isfile(str(path)) else 0


def host_memory_plan(cfg, workload, rows, world_size):
    """Host bytes per node: gpus_per_node consecutive ranks (DeepSpeed's topology puts a replica's tensor-parallel
    ranks, then data-parallel replicas, then stages next to each other), each with its offloaded optimizer state
    and HOST_PROCESS_BYTES, plus the dataset once."""
    per_node = min(int(cfg.get("gpus_per_node", 8)), world_size)
    ranks_per_stage = world_size // len(rows)
    rank_bytes = [rows[rank // ranks_per_stage]["host_bytes"] + HOST_PROCESS_BYTES for rank in range(world_size)]
    return [sum(rank_bytes[start:start + per_node]) + dataset_bytes(cfg) for start in range(0, world_size, per_node)]


def plan_fits(cfg, rows, host_nodes):
    """Whether every device and every node's host memory holds the plan."""
    return all(row["fits"] for row in rows) and max(host_nodes) <= cfg.get("host_memory_gb", 1024) * GIB


def format_memory_plan(cfg, workload, rows, world_size):
    interval = workload.activation_checkpoint_interval or 1
    header = (f"{'stage':>5} {'layers':>7} {'params':>8} {'weights':>8} {'grads':>8} {'optim':>8} "
              f"{f'act(ckpt {interval})':>12} {'act(full)':>10} {'step':>7} {'buffers':>8} {'total':>8}  fits")
    tensor = f"{workload.tensor_parallel} tensor-parallel x " if workload.tensor_parallel > 1 else ""
    per_device = "params and GiB per device" if workload.tensor_parallel > 1 else "GiB per device"
    lines = [f"memory plan: {world_size} devices = {cfg.num_stages} stages x {tensor}{workload.data_parallel} "
             f"data-parallel; {describe_workload(workload)}; partition '{cfg.partition}'; {per_device}", header]
    for row in rows:
        start, stop = row["layers"]
        lines.append(
            f"{row['stage']:>5} {f'{start}-{stop - 1}':>7} {row['parameters'] / 1e9:>7.2f}B "
            f"{row['weights_bytes'] / GIB:>8.1f} {row['gradients_bytes'] / GIB:>8.1f} "
            f"{row['optimizer_bytes'] / GIB:>8.1f} {row['activation_checkpointed_bytes'] / GIB:>12.1f} "
            f"{row['activation_full_bytes'] / GIB:>10.1f} {row['step_bytes'] / GIB:>7.1f} "
            f"{row['buffer_bytes'] / GIB:>8.1f} "
            f"{row['memory_bytes'] / GIB:>8.1f}  {'yes' if row['fits'] else 'NO'}")
    largest = max(rows, key=lambda row: row["memory_bytes"])
    verdict = "fits" if all(row["fits"] for row in rows) else "does NOT fit"
    lines.append(f"total = weights + optim + buffers + max(grads + activations as configured, step: the optimizer "
                 f"step's peak incl. gradients); largest stage "
                 f"{largest['memory_bytes'] / GIB:.1f} GiB: {verdict} in {cfg.device_memory_gb} GiB per device")
    lines.append(RUNTIME_NOTE)
    host_nodes = host_memory_plan(cfg, workload, rows, world_size)
    host_gb = cfg.get("host_memory_gb", 1024)
    largest_node = max(host_nodes)
    offloaded = sum(row["host_bytes"] for row in rows) * (world_size // len(rows))
    lines.append(f"host memory per node ({min(int(cfg.get('gpus_per_node', 8)), world_size)} devices, "
                 f"{len(host_nodes)} node(s)): offloaded optimizer {offloaded / len(host_nodes) / GIB:.1f} GiB "
                 f"(fp32 master, its gradient, Adam moments, pinned copies) + {HOST_PROCESS_BYTES / GIB:.0f} GiB per "
                 f"process + dataset {dataset_bytes(cfg) / GIB:.1f} GiB; largest node {largest_node / GIB:.1f} GiB: "
                 f"{'fits' if largest_node <= host_gb * GIB else 'does NOT fit'} in {host_gb} GiB per node")
    return "\n".join(lines)


def print_memory_plan(cfg, model_config, world_size):
    """Print the plan; returns its per-stage rows (bytes, and whether each stage fits device_memory_gb)."""
    workload, rows = memory_plan(cfg, model_config, world_size)
    print(format_memory_plan(cfg, workload, rows, world_size), flush=True)
    if cfg.pipeline_schedule == "zero_bubble" and not all(row["fits"] for row in rows):
        print(zero_bubble_caps_that_fit(cfg, model_config, world_size), flush=True)
    return rows


def zero_bubble_caps_that_fit(cfg, model_config, world_size):
    """Which zero_bubble_max_waiting values below the configured one fit, with their largest stage."""
    configured = cfg.zero_bubble_max_waiting
    fitting = []
    for cap in reversed(range(cfg.num_stages - 1 if configured is None else configured)):
        capped = OmegaConf.merge(cfg, {"zero_bubble_max_waiting": cap})
        _, rows = memory_plan(capped, model_config, world_size)
        if all(row["fits"] for row in rows):
            largest = max(row["memory_bytes"] for row in rows)
            fitting.append(f"zero_bubble_max_waiting={cap}: largest stage {largest / GIB:.1f} GiB")
    if not fitting:
        return "zero_bubble: no zero_bubble_max_waiting fits either (pipeline_schedule=1f1b holds the least)"
    return (f"zero_bubble holding fewer micro-batches back for W fits in {cfg.device_memory_gb} GiB per device: "
            + "; ".join(fitting) + " (the bubble of each on paper: python bench/schedule_simulator.py --config "
            "<config> --max-waiting null 0 1 ...)")
