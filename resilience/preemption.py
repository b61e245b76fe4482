"""Preemption: a SIGTERM (what cluster schedulers send before killing a job) ends training at the next step
boundary with a complete checkpoint and exit code PREEMPTED_EXIT_CODE, instead of losing every step since the last
save.

DeepSpeed's launchers do not cooperate by themselves: the `deepspeed` runner dies on SIGTERM without telling its
per-node launcher, which keeps the ranks training as orphans; the per-node launcher answers SIGTERM by sending
SIGTERM to its ranks one at a time and SIGKILL to any still alive 30 s later, then exits 1. So every rank
  - takes SIGTERM as a request to stop (the handler only sets a flag),
  - takes the disappearance of its DeepSpeed launcher or of the launcher's parent (the runner, or the remote shell
    of a multi-node launch) as the same request, since nobody is left to wait for the job,
and after every optimizer step all ranks agree (the flag's maximum over the world), so they stop at the same step
and save together (DeepSpeed's save is collective). A watchdog ends the process preemption_grace_seconds after
the request if the step and the save have not finished by then (a hung peer): the last complete checkpoint stays
`latest` either way, so `resume=auto` continues the run. A SIGTERM that comes after a sibling rank of the same
launcher has exited is the launcher ending a failed job: the rank exits at once, as it did before, unless it is
already stopping (the sibling then exited after their common save, and the launcher's SIGTERM must not cut this
rank's own exit short).
"""
import os
import signal
import socket
import threading
import time

import psutil
import torch

import collectives
from deepspeed_internals.registry import LAUNCHER_MODULE
from resilience.exit_codes import PREEMPTED as PREEMPTED_EXIT_CODE
from resilience.rank_records import record_end
from cluster.console import say


class Preempted(Exception):
    """Training stopped on a preemption request, after every rank saved the step it had reached."""


class PreemptionWatch:
    def __init__(self, grace_seconds):
        self.grace_seconds = grace_seconds
        self.requested_at = None
        self.reason = None
        self._lock = threading.Lock()
        self.launcher_pid, self.launcher_parent_pid = deepspeed_launcher_of_this_process()
        self.local_ranks = len(self._live_siblings()) if self.launcher_pid else None
        # Python runs signal handlers in the main thread between bytecodes, never while it waits in a collective;
        # the wakeup fd is written at delivery, so a thread records the request (and starts the watchdog) even
        # when the main thread is stuck. The handler itself only keeps SIGTERM from ending the process.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        wakeup_read, wakeup_write = socket.socketpair()
        wakeup_write.setblocking(False)
        signal.set_wakeup_fd(wakeup_write.fileno())
        self._wakeup = (wakeup_read, wakeup_write)  # kept open for the life of the process
        threading.Thread(target=self._wait_for_signal, args=(wakeup_read,), daemon=True).start()

    def _wait_for_signal(self, wakeup_read):
        while True:
            if signal.SIGTERM not in wakeup_read.recv(64):
                continue
            if self.requested_at is None and self.sibling_rank_has_exited():
                # DeepSpeed's launcher is ending the job because a rank failed: no step can complete, so end as
                # SIGTERM's default action would. Once a stop is under way, a sibling that saved and exited first
                # is no failure: this rank finishes its exit (the grace watchdog still bounds it).
                record_end(128 + signal.SIGTERM, "ended by its launcher after another rank exited",
                           follows_another=True)
                os._exit(128 + signal.SIGTERM)
            self.request("SIGTERM")

    def request(self, reason):
        with self._lock:
            if self.requested_at is not None:
                return
            self.requested_at, self.reason = time.time(), reason
        threading.Thread(target=self._exit_after_grace, daemon=True).start()

    def _exit_after_grace(self):
        time.sleep(self.grace_seconds)
        message = (f"preemption ({self.reason}): the step and the checkpoint did not finish within "
                   f"preemption_grace_seconds={self.grace_seconds}; exiting without it (the last complete checkpoint "
                   f"stays 'latest'; rerun with resume=auto)")
        say(message)
        record_end(PREEMPTED_EXIT_CODE, message)
        os._exit(PREEMPTED_EXIT_CODE)

    def _live_siblings(self):
        return [p for p in psutil.Process(self.launcher_pid).children() if p.status() != psutil.STATUS_ZOMBIE]

    def sibling_rank_has_exited(self):
        """Whether a rank started by this rank's DeepSpeed launcher has already exited."""
        if self.launcher_pid is None:
            return False
        try:
            return len(self._live_siblings()) < self.local_ranks
        except psutil.Error:
            return True

    def check_launcher(self):
        """Request a stop when the DeepSpeed launcher that started this rank, or the launcher's parent, is gone."""
        if self.launcher_pid is None or self.requested_at is not None:
            return
        if os.getppid() != self.launcher_pid:
            return self.request("the DeepSpeed launcher is gone")
        try:
            launcher_parent = psutil.Process(self.launcher_pid).ppid()
        except psutil.Error:
            return self.request("the DeepSpeed launcher is gone")
        if launcher_parent != self.launcher_parent_pid:
            self.request("the process that started the DeepSpeed launcher (the deepspeed runner) is gone")

    def should_stop(self):
        """Whether any rank has been asked to stop: collective, so every rank must call it at the same point."""
        self.check_launcher()
        flag = torch.tensor([1.0 if self.requested_at is not None else 0.0],
                            device=collectives.device())
        collectives.all_reduce(flag, op=collectives.ReduceOp.MAX)
        if flag.item() and self.requested_at is None:
            self.request("another rank was asked to stop")
        return bool(flag.item())


def deepspeed_launcher_of_this_process():
    """(pid of DeepSpeed's per-node launcher, pid of its parent) when that launcher started this process, else
    (None, None): under other launchers a vanished parent is not ours to interpret."""
    try:
        launcher = psutil.Process(os.getppid())
        if LAUNCHER_MODULE in " ".join(launcher.cmdline()):
            return launcher.pid, launcher.ppid()
    except psutil.Error:
        pass
    return None, None
