"""One node of a job on two simulated nodes (tests/test_preference.py, two PID namespaces: the ranks of both nodes have
the same pids): it enters a PID namespace of its own as its pid 1 (as `unshare --pid --fork --mount-proc
--kill-child` does), with the libraries imported once (tests/zygote_imports.py; forked from the rank zygote, they are
already), and forks its 2 ranks as pids 2 and 3, as a container's ranks would be numbered. Each rank runs the DPO
trainer, which writes its tokenized data cache and reference log-probabilities into the shared output_dir, then builds
the sample index of a token-shard corpus in a shared index_dir, read back on every rank; its output goes to
OUT/rank<RANK>.log (OUT: settings["out"]).

  CROSS_RANK=NODE python -m tests.two_node_worker node '{"out": DIR, "overrides": [...], "shards": PREFIX,
                                                         "index_dir": DIR, "vocab_size": N}'
"""
import ctypes
import json
import os
import signal
import socket
import sys

RANKS_PER_NODE = 2
CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000  # <linux/sched.h>
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18  # <linux/mount.h>
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(settings):
    import torch.distributed as dist
    from data.indexed import training_blend
    from data.shard_files import parse_sources
    from tests.helpers import compose_config
    from training.loop import run
    rank = int(os.environ["RANK"])
    run(compose_config(settings["overrides"]))
    blend = training_blend(parse_sources(settings["shards"], "train_file"), reads_data=True, seed=0, seq_length=16,
                           isolate=False, blend_dir=settings["index_dir"], vocab_size=settings["vocab_size"],
                           total_samples=200, build_limit_minutes=5, index_dir=settings["index_dir"])
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
              "samples": [blend[k]["labels"].tolist() for k in range(0, 200, 50)]}
    with open(os.path.join(settings["out"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()  # the store lives in rank 0's process: it stays until every rank has read rank 0's word
    dist.destroy_process_group()


def enter_pid_namespace():
    """Goes on as pid 1 of a new PID namespace with its own /proc, in a child killed when this process dies; this
    process waits for it and exits with its exit code."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, call):
        if result:
            raise OSError(ctypes.get_errno(), f"{call}: {os.strerror(ctypes.get_errno())}")
    check(libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare")
    child = os.fork()
    if child:
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "prctl")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")  # the host's stay
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount proc")


def node(node_rank, settings_text):
    """This node's ranks, forked once both have their pids (2 and 3: the next after ns_last_pid); the node's exit
    code is the first failing rank's."""
    import tests.zygote_imports  # noqa: F401
    from tests.rank_zygote import run_as_interpreter
    enter_pid_namespace()
    gate_read, gate_write = os.pipe()
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write("1")
    pids = []
    for local in range(RANKS_PER_NODE):
        rank = RANKS_PER_NODE * node_rank + local
        log = os.path.join(json.loads(settings_text)["out"], f"rank{rank}.log")
        open(log, "w").close()
        pid = os.fork()
        if pid == 0:
            os.close(gate_write)
            os.read(gate_read, 1)  # until the other rank is forked: its pid is not taken by this one's children
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), CROSS_RANK=str(node_rank))
            os._exit(run_as_interpreter([__file__, settings_text], env, log, log))
        pids.append(pid)
    os.close(gate_write)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    os._exit(next((code for code in codes if code), 0) % 256)  # pid 1 ends: the namespace's last processes with it


if __name__ == "__main__":
    if sys.argv[1] == "node":
        node(int(os.environ["CROSS_RANK"]), sys.argv[2])
    else:
        main(json.loads(sys.argv[1]))
