"""Start real worker processes on this machine: one process per rank, gloo through DeepSpeed's CPU accelerator."""
import contextlib
import itertools
import os
import random
import socket
import time
from collections import Counter

import torch.distributed as dist
import torch.multiprocessing as mp


# Launches' MASTER_PORTs: below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768 up by
# default), where no connection's own port can take one before its master listens; under pytest-xdist, a block of
# its own for each worker (PYTEST_XDIST_WORKER gwN), so that two workers' launches never pick the same one.
PORT_BLOCK = 2000
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
_FIRST_PORT = 12000 + _WORKER % 10 * PORT_BLOCK
_next_ports = itertools.count(random.Random().randrange(PORT_BLOCK))  # another session's sequence starts elsewhere


def free_port():
    """The next port of this worker's block that nothing listens on."""
    for _ in range(PORT_BLOCK):
        port = _FIRST_PORT + next(_next_ports) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_FIRST_PORT}-{_FIRST_PORT + PORT_BLOCK - 1}")


def _bootstrap(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    fn(rank, *args)


def spawn(fn, world_size, *args, timeout=None):
    """Run fn(rank, *args) in world_size processes forked from the rank zygote (tests/rank_zygote.py: the libraries
    imported once), or from this process where it is one of the zygote's (a bench script's smoke run); raises if any
    of them fails, or (TimeoutError, the processes killed) if they have not all ended within timeout seconds."""
    from tests.rank_zygote import context, in_zygote_child
    start_method = "fork" if in_zygote_child() else "forkserver"
    if start_method == "forkserver":
        context()  # its imports, before the forkserver starts
    started = mp.start_processes(_bootstrap, args=(world_size, free_port(), fn, args), nprocs=world_size,
                                 start_method=start_method, join=False)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not started.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            for process in started.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks had not ended after {timeout}s")


class ProcessGroupPool:
    """Process groups for a worker that builds an engine per run, one run after another: inside run(), the n-th
    dist.new_group a run asks for over a set of ranks is the n-th that the first run to ask for it made.

    Why: each Gloo group keeps a thread that wakes every 10 ms, and a finished run's groups outlive it (its engine's
    grid stays referenced from outside Python's reach, so destroying the groups does not end their threads). A worker
    making every run's groups anew held a few hundred per rank: between them they took a core's share of a 2-core host
    and drove its load average into the tens. Runs never overlap, and every rank runs the same runs, so every rank
    takes the same group for each call, in the same order, as new_group requires."""

    def __init__(self):
        self.groups, self.asked = {}, Counter()

    @contextlib.contextmanager
    def run(self):
        make, self.asked = dist.new_group, Counter()

        def pooled_group(ranks=None, **options):
            ranks = None if ranks is None else [int(rank) for rank in ranks]  # a range or generator read once
            members = None if ranks is None else tuple(sorted(ranks))
            key = (members, tuple(sorted((name, repr(value)) for name, value in options.items())))
            self.asked[key] += 1
            if (key, self.asked[key]) not in self.groups:
                self.groups[key, self.asked[key]] = make(ranks, **options)
            return self.groups[key, self.asked[key]]
        dist.new_group = pooled_group
        try:
            yield
        finally:
            dist.new_group = make

    def runs(self, items):
        """Each of items inside its own run(): for a worker's loop of one run per item."""
        for item in items:
            with self.run():
                yield item
