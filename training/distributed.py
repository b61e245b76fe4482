"""Process-group setup: threads per process, DeepSpeed's distributed init, and the pipeline × tensor × data
topology."""
import os
from datetime import timedelta

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology


def set_threads_per_process():
    """One share of the cores per local process: DeepSpeed's launcher sets no OMP_NUM_THREADS, and oversubscribed
    CPU processes run an order of magnitude slower."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_processes))


def init_distributed(timeout_minutes):
    """Start the process group. A bounded timeout turns a dead peer into an error instead of an hours-long hang."""
    if get_accelerator().device_name() == "cpu":
        # gloo does the CPU collectives; this skips JIT-building DeepSpeed's shared-memory op (~35 s per machine).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes))
    # Object collectives before the engine exists (checksum verification) run on the current device: each rank's own.
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))


def parallel_topology(num_stages, tensor_parallel_size=1):
    """DeepSpeed's topology, tensor-parallel ranks innermost (consecutive ranks: one node's fast links). Without
    tensor parallelism there is no 'model' axis, so layer files keep their plain names (layer_XX-model_states.pt)."""
    world = torch.distributed.get_world_size()
    data_parallel = world // (num_stages * tensor_parallel_size)
    if tensor_parallel_size == 1:
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=data_parallel)
    return PipeModelDataParallelTopology(num_pp=num_stages, num_mp=tensor_parallel_size, num_dp=data_parallel)
