"""Process-group setup: threads per process, DeepSpeed's distributed init, and the pipeline × tensor × data
topology."""
import os
import traceback
from datetime import timedelta

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from deepspeed_internals.access import skip_shm_comm_build
from deepspeed_internals.registry import PipeDataParallelTopology, PipeModelDataParallelTopology

NCCL_TRACE_ENTRIES = "2000"  # TORCH_NCCL_TRACE_BUFFER_SIZE unless set


def set_threads_per_process():
    """One share of the cores per local process: DeepSpeed's launcher sets no OMP_NUM_THREADS, and oversubscribed
    CPU processes run an order of magnitude slower."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size()))


def local_world_size():
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, or the DeepSpeed launcher's LOCAL_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))


def elastic_restart_error(env):
    """A line when torchrun restarts ranks itself (--max-restarts) sharing its rendezvous store with theirs: the
    restarted ranks' process groups then read the previous attempt's addresses from it (pytorch#135712) and hang or
    fail in Gloo's connectFullMesh. None otherwise."""
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"torchrun --max-restarts {env['TORCHELASTIC_MAX_RESTARTS']} shares its rendezvous store with the "
                f"ranks' process groups, where a restart's ranks find the previous attempt's addresses and hang "
                f"(pytorch#135712): start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, or "
                f"with --max-restarts 0 under supervise.py.")
    return None


def node_ranks():
    """The global ranks of this node's processes: launchers number a node's ranks consecutively."""
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    return range(first, first + local_world_size())


def device_error(precision, local_rank, local_world_size, device_count, bf16_supported, device_name):
    """Why this rank cannot run on this node's GPUs (a line naming the count or capability and what to change), or
    None: caught at start-up instead of NCCL's "Duplicate GPU detected" or a kernel error mid-step."""
    if local_world_size > device_count:
        return (f"{local_world_size} ranks on this node but {device_count} GPU(s) visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): two ranks would share a GPU; launch at most "
                f"{device_count} processes per node (deepspeed --num_gpus {device_count}, or a hostfile's slots).")
    if local_rank >= device_count:
        return (f"local rank {local_rank} has no GPU of its own: this process sees {device_count} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); let every rank of a "
                f"node see all of its GPUs (the launcher picks LOCAL_RANK's).")
    if precision == "bf16" and not bf16_supported:
        return (f"precision=bf16 but {device_name} has no bf16 support (compute capability below 8.0); set "
                f"precision=fp16 or precision=fp32.")
    return None


def check_devices(precision):
    """device_error for this rank, on CUDA (the CPU runs any number of ranks)."""
    if get_accelerator().device_name() != "cuda":
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    error = device_error(precision, local_rank, local_world_size(),
                         torch.cuda.device_count(), torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                         torch.cuda.get_device_name(local_rank) if local_rank < torch.cuda.device_count() else "")
    if error:
        raise ValueError(error)


def init_distributed(timeout_minutes):
    """Start the process group. A bounded timeout turns a dead peer into an error instead of an hours-long hang."""
    if get_accelerator().device_name() == "cpu":
        # gloo does the CPU collectives; this skips JIT-building DeepSpeed's shared-memory op (~35 s per machine).
        skip_shm_comm_build()
    # NCCL's flight recorder keeps the last collectives of every group for the hang watchdog's dump; read when a
    # group starts.
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", NCCL_TRACE_ENTRIES)
    deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes))
    # Object collectives before the engine exists (checksum verification) run on the current device: each rank's own.
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))


def communication_failure(error):
    """Whether `error` came out of torch.distributed (a collective or point-to-point call: a peer gone, a timeout),
    which is more often another rank's failure seen from here than this rank's own."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, torch.distributed.DistError) or bool(frames) and (
        f"torch{os.sep}distributed{os.sep}" in frames[-1].filename)


def parallel_topology(num_stages, tensor_parallel_size=1):
    """DeepSpeed's topology, tensor-parallel ranks innermost (consecutive ranks: one node's fast links). Without
    tensor parallelism there is no 'model' axis, so layer files keep their plain names (layer_XX-model_states.pt)."""
    world = torch.distributed.get_world_size()
    data_parallel = world // (num_stages * tensor_parallel_size)
    if tensor_parallel_size == 1:
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=data_parallel)
    return PipeModelDataParallelTopology(num_pp=num_stages, num_mp=tensor_parallel_size, num_dp=data_parallel)
