"""Start real worker processes on this machine: one process per rank, gloo through DeepSpeed's CPU accelerator."""
import os
import socket

import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    fn(rank, *args)


def spawn(fn, world_size, *args):
    """Run fn(rank, *args) in world_size processes forked from the rank zygote (tests/rank_zygote.py: the libraries
    imported once); raises if any of them fails."""
    from tests.rank_zygote import context
    context()  # its imports, before the forkserver starts
    mp.start_processes(_bootstrap, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       start_method="forkserver", join=True)
