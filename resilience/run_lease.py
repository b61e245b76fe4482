"""One live job per output_dir. Global rank 0 of a run holds output_dir/.lease.json (its host, the host's boot id, its
pid, the job's token, scheduler job id and command, and a heartbeat it renews every HEARTBEAT_SECONDS) and removes it
when the run ends. A start that finds another job's lease refuses in one line while that job is live, and takes the
lease over once it is stale: its process is gone (same host and boot), or its heartbeat is older than STALE_SECONDS
(any host: a node lost, a job killed). Only rank 0 reads and writes it, so the ranks of one job on nodes sharing the
filesystem never compete for it. A supervised job's ranks carry their supervisor's token (LEASE_TOKEN_ENV,
resilience/supervisor.py): a restart takes over its own previous attempt's lease at once, and the supervisor removes
it after an attempt ends. A requeue of the same job after an unclean end is no other job: the scheduler's requeue
of the same job id (Slurm's SLURM_JOB_ID, a later SLURM_RESTART_COUNT: Slurm ends a job before requeueing it) takes
the lease at once; the same job id or the same command otherwise takes it once it missed MISSED_RENEWALS renewals,
and is refused if it is renewed meanwhile (the same command launched twice; a lease taken after this process started
is a twin's, refused at once). Reading the lease and writing one's own happen under an flock of
output_dir/.lease.lock, so two jobs starting at once take turns: one takes a free or stale lease, the other then
finds it live and is refused. A heartbeat that cannot renew the lease for half of STALE_SECONDS (the filesystem
failing: ESTALE, EIO), or finds it taken over, ends the run (exit LEASE_LOST, which a supervisor restarts) before two
jobs could write output_dir.
"""
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid

from checkpoints.files import write_text_atomic
from errors import ConfigError
from resilience.exit_codes import LEASE_LOST
from resilience.rank_records import record_end
from cluster.console import say

LEASE_FILE = ".lease.json"
LOCK_FILE = ".lease.lock"  # empty; its flock orders the starts (released by the kernel if its holder dies)
LEASE_TOKEN_ENV = "TRAINER_LEASE_TOKEN"
HEARTBEAT_SECONDS = 30
STALE_SECONDS = 10 * HEARTBEAT_SECONDS  # ten missed renewals: no live job is that late
MISSED_RENEWALS = 2  # an earlier run of the same job that has not renewed its lease for this many heartbeats is gone
SCHEDULER_JOB_ENV, SCHEDULER_RESTART_ENV = "SLURM_JOB_ID", "SLURM_RESTART_COUNT"
THIS_JOB, ANOTHER_JOB = "an earlier run of this job", "another job"  # holder_of's verdicts on a live lease


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


def process_start_time():
    """When this process started, in time.time()'s terms, to the kernel's clock tick (psutil's create_time() can be a
    second early: it counts from the boot time in whole seconds)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")


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
            say(f"run lease: warning: {output_dir} does not support file locks ({error.strerror}): two jobs starting at the "
                f"same moment could both take its lease; mount it with locking to be safe.")
        yield
    finally:
        os.close(fd)  # releases the flock


def job_command():
    """What tells a rerun of the same command: the script and its arguments, less a resume= (a restart adds
    resume=auto), hashed."""
    kept = [argument for argument in sys.argv if not argument.lstrip("+").startswith("resume=")]
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]


def holder_of(lease, me, now, started):
    """Who holds `lease` against `me` (this start's fields; started: when this process started): None where it is
    free to take (no lease, ours, or a gone job's), THIS_JOB for an earlier run of this job (the same job id or
    command, its lease taken before this process started: else a twin launched with it) that has renewed it lately,
    else ANOTHER_JOB."""
    if lease is None or lease["token"] == me["token"]:
        return None
    same_machine = (lease["host"], lease["boot_id"]) == (me["host"], me["boot_id"])
    if same_machine and (lease["pid"] == me["pid"] or not process_alive(lease["pid"])):
        return None
    age = now - lease["heartbeat"]
    if age > STALE_SECONDS:
        return None
    same_job = me["job"] is not None and lease.get("job") == me["job"]
    if same_job and lease.get("restart", 0) < me["restart"]:  # requeued: Slurm ended the earlier run first
        return None
    if (same_job or lease.get("command") == me["command"]) and lease.get("taken", now) < started:
        return None if age > MISSED_RENEWALS * HEARTBEAT_SECONDS else THIS_JOB
    return ANOTHER_JOB


def refusal_line(output_dir, lease, now):
    return (f"output_dir '{output_dir}' is being written by another live job: its rank 0, pid {lease['pid']} on "
            f"{lease['host']}, renewed {lease_path(output_dir)} {now - lease['heartbeat']:.0f}s ago; choose another "
            f"output_dir, or stop that job (a lease not renewed for {STALE_SECONDS}s is taken over; delete the file "
            f"only if that job is gone).")


class RunLease:
    """Rank 0's lease on output_dir: taken at start-up (ConfigError, one line, when another live job holds it),
    renewed by a thread, released at the end."""

    def __init__(self, output_dir):
        self.output_dir, self.path = output_dir, lease_path(output_dir)
        token = os.environ.get(LEASE_TOKEN_ENV) or uuid.uuid4().hex
        self.fields = {"host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid(), "token": token,
                       "job": os.environ.get(SCHEDULER_JOB_ENV),
                       "restart": int(os.environ.get(SCHEDULER_RESTART_ENV, "0")), "command": job_command()}
        os.makedirs(output_dir, exist_ok=True)
        started, seen = process_start_time(), None  # seen: the earlier run's lease, while it is watched
        while True:
            with lease_lock(output_dir):
                lease, now = read_lease(output_dir), time.time()
                holder = holder_of(lease, self.fields, now, started)
                if holder is None:
                    self.fields["taken"] = now
                    self._write()
                    break
            if holder == ANOTHER_JOB or seen is not None and lease["heartbeat"] != seen["heartbeat"]:
                raise ConfigError(refusal_line(output_dir, lease, now))  # renewed while this start waited: it runs
            if seen is None:
                say(f"output_dir '{output_dir}' holds the lease of an earlier run of this job (pid {lease['pid']} on "
                    f"{lease['host']}, renewed {now - lease['heartbeat']:.0f}s ago): taking it over unless it is "
                    f"renewed within {MISSED_RENEWALS * HEARTBEAT_SECONDS}s of that")
            seen = lease
            time.sleep(max(0.0, lease["heartbeat"] + MISSED_RENEWALS * HEARTBEAT_SECONDS - now) + 0.1)
        self._stopped = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="output-dir-lease").start()

    def _write(self):
        write_text_atomic(self.path, json.dumps({**self.fields, "heartbeat": time.time()}))

    def _heartbeat(self):
        renewed = time.monotonic()
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            try:
                with lease_lock(self.output_dir):
                    lease = read_lease(self.output_dir)
                    if lease is not None and lease["token"] != self.fields["token"]:  # stalled past STALE_SECONDS
                        return self._lost(f"{self.path} was taken over by pid {lease['pid']} on {lease['host']} "
                                          f"while this job did not renew it")
                    self._write()
                renewed = time.monotonic()
            except Exception as error:  # ESTALE, EIO from a failing filesystem: retried until half of STALE_SECONDS
                failing = time.monotonic() - renewed
                if failing >= STALE_SECONDS / 2:
                    return self._lost(f"{self.path} could not be renewed for {failing:.0f}s "
                                      f"({type(error).__name__}: {error})")
                say(f"run lease: warning: {self.path} could not be renewed ({type(error).__name__}: {error}); trying again "
                    f"in {HEARTBEAT_SECONDS}s")

    def _lost(self, why):
        """End this rank, and so the run, before two jobs can write output_dir (the main thread may be stuck)."""
        line = (f"trainer_pipe: error: {why}; stopping (exit {LEASE_LOST}) before another job can take "
                f"{self.output_dir} over; a restart goes on from the last complete checkpoint")
        say(line, sys.stderr)
        record_end(LEASE_LOST, line)
        os._exit(LEASE_LOST)

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
        except ConfigError as error:
            refusal = [str(error)]
    collectives.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise ConfigError(refusal[0])
    try:
        yield
    finally:
        if lease is not None:
            lease.release()
