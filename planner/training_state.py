"""The training state a stage carries beside its activations, per rank: weights, gradients and optimizer state for
the precision, ZeRO stage, data-parallel degree and optimizer offload; the host memory offload takes; ZeRO's
buffers; and the optimizer step's short-lived peak. Each figure is a function of the stage's parameter count and
its largest tensor (elements), so it stays apart from the model's layers (planner/stage_costs.py counts those).
Figures follow DeepSpeed 0.19.8's code paths named in each docstring."""
import dataclasses

from deepspeed_internals.registry import MEMORY_OPT_ALLREDUCE_SIZE
from planner.workload import PRECISION_BYTES

FP32_BYTES = 4
FP64_BYTES = 8
ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq in fp32


def optimizer_shards(workload):
    return workload.gradient_reduction_ranks if workload.zero_stage >= 1 else 1


def state_bytes_per_parameter(workload):
    """Bytes per parameter held through the whole run: weights, gradients, optimizer state.

    DeepSpeed accumulates gradients in the model's dtype (data_types.grad_accum_dtype unset). The optimizer keeps
    fp32 master weights (ZeRO-1 keeps its fp32 partition even for fp32 models) and Adam's two fp32 moments, sharded
    over data-parallel ranks by ZeRO-1.
    """
    weight = PRECISION_BYTES[workload.precision]
    if workload.offload_optimizer:  # on the host: host_state_bytes_per_parameter
        return {"weights": weight, "gradients": weight, "optimizer": 0}
    keeps_master = workload.precision != "fp32" or workload.zero_stage >= 1
    return {"weights": weight, "gradients": weight,
            "optimizer": ((FP32_BYTES if keeps_master else 0) + ADAM_STATE_BYTES) / optimizer_shards(workload)}


def checkpoint_bytes_per_parameter(workload):
    """Bytes per parameter of a training checkpoint on disk: the weights and the whole optimizer state (every
    rank's ZeRO shard, offloaded or not); gradients are not saved."""
    whole = state_bytes_per_parameter(dataclasses.replace(workload, data_parallel=1, context_parallel=1,
                                                          offload_optimizer=False))
    return whole["weights"] + whole["optimizer"]


def host_state_bytes_per_parameter(workload):
    """Host bytes per parameter of a stage with offload_optimizer=cpu (zero/stage_1_and_2.py), all pinned: the fp32
    master partition, its fp32 gradient, Adam's two moments, and a weight-dtype copy of the partition the updated
    weights go back to the device through; each 1/data-parallel of the stage."""
    if not workload.offload_optimizer:
        return 0
    return (FP32_BYTES + FP32_BYTES + ADAM_STATE_BYTES + PRECISION_BYTES[workload.precision]) / optimizer_shards(
        workload)


def state_bytes(workload, parameters, trained):
    """Weights of `parameters`, and gradients and optimizer state of the `trained` ones among them (all of them, or
    LoRA's adapters: the frozen base has neither), on the device, in bytes."""
    per_parameter = state_bytes_per_parameter(workload)
    return {"weights": parameters * per_parameter["weights"], "gradients": trained * per_parameter["gradients"],
            "optimizer": trained * per_parameter["optimizer"]}


def buffer_bytes(workload, largest_tensor):
    """ZeRO-1's two gradient reduce buckets in the pipeline path (allocated in full on GPUs); with offload, the
    staging buffer of the largest tensor that gradients cross to the host through."""
    if workload.zero_stage == 0:
        return 0
    staging = largest_tensor * workload.activation_bytes if workload.offload_optimizer else 0
    return 2 * workload.reduce_bucket_size * workload.activation_bytes + staging


def host_bytes(workload, parameters, largest_tensor):
    """Host memory of one rank for the offloaded optimizer: its state (host_state_bytes_per_parameter) and the
    pinned staging buffer of the largest tensor; 0 without offload."""
    if not workload.offload_optimizer:
        return 0
    return parameters * host_state_bytes_per_parameter(workload) + largest_tensor * workload.activation_bytes


def step_bytes(workload, parameters, largest_tensor):
    """The optimizer step's peak beyond weights and optimizer state, gradients included (activations are freed by
    then). ZeRO-1 copies its gradient partition flat and casts it to fp32, frees the gradients, then runs Adam on
    the flat partition; without ZeRO the gradients are first all-reduced over data-parallel ranks
    (allreduce_bucket_bytes), a 16-bit model's optimizer builds fp32 gradients, and Adam runs one parameter at a
    time. torch's unfused Adam allocates two fp32 temporaries (sqrt and division) per tensor; its fused kernel none."""
    grad = PRECISION_BYTES[workload.precision]
    if workload.offload_optimizer:
        # Gradients go to the host partition one tensor at a time (the updated weights come back in place);
        # DeepSpeed 0.19.8 takes each one's norm on an fp64 copy first (zero/utils.py get_norm_dtype).
        return parameters * grad + largest_tensor * FP64_BYTES
    cast = FP32_BYTES if workload.precision != "fp32" else 0
    temporaries = 2 * FP32_BYTES if workload.torch_adam and not workload.fused_adam else 0
    if workload.zero_stage >= 1:
        shards = optimizer_shards(workload)
        flatten = parameters * (grad + (grad + cast) / shards)
        adam = parameters * (FP32_BYTES + temporaries) / shards
        return max(flatten, adam)
    return max(parameters * (grad + cast) + largest_tensor * temporaries,
               parameters * grad + allreduce_bucket_bytes(workload, parameters, largest_tensor))


def allreduce_bucket_bytes(workload, parameters, largest_tensor):
    """ZeRO-0 with data parallelism: DeepSpeed's pipeline all-reduces the gradients (model dtype; bf16 needs ZeRO-1)
    through flat copies of MEMORY_OPT_ALLREDUCE_SIZE elements, plus the tensor that fills the bucket. One
    data-parallel rank skips the all-reduce (training/loop.py)."""
    if workload.zero_stage >= 1 or workload.gradient_reduction_ranks == 1:
        return 0
    return min(parameters, MEMORY_OPT_ALLREDUCE_SIZE + largest_tensor) * PRECISION_BYTES[workload.precision]
