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

    Gradients: gradient_bytes_per_parameter. The optimizer keeps fp32 master weights (ZeRO-1 keeps its fp32
    partition even for fp32 models) and Adam's two fp32 moments, sharded over data-parallel ranks by ZeRO-1.
    """
    weight, gradients = PRECISION_BYTES[workload.precision], gradient_bytes_per_parameter(workload)
    if workload.offload_optimizer:  # on the host: host_state_bytes_per_parameter
        return {"weights": weight, "gradients": gradients, "optimizer": 0}
    keeps_master = workload.precision != "fp32" or workload.zero_stage >= 1
    return {"weights": weight, "gradients": gradients,
            "optimizer": ((FP32_BYTES if keeps_master else 0) + ADAM_STATE_BYTES) / optimizer_shards(workload)}


def gradient_bytes_per_parameter(workload):
    """A trained parameter's gradient bytes through a step's backward passes: its .grad in the model's dtype, or
    summed in fp32 by a 16-bit run: DeepSpeed's bf16 optimizer keeps the bf16 .grad (zeroed, not freed, between
    micro-batches) beside its fp32 sum (bf16_optimizer.py), and ZeRO-1's optimizer moves each .grad into an fp32
    grad_accum as it arrives (stage_1_and_2.py _fill_param_grad_accum_attribute)."""
    weight = PRECISION_BYTES[workload.precision]
    if not workload.sums_gradients_in_fp32:
        return weight
    return weight + FP32_BYTES if workload.bf16_optimizer else FP32_BYTES


def reduced_gradient_bytes(workload):
    """Bytes per element of the gradient that is reduced over data-parallel ranks: the sum's dtype."""
    return FP32_BYTES if workload.sums_gradients_in_fp32 else PRECISION_BYTES[workload.precision]


def checkpoint_bytes_per_parameter(workload):
    """Bytes per parameter of a training checkpoint on disk: the weights and the whole optimizer state (every
    rank's ZeRO shard, offloaded or not); gradients are not saved."""
    whole = state_bytes_per_parameter(dataclasses.replace(workload, data_parallel=1, context_parallel=1,
                                                          offload_optimizer=False))
    return whole["weights"] + whole["optimizer"]


def snapshot_bytes(workload, trained):
    """Host bytes of one rank's async_save snapshot (checkpoints/background_save.py: the tensors of the checkpoint
    files it writes, kept from one save to the next) in a stage with `trained` parameters: the stage's weights and
    whole optimizer state, shared by its data-parallel ranks (rank 0 writes the weights, the ranks take turns with
    the layers' optimizer state); 0 without async_save."""
    if not workload.async_save:
        return 0
    return trained * checkpoint_bytes_per_parameter(workload) / workload.gradient_reduction_ranks


def save_device_bytes(workload, largest_trained):
    """What a save takes on the device beyond the training state: under ZeRO each parameter's master weight and
    moments are summed from its fragments into one fp32 buffer of its size (this rank's tensor: an expert-parallel
    rank's slice of the experts), one parameter at a time, before the host copy is written
    (checkpoints/optimizer_state.py MasterState.gathered); without ZeRO the copies go straight to the host."""
    return largest_trained * FP32_BYTES if workload.zero_stage >= 1 else 0


def save_host_bytes(workload, largest_file):
    """What a save takes in host memory on a rank beyond its resident state: the host copies of the largest file it
    writes (`largest_file` parameters of a layer's part: their fp32 master weights and Adam's two moments, more
    than their weights), one file at a time (checkpoints/optimizer_state.py, models/pipeline.py saved_parts); the
    checksum's one read buffer is within the process's runtime. With async_save the snapshot holds every file
    instead, from the first save on (snapshot_bytes)."""
    if workload.async_save:
        return 0
    return largest_file * (FP32_BYTES + ADAM_STATE_BYTES)


def host_state_bytes_per_parameter(workload):
    """Host bytes per parameter of a stage with offload_optimizer=cpu (zero/stage_1_and_2.py), all pinned: the fp32
    master partition, its fp32 gradient, Adam's two moments, and a weight-dtype copy of the partition the updated
    weights go back to the device through; each 1/data-parallel of the stage."""
    if not workload.offload_optimizer:
        return 0
    return (FP32_BYTES + FP32_BYTES + ADAM_STATE_BYTES + PRECISION_BYTES[workload.precision]) / optimizer_shards(
        workload)


def state_bytes(workload, parameters, trained, optimized=None):
    """Weights of `parameters`, and gradients and optimizer state of the `trained` ones among them (all of them, or
    LoRA's adapters: the frozen base has neither), on the device, in bytes. optimized: the parameters whose
    optimizer state is sharded over the data-parallel ranks (default `trained`; under expert parallelism every
    expert, planner/stage_costs.py)."""
    per_parameter = state_bytes_per_parameter(workload)
    return {"weights": parameters * per_parameter["weights"], "gradients": trained * per_parameter["gradients"],
            "optimizer": (trained if optimized is None else optimized) * per_parameter["optimizer"]}


def buffer_bytes(workload, largest_tensor):
    """ZeRO-1's two gradient reduce buckets in the pipeline path (allocated in full on GPUs, in the summed
    gradient's dtype); with offload, the staging buffer (model dtype) of the largest tensor that gradients cross to
    the host through. The bf16 optimizer has none (step_bytes: its all-reduce)."""
    if workload.zero_stage == 0 or workload.bf16_optimizer:
        return 0
    staging = largest_tensor * workload.activation_bytes if workload.offload_optimizer else 0
    return 2 * workload.reduce_bucket_size * reduced_gradient_bytes(workload) + staging


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
    time. torch's unfused Adam allocates two fp32 temporaries (sqrt and division) per tensor; its fused kernel none.
    The bf16 optimizer (fp32 sums) all-reduces its fp32 gradients through flat copies (allreduce_bucket_bytes) and
    steps on its partition of them in place."""
    grad = gradient_bytes_per_parameter(workload)
    if workload.offload_optimizer:
        # Gradients go to the host partition one tensor at a time (the updated weights come back in place);
        # DeepSpeed 0.19.8 takes each one's norm on an fp64 copy first (zero/utils.py get_norm_dtype).
        return parameters * grad + largest_tensor * FP64_BYTES
    temporaries = 2 * FP32_BYTES if workload.torch_adam and not workload.fused_adam else 0
    if workload.bf16_optimizer:
        return parameters * grad + max(allreduce_bucket_bytes(workload, parameters, largest_tensor),
                                       parameters * temporaries / optimizer_shards(workload))
    cast = FP32_BYTES if grad != FP32_BYTES else 0
    if workload.zero_stage >= 1:
        shards = optimizer_shards(workload)
        flatten = parameters * (grad + (grad + cast) / shards)
        adam = parameters * (FP32_BYTES + temporaries) / shards
        return max(flatten, adam)
    return max(parameters * (grad + cast) + largest_tensor * temporaries,
               parameters * grad + allreduce_bucket_bytes(workload, parameters, largest_tensor))


def allreduce_bucket_bytes(workload, parameters, largest_tensor):
    """ZeRO-0, and the bf16 optimizer, with data parallelism: DeepSpeed's pipeline all-reduces the gradients (the
    model's dtype, the bf16 optimizer's fp32) through flat copies of MEMORY_OPT_ALLREDUCE_SIZE elements, plus the
    tensor that fills the bucket (pipe/engine.py _exec_reduce_grads). With one data-parallel rank the trainer skips
    that all-reduce, and no bucket is counted."""
    if (workload.zero_stage >= 1 and not workload.bf16_optimizer) or workload.gradient_reduction_ranks == 1:
        return 0
    return min(parameters, MEMORY_OPT_ALLREDUCE_SIZE + largest_tensor) * reduced_gradient_bytes(workload)
