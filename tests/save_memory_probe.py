"""trainer_pipe.py that also writes, from each rank, OUTPUT_DIR/save_memory_rank{R}.json about its every save
(tests/test_expert_parallel.py's save-memory check):

  resident  its resident set (bytes) as the save starts: the model, its gradients, the optimizer state
  peak      the largest resident set while this rank wrote its files of the checkpoint
  files     {file name: bytes of the tensors it handed to the checkpoint engine} of the files it wrote

Large allocations are mapped and unmapped by the C library from the start (mallopt), so that memory freed is
given back and the resident set follows what is allocated; the peak is the kernel's (VmHWM, reset as the save
starts)."""
import ctypes
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trainer_pipe  # noqa: E402

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MAPPED_FROM_BYTES = 128 << 10


def status_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def tensor_bytes(state):
    import torch
    if torch.is_tensor(state):
        return state.nbytes
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def record_save_memory():
    import torch.distributed as dist

    from checkpoints import saving
    from deepspeed_internals.access import checkpoint_engine_of
    write_rank_files = saving.write_rank_files
    saves = []

    def measured(engine, tag_dir, trainer_state):
        checkpoint_engine, files = checkpoint_engine_of(engine), {}
        save = checkpoint_engine.save

        def counted(state_dict, path):
            files[os.path.basename(path)] = tensor_bytes(state_dict)
            save(state_dict, path)
        checkpoint_engine.save = counted
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from the current one
        resident = status_bytes("VmRSS")
        try:
            return write_rank_files(engine, tag_dir, trainer_state)
        finally:
            checkpoint_engine.save = save
            saves.append({"resident": resident, "peak": status_bytes("VmHWM"), "files": files})
            with open(os.path.join(os.path.dirname(tag_dir), f"save_memory_rank{dist.get_rank()}.json"), "w") as f:
                json.dump(saves, f)

    saving.write_rank_files = measured


if __name__ == "__main__":
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, MAPPED_FROM_BYTES)
    record_save_memory()
    trainer_pipe.strip_launcher_arguments()
    trainer_pipe.main()
