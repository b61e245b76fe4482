"""Restart on failure, resume where it stopped: run a launch command (the `deepspeed` runner, `srun`, torchrun) again
when it fails, until it succeeds: as given until the run has saved a checkpoint of its own, then with resume=auto. DeepSpeed's runner and Slurm's srun end the job at the first
failed rank and have no restart; torchrun's own (--max-restarts, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
docs/reliability.md) passes on no exit code, so it restarts what a restart cannot fix, and names no cause; hence this
loop, with fresh processes each time.

Each failure gets one line naming its cause: the exit code (resilience/exit_codes.py), the rank that failed first and
why, a rank that died without a word (its start-up record only: killed, stopped, its node lost) and who was waiting
for whom (the ranks' records, resilience/rank_records.py). What a restart cannot fix (a config error, a refused
checkpoint, a full disk, a non-finite loss) and a preemption (the scheduler's to requeue) end the supervisor with the
run's exit code. A SIGTERM or SIGINT launches nothing more: the attempt running is asked to stop (its ranks save) and
the supervisor exits PREEMPTED once its ranks have. The restart budget counts failures in a row without a new complete checkpoint: a run that keeps
saving between failures (weeks of them, one every few hours) is never given up, one that cannot get past a step is.
"""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil

from checkpoints.files import read_latest
from checkpoints.tag_dirs import checkpoint_identities, newest_tag
from resilience.run_lease import (HEARTBEAT_SECONDS, LEASE_TOKEN_ENV, boot_id, process_alive, read_lease,
                                  release_lease_of)
from deepspeed_internals import LAUNCHER_MODULE
from resilience.exit_codes import NOT_RESTARTABLE, PREEMPTED, describe
from resilience.rank_records import read_records

TRAINER_CONFIG = ("conf", "tiny")  # trainer_pipe.py's @hydra.main config_path and config_name
RANKS_NAMED = 4  # most ranks one line names per kind (a thousand-rank job's line stays a line)
POLL_SECONDS = 0.02  # how often an attempt's ranks are looked at: a few /proc reads (~50 us) within 2 fast steps
SCAN_SECONDS = 1  # how often its whole process tree is, for a stopped one
EXIT_POLL_SECONDS = 0.001  # how often an ended attempt's ranks are, until each has exited (a few of them, ~50 ms)
STOP_POLL_SECONDS = 0.1  # how often a stopped attempt's processes are, while its ranks save (seconds to minutes)


class Supervisor:
    def __init__(self, command, output_dir, max_restarts, backoff_seconds, max_backoff_seconds, log=None):
        self.command, self.output_dir, self.max_restarts = list(command), output_dir, max_restarts
        self.backoff_seconds, self.max_backoff_seconds = backoff_seconds, max_backoff_seconds
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.process, self.stop_requested = None, None
        self.stop_wanted, self.stopping = threading.Event(), []  # set on SIGTERM/SIGINT; the processes then running
        self.lease_token = uuid.uuid4().hex  # its attempts' rank 0 holds output_dir under it (resilience/run_lease.py)

    def run(self):
        """The command's exit code once it succeeds, cannot be helped by a restart, or has failed max_restarts + 1
        times in a row without saving a new checkpoint; PREEMPTED once a SIGTERM or SIGINT has stopped it."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        at_start = checkpoint_identities(self.output_dir)
        failures_in_a_row, attempt = 0, 0
        while True:
            attempt += 1
            before, started = checkpoint_identities(self.output_dir), time.time()
            # The command as given until this run has saved a checkpoint of its own: a fresh start's refusal of a
            # used output_dir and overwrite_output_dir still act, and a resume from an older checkpoint is redone
            # (its abandoned branch moved aside) rather than resume=auto picking that branch up again.
            resumes = saved_since(at_start, before)
            self.process = subprocess.Popen(with_resume_auto(self.command) if resumes else self.command,
                                            env={**os.environ, LEASE_TOKEN_ENV: self.lease_token})
            if self.stop_requested is not None:  # asked between the last look and the launch
                self._forward_stop()
            code = self.wait_for_attempt(started)
            if self.stop_requested is not None:
                return self.stopped(attempt, code, started)
            release_lease_of(self.output_dir, self.lease_token)  # the attempt's ranks are gone
            if code == 0:
                return 0
            records = read_records(self.output_dir, since=started)
            cause = explain_failure(code, records)
            unfixable = [c for c in [code] + [r.get("exit_code") for r in records if not r.get("follows_another")]
                         if c in NOT_RESTARTABLE]
            if unfixable:
                self.log(f"supervise: not restarting after {NOT_RESTARTABLE[unfixable[0]]}, which a restart cannot "
                         f"fix: attempt {attempt} ended with {cause}")
                return code
            now = checkpoint_identities(self.output_dir)
            if saved_since(before, now):
                failures_in_a_row = 0  # it saved since the last failure: progress
            latest = newest_tag(now)
            if failures_in_a_row >= self.max_restarts:
                self.log(f"supervise: error: {failures_in_a_row + 1} failures in a row without a new checkpoint "
                         f"spent the restart budget (--max-restarts {self.max_restarts}); the last ended with {cause}; "
                         f"fix the cause and rerun the same command (it resumes from "
                         f"{latest or 'the start: no complete checkpoint yet'}).")
                return code
            failures_in_a_row += 1
            wait = min(self.backoff_seconds * 2 ** (failures_in_a_row - 1), self.max_backoff_seconds)
            how = (f"resume=auto (from {latest})" if saved_since(at_start, now)
                   else "the same command (this run has saved no checkpoint yet)")
            self.log(f"supervise: restart {failures_in_a_row} of {self.max_restarts} in {wait:.0f}s with {how}: "
                     f"attempt {attempt} ended with {cause}")
            if self.stop_wanted.wait(wait):
                self.log(f"supervise: {signal.Signals(self.stop_requested).name} received during the backoff: "
                         f"nothing more is launched; rerun the same command to continue "
                         f"({f'from {latest}' if latest else 'no complete checkpoint yet'}).")
                return PREEMPTED

    def stopped(self, attempt, code, started):
        """After a SIGTERM or SIGINT passed on to the attempt: once its ranks have exited (their preemption save
        done: a `deepspeed` runner dies at once on the signal, its ranks save after it), the lease is dropped, and
        the exit code is PREEMPTED where a rank saved and stopped, else the attempt's own."""
        self.wait_for_ranks()
        release_lease_of(self.output_dir, self.lease_token)
        records = read_records(self.output_dir, since=started)
        name, latest = signal.Signals(self.stop_requested).name, read_latest(self.output_dir)
        if code != 0 and any(r.get("exit_code") == PREEMPTED for r in records):
            self.log(f"supervise: {name} received: attempt {attempt} stopped, its ranks saved ({latest}) and exited "
                     f"{PREEMPTED}; nothing is restarted: rerun the same command (or requeue the job) to continue")
            return PREEMPTED
        self.log(f"supervise: {name} received: not restarting; attempt {attempt} ended with "
                 f"{explain_failure(code, records) if code else 'exit code 0: finished'}")
        return code

    def wait_for_ranks(self):
        """Until every process of the stopped attempt has exited, its ranks' saves done: those listed when the stop
        was passed on (an orphan of a runner that died at once on it has no parent to list it by) and any still
        under the launch, and the attempt's rank 0 wherever it runs (the lease's holder). A stopped one, which can
        neither save nor exit, is SIGKILLed."""
        while True:
            processes = self.stopping + tree_of(self.process.pid)[1:]
            if all(map(has_exited, processes)) and not lease_holder_live(self.output_dir, self.lease_token):
                return
            for process in processes:
                if is_stopped(process):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
            time.sleep(STOP_POLL_SECONDS)

    def wait_for_attempt(self, started):
        """The attempt's exit code. DeepSpeed's launcher looks at its ranks once a second (hard-coded) and, once one
        has failed, SIGTERMs the others, waiting 30 s (hard-coded) for a stopped one before its SIGKILL; then it and
        the runner exit, their interpreters' shutdown taking up to seconds. So every POLL_SECONDS the supervisor looks
        at the children of the launchers it started on this host; once a rank (one that recorded its start) has
        exited non-zero, it SIGKILLs the stopped processes and ends the attempt (end_attempt), whose exit code is that
        rank's, as the launcher passes it on: its zombie's, or, where its launcher has reaped it already (its
        teardown, then under way, passes on that rank's), the one its record names. Any other failure (a rank on
        another node, under another launcher, one that failed before its record, one its launcher reaped with no
        exit code recorded: killed) is the launcher's to act on; its stopped processes here are SIGKILLed once a
        record says a rank failed."""
        host, launchers, scanned = socket.gethostname(), [], time.monotonic()
        live, reaped = set(), {}  # the launchers' children at the last look; the failed ranks they reaped since
        while True:
            try:
                return self.process.wait(timeout=POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_requested is not None:  # its ranks are saving: their exits are no failure to act on
                continue
            try:
                launchers = launchers or deepspeed_launchers(self.process.pid)
                children = [child for launcher in launchers for child in children_of(launcher)]
                failed, gone = failed_children(children), live.difference(children)
                if failed or gone:
                    records = read_records(self.output_dir, since=started)
                    reaped.update(reaped_failures(gone, records, host))
                    code = first_failure_code({**reaped, **failed}, records, host)
                    if code is not None:
                        self.kill_stopped(started, host, force=True)
                        self.end_attempt(launchers, tearing_down=bool(reaped))
                        return code
                live = set(children)
                if time.monotonic() - scanned >= SCAN_SECONDS:
                    scanned = time.monotonic()
                    self.kill_stopped(started, host, force=False)
            except (OSError, psutil.Error):  # a process ended meanwhile: the next poll sees the rest
                pass

    def end_attempt(self, launchers, tearing_down):
        """DeepSpeed's launcher's teardown, at once: it SIGTERMs each rank's process tree and waits for it to exit
        before the next rank's, so here every rank's tree is SIGTERMed together (a rank takes it after a sibling's
        exit as its launcher's end of the job), and the launchers are SIGTERMed unless tearing_down already. Back once
        the ranks have exited, leaving the launchers to reap them (a zombie holds nothing: no memory, device or port)
        and to exit, and the runner too, while the next attempt starts."""
        ranks = [rank for launcher in launchers for rank in children_of(launcher)]
        trees = [tree_of(rank) for rank in ranks]  # all listed before any exits: an orphan has no parent to list it
        ranks = [tree[0] for tree in trees if tree]
        for process in [process for tree in trees for process in tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        for launcher in launchers if not tearing_down else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher, signal.SIGTERM)
        while not all(map(has_exited, ranks)):
            time.sleep(EXIT_POLL_SECONDS)
        threading.Thread(target=self.process.wait, daemon=True).start()  # reaps the runner when it has exited

    def kill_stopped(self, started, host, force):
        """SIGKILL the attempt's stopped processes on this host once a rank has failed: force (a failed rank seen
        here), or a record saying so, of a rank elsewhere or one its launcher has reaped (taking its exit code)."""
        processes = tree_of(self.process.pid)[1:]  # its own processes' /proc files, not every process of the host
        stopped = [p for p in processes if is_stopped(p)]
        if not stopped:
            return
        records = read_records(self.output_dir, since=started)
        unreaped = {p.pid for p in processes}  # a zombie too: its launcher has not seen its exit yet
        if not force and not any(r.get("exit_code") and (r["host"] != host or r["pid"] not in unreaped)
                                 for r in records):
            return
        for process in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        ranks = {r["pid"]: r["rank"] for r in records if r["host"] == host}
        named = ", ".join(f"rank {ranks[p.pid]} (pid {p.pid})" if p.pid in ranks else f"pid {p.pid}" for p in stopped)
        self.log(f"supervise: SIGKILLed {named}: stopped, it cannot take the SIGTERM that ends the attempt after a "
                 f"rank failed")

    def _request_stop(self, signum, frame):
        """A scheduler's SIGTERM (or ^C): nothing is launched after it, and the attempt running is asked to stop,
        which its ranks do with a checkpoint (docs/reliability.md#preemption)."""
        if self.stop_requested is None:
            self.stop_requested = signum
            self.stop_wanted.set()
        self._forward_stop()

    def _forward_stop(self):
        """SIGTERM, the ranks' preemption request, to the launch (SIGINT too becomes it: srun takes a single ^C as a
        request for its status), its processes listed first."""
        if self.process is not None and self.process.poll() is None:
            self.stopping += tree_of(self.process.pid)[1:]
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)


def lease_holder_live(output_dir, token):
    """Whether output_dir's lease is the supervisor's (token) and its holder, the attempt's rank 0, still runs: its
    process, on this host; its heartbeat, renewed within the last two periods, on another (a launcher that reaches
    its nodes through ssh starts rank 0 outside the supervisor's processes)."""
    lease = read_lease(output_dir)
    if lease is None or lease["token"] != token:
        return False
    if lease["host"] == socket.gethostname() and lease["boot_id"] == boot_id():
        return process_alive(lease["pid"])
    return time.time() - lease["heartbeat"] < 3 * HEARTBEAT_SECONDS


def is_stopped(process):
    try:
        return process.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:  # ended since it was listed
        return False


def has_exited(process):
    """Whether a psutil.Process has exited: gone, or a zombie its parent has not reaped yet."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def tree_of(pid):
    """[psutil.Process] of pid and its descendants (each listed through children_of), [] once it has ended."""
    tree, pids = [], [pid]
    for each in pids:
        with contextlib.suppress(OSError, psutil.NoSuchProcess):
            tree.append(psutil.Process(each))
            pids += children_of(each)
    return tree


def deepspeed_launchers(pid):
    """The pids of the DeepSpeed launchers among pid's children: a runner's local launch."""
    return [child for child in children_of(pid) if LAUNCHER_MODULE in " ".join(psutil.Process(child).cmdline())]


def children_of(pid):
    """pid's child processes, from /proc/PID/task/*/children (psutil's children() reads every process of the host)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(child) for child in f.read().split()]
    return children


def failed_children(children):
    """{pid: exit code, as a DeepSpeed launcher passes it on (a signal's as 256 - signal)} of the launchers'
    `children` (their ranks, or a command run at their start) that have exited non-zero and are not yet reaped
    (/proc/PID/stat: a zombie's wait status)."""
    failed = {}
    for child in children:
        with open(f"/proc/{child}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # from the state (field 3) on; the exit status is 52nd
        if fields[0] == "Z" and int(fields[49]):
            failed[child] = os.waitstatus_to_exitcode(int(fields[49])) & 0xFF
    return failed


def reaped_failures(gone, records, host):
    """{pid: the exit code its record names, None where it names none (killed)} of the failed ranks among `gone`
    (children of this host's launchers at a look, reaped by the next): their launcher's teardown is under way."""
    return {r["pid"]: r.get("exit_code") for r in records
            if r["host"] == host and r["pid"] in gone and r.get("exit_code") != 0}


def first_failure_code(failed, records, host):
    """The exit code of the failed child (failed: {pid: exit code, None where unknown}) that is the cause: a rank
    (its record names its pid) that failed on its own or without a word (killed) before one whose collective failed;
    None where none is a rank, or the cause's exit code is unknown (its launcher passes it on)."""
    ranks = {r["pid"]: r for r in records if r["host"] == host}
    causes = sorted((bool(ranks[pid].get("in_communication")), pid) for pid in failed
                    if pid in ranks and not ranks[pid].get("follows_another"))
    return failed[causes[0][1]] if causes else None


def saved_since(before, now):
    """Whether checkpoint_identities `now` holds a checkpoint saved since `before` was read."""
    return bool(set(now.items()) - set(before.items()))


def with_resume_auto(command):
    """command with resume=auto: added when it names no resume, in place of the one it names."""
    named = [i for i, arg in enumerate(command) if arg.startswith("resume=")]
    if not named:
        return command + ["resume=auto"]
    return [("resume=auto" if i in named else arg) for i, arg in enumerate(command)]


def explain_failure(code, records):
    """One line: the exit code's cause, the first rank that failed and why, the ranks that left no word, and the
    peers the others were waiting for."""
    parts = [describe(code)]
    silent = [r for r in records if "ended" not in r]
    if silent:
        parts.append(f"{name_ranks(silent)} ended without a word (killed by SIGKILL or the OOM killer, stopped, or "
                     f"its node lost)")
    failed = sorted((r for r in records if r.get("exit_code") and not r.get("follows_another")),
                    key=lambda r: r["ended"])
    # A rank's own failure (the watchdog's exit, its own exception) or a silent one (killed) is the cause that ranks
    # failing in a collective saw: these are named first only where nothing else is to blame.
    own = [r for r in failed if not r.get("in_communication")]
    if own or (failed and not silent):
        first = (own or failed)[0]
        parts.append(f"first failed: rank {first['rank']} on {first['host']} ({describe(first['exit_code'])}): "
                     f"{first['cause']}")
    waited = {}
    for record in records:
        if record.get("waiting_for") is not None:
            waited.setdefault(record["waiting_for"], []).append(record)
    for peer, waiters in sorted(waited.items()):
        shown = "; ".join(f"rank {r['rank']} {r['where']}" for r in waiters[:RANKS_NAMED])
        more = f" and {len(waiters) - RANKS_NAMED} more" if len(waiters) > RANKS_NAMED else ""
        parts.append(f"waiting for rank {peer}: {shown}{more}")
    return "; ".join(parts)


def name_ranks(records):
    shown = ", ".join(f"rank {r['rank']} on {r['host']} (pid {r['pid']})" for r in records[:RANKS_NAMED])
    return shown + (f" and {len(records) - RANKS_NAMED} more ranks" if len(records) > RANKS_NAMED else "")


def output_dir_of(command):
    """The output_dir the trainer in `command` writes to: its config composed as trainer_pipe.py composes it (the
    arguments after the first .py file: -cp, -cn and key=value overrides)."""
    from hydra import compose, initialize_config_dir
    script = next((i for i, arg in enumerate(command) if arg.endswith(".py") and os.path.isfile(arg)), None)
    if script is None:
        raise ValueError(f"no trainer script (a .py file that exists) in the command {' '.join(command)}; name the "
                         f"run's directory with --output-dir.")
    config_path, config_name, overrides, args = *TRAINER_CONFIG, [], iter(command[script + 1:])
    for arg in args:
        if arg in ("-cp", "--config-path"):
            config_path = next(args)
        elif arg in ("-cn", "--config-name"):
            config_name = next(args)
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
    config_dir = os.path.join(os.path.dirname(os.path.abspath(command[script])), config_path)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=overrides).output_dir
