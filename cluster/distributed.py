"""Process-group setup: threads per process, DeepSpeed's distributed init, and the pipeline × tensor × data
topology."""
import os
import traceback
from datetime import timedelta

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch.torch_version import TorchVersion

import collectives
from deepspeed_internals.access import skip_shm_comm_build
from deepspeed_internals.registry import PipeDataParallelTopology, PipeModelDataParallelTopology
from errors import ConfigError
from cluster.console import say

NCCL_TRACE_ENTRIES = "2000"  # collectives NCCL's flight recorder keeps, unless its buffer size is set
NCCL_TIMEOUT_TRACE = "nccl_timeout_trace_rank_"  # NCCL's own dump when a collective times out (torch adds the rank)
# From torch 2.8 the flight recorder reads TORCH_FR_*, and warns at every process group's start that the older
# TORCH_NCCL_* names it still reads are deprecated.
FLIGHT_RECORDER_RENAMED = "2.8"
FLIGHT_RECORDER_NAMES = {"buffer": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                         "dump_file": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
COMMUNICATION_CODE = (f"torch{os.sep}distributed{os.sep}", os.path.dirname(collectives.__file__) + os.sep)


def set_threads_per_process():
    """One share of the cores per local process: DeepSpeed's launcher sets no OMP_NUM_THREADS, and oversubscribed
    CPU processes run an order of magnitude slower. The cores are those this process may run on (its affinity: what
    Slurm's cpuset cgroup, taskset or numactl leave it), not the machine's: a job given 16 of 128 cores would
    otherwise run 128 / ranks threads each on its 16."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size()))


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
        raise ConfigError(error)


def flight_recorder_environment(dump_dir, environ, torch_version=torch.__version__):
    """What NCCL's flight recorder needs set before a process group starts (what `environ` does not set already, by
    either name): it keeps the last NCCL_TRACE_ENTRIES collectives of every group (the hang watchdog's dump) and, when
    a collective times out, NCCL dumps them into dump_dir; under the names this torch reads without a warning."""
    renamed = TorchVersion(torch_version) >= FLIGHT_RECORDER_RENAMED
    wanted = {"buffer": NCCL_TRACE_ENTRIES, "dump_file": os.path.join(dump_dir, NCCL_TIMEOUT_TRACE)}
    env = {FLIGHT_RECORDER_NAMES[key][0 if renamed else 1]: value for key, value in wanted.items()
           if not any(name in environ for name in FLIGHT_RECORDER_NAMES[key])}
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    return env


def set_up_flight_recorder(dump_dir):
    """flight_recorder_environment into this process's environment, on CUDA (NCCL); the directory to create once
    the run may write there, or None."""
    if get_accelerator().device_name() != "cuda":
        return None
    os.environ.update(flight_recorder_environment(dump_dir, os.environ))
    return dump_dir


def init_distributed(timeout_minutes):
    """Start the process group. A bounded timeout turns a dead peer into an error instead of an hours-long hang."""
    if get_accelerator().device_name() == "cpu":
        # gloo does the CPU collectives; this skips JIT-building DeepSpeed's shared-memory op (~35 s per machine).
        skip_shm_comm_build()
    deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes))
    # Object collectives before the engine exists (checksum verification) run on the current device: each rank's own.
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))


def communication_failure(error):
    """Whether `error` came out of a collective or point-to-point call (torch.distributed, or collectives/, where a
    posted request's wait raises: a peer gone, a timeout), which is more often another rank's failure seen from here
    than this rank's own."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, torch.distributed.DistError) or bool(frames) and any(
        place in frames[-1].filename for place in COMMUNICATION_CODE)


def log_rank0(message):
    """print on global rank 0 (every rank before the process group exists)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        say(message)


def parallel_topology(num_stages, tensor_parallel_size=1):
    """DeepSpeed's topology, tensor-parallel ranks innermost (consecutive ranks: one node's fast links). Without
    tensor parallelism there is no 'model' axis, so layer files keep their plain names (layer_XX-model_states.pt)."""
    world = torch.distributed.get_world_size()
    data_parallel = world // (num_stages * tensor_parallel_size)
    if tensor_parallel_size == 1:
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=data_parallel)
    return PipeModelDataParallelTopology(num_pp=num_stages, num_mp=tensor_parallel_size, num_dp=data_parallel)
