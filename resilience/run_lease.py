"""One live job per output_dir. Global rank 0 of a run holds output_dir/.lease.json (its host, the host's boot id, its
pid, the job's token and a heartbeat it renews every HEARTBEAT_SECONDS) and removes it when the run ends. A start
that finds another job's lease refuses in one line while that job is live, and takes the lease over once it is
stale: its process is gone (same host and boot), or its heartbeat is older than STALE_SECONDS (any host: a node lost,
a job killed). Only rank 0 reads and writes it, so the ranks of one job on nodes sharing the filesystem never
compete for it. A supervised job's ranks carry their supervisor's token (LEASE_TOKEN_ENV, resilience/supervisor.py): a
restart takes over its own previous attempt's lease at once, and the supervisor removes it after an attempt ends.
Reading the lease and writing one's own happen under an flock of output_dir/.lease.lock, so two jobs starting at once
take turns: one takes a free or stale lease, the other then finds it live and is refused.
"""
import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid

from checkpoints.files import write_text_atomic

LEASE_FILE = ".lease.json"
LOCK_FILE = ".lease.lock"  # empty; its flock orders the starts (released by the kernel if its holder dies)
LEASE_TOKEN_ENV = "TRAINER_LEASE_TOKEN"
HEARTBEAT_SECONDS = 30
STALE_SECONDS = 10 * HEARTBEAT_SECONDS  # ten missed renewals: no live job is that late


def lease_path(output_dir):
    return os.path.join(output_dir, LEASE_FILE)


def boot_id():
    """Tells two machines apart where containers give them the same hostname (and pids)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def process_alive(pid):
    """Whether pid runs on this machine (a zombie has ended: its run is over)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def read_lease(output_dir):
    try:
        with open(lease_path(output_dir)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def lease_lock(output_dir):
    """flock of output_dir's lock file for a read-and-write of the lease. A filesystem without flock (Lustre mounted
    without -o flock) gets a warning and no lock: a start then only races another start in the same moment."""
    fd = os.open(os.path.join(output_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                raise
            print(f"warning: {output_dir} does not support file locks ({error.strerror}): two jobs starting at the "
                  f"same moment could both take its lease; mount it with locking to be safe.", flush=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def holder_error(output_dir, lease, me, now):
    """One line if `lease` belongs to another live job, else None (no lease, ours, or stale)."""
    if lease is None or lease["token"] == me["token"]:
        return None
    same_machine = (lease["host"], lease["boot_id"]) == (me["host"], me["boot_id"])
    if same_machine and (lease["pid"] == me["pid"] or not process_alive(lease["pid"])):
        return None
    age = now - lease["heartbeat"]
    if age > STALE_SECONDS:
        return None
    return (f"output_dir '{output_dir}' is being written by another live job: its rank 0, pid {lease['pid']} on "
            f"{lease['host']}, renewed {lease_path(output_dir)} {age:.0f}s ago; choose another output_dir, or stop "
            f"that job (a lease not renewed for {STALE_SECONDS}s is taken over; delete the file only if that job is "
            f"gone).")


class RunLease:
    """Rank 0's lease on output_dir: taken at start-up (ValueError, one line, when another live job holds it),
    renewed by a thread, released at the end."""

    def __init__(self, output_dir):
        self.output_dir, self.path = output_dir, lease_path(output_dir)
        token = os.environ.get(LEASE_TOKEN_ENV) or uuid.uuid4().hex
        self.fields = {"host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid(), "token": token}
        os.makedirs(output_dir, exist_ok=True)
        with lease_lock(output_dir):
            error = holder_error(output_dir, read_lease(output_dir), self.fields, time.time())
            if error:
                raise ValueError(error)
            self._write()
        self._stopped = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="output-dir-lease").start()

    def _write(self):
        write_text_atomic(self.path, json.dumps({**self.fields, "heartbeat": time.time()}))

    def _heartbeat(self):
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            with lease_lock(self.output_dir):
                lease = read_lease(self.output_dir)
                if lease is not None and lease["token"] != self.fields["token"]:  # stalled past STALE_SECONDS
                    print(f"warning: {self.path} was taken over by pid {lease['pid']} on {lease['host']} while this "
                          f"job did not renew it; two jobs now write {self.output_dir}: stop one.", flush=True)
                    return
                self._write()

    def release(self):
        self._stopped.set()
        lease = read_lease(self.output_dir)
        if lease is not None and lease["token"] == self.fields["token"]:
            os.remove(self.path)


def release_lease_of(output_dir, token):
    """The supervisor, after an attempt ended (its ranks are gone): remove the lease its rank 0 left, if any."""
    lease = read_lease(output_dir)
    if lease is not None and lease["token"] == token:
        os.remove(lease_path(output_dir))


@contextlib.contextmanager
def output_dir_lease(output_dir):
    """Collective: global rank 0 holds output_dir's lease through the block; every rank raises its refusal."""
    import collectives  # here: the supervisor imports this module and stays a small process without torch
    import torch.distributed as dist
    lease, refusal = None, [None]
    if dist.get_rank() == 0:
        try:
            lease = RunLease(output_dir)
        except ValueError as error:
            refusal = [str(error)]
    collectives.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise ValueError(refusal[0])
    try:
        yield
    finally:
        if lease is not None:
            lease.release()
