"""How trainer_pipe.py ends, as its exit code: what the supervisor (resilience/supervisor.py), a batch script or a
person reads to decide whether a restart can help. sysexits.h's codes where one fits; no torch import, so the
supervisor stays a small process."""
import signal

CRASHED = 1              # an uncaught exception (a lost peer, a device fault): a restart may well help
CHECKPOINT_REFUSED = 65  # EX_DATAERR: a checkpoint failed its checksums or carries code
LEASE_LOST = 69          # EX_UNAVAILABLE: output_dir's lease could not be renewed (its filesystem failing) or was taken
HUNG = 70                # EX_SOFTWARE: the hang watchdog ended a rank that stopped making progress
DISK_FULL = 74           # EX_IOERR: a checkpoint does not fit on output_dir's disk
PREEMPTED = 75           # EX_TEMPFAIL: stopped on SIGTERM after saving; rerun (or requeue) with resume=auto
LOSS_NOT_FINITE = 76     # nan_policy=stop met a NaN/inf loss: the same data and weights give it again
CONFIG_ERROR = 78        # EX_CONFIG: a config value, path or input a person must change (errors.ConfigError)

# What a restart of the same command cannot fix; a preemption is the scheduler's to requeue.
NOT_RESTARTABLE = {
    CONFIG_ERROR: "a config error",
    CHECKPOINT_REFUSED: "a checkpoint refused",
    DISK_FULL: "a full disk",
    LOSS_NOT_FINITE: "a non-finite loss (nan_policy=stop)",
    PREEMPTED: "a preemption (the scheduler requeues the job; the checkpoint is saved)",
}
RESTARTABLE = {CRASHED: "a rank crashed", HUNG: "a rank hung", LEASE_LOST: "output_dir's lease was lost"}


def describe(code):
    """The cause an exit code names, for a log line."""
    known = {**NOT_RESTARTABLE, **RESTARTABLE}
    if code in known:
        return f"exit code {code}: {known[code]}"
    killed_by = killing_signal(code)
    return f"exit code {code}: killed by {killed_by}" if killed_by else f"exit code {code}"


def killing_signal(code):
    """The signal an exit code says a process died of, or None: negative, subprocess's convention; 193-255,
    sys.exit(-n), how DeepSpeed's launcher passes on a rank killed by signal n; 129-192, the shell's 128 + n."""
    number = -code if code < 0 else 256 - code if code > 192 else code - 128 if code > 128 else None
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return f"signal {number}"
