"""The output directory's lease (resilience/run_lease.py): one live job writes an output_dir; a gone job's lease is
taken over, by one of two takers at once. tests/test_supervision.py runs a refused job against a real run."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from errors import ConfigError
from resilience.exit_codes import LEASE_LOST
from resilience.run_lease import LEASE_FILE, STALE_SECONDS, RunLease, boot_id, read_lease
from tests.conftest import ROOT
from tests.test_reliability import small_disk  # noqa: F401 (a fixture)

# A job's rank 0 on stdin's commands: "take" the lease (prints "won" or the refusal), anything else drops it.
LEASE_TAKER = """
import sys
from resilience.run_lease import RunLease
lease = None
for command in sys.stdin:
    if command == "take\\n":
        try:
            lease = RunLease(sys.argv[1])
            print("won", flush=True)
        except ValueError as error:
            print(error, flush=True)
    else:
        if lease is not None:
            lease.release()
        lease = None
        print("dropped", flush=True)
"""


def test_an_output_dir_another_live_job_writes_is_refused_and_a_gone_jobs_lease_taken_over(tmp_path):
    """Rank 0's lease (host, boot, pid, token, heartbeat): another live process's with a fresh heartbeat refuses,
    on this host or another; a dead process's on this host, or anyone's not renewed for STALE_SECONDS, is taken."""
    out, host = str(tmp_path), socket.gethostname()
    path = tmp_path / LEASE_FILE
    dead = subprocess.Popen(["true"])  # a process that has ended: its pid names no one (until reused)
    dead.wait()
    here = {"host": host, "boot_id": boot_id(), "pid": os.getppid(), "token": "another job"}  # a live process

    def refusal(lease, age):
        path.write_text(json.dumps({**lease, "heartbeat": time.time() - age}))
        before = path.read_bytes()
        with pytest.raises(ValueError) as refused:
            RunLease(out)
        assert path.read_bytes() == before  # left as it was
        return str(refused.value)
    assert re.fullmatch(
        rf"output_dir '{out}' is being written by another live job: its rank 0, pid {os.getppid()} on {host}, "
        rf"renewed {path} (5|6)s ago; choose another output_dir, or stop that job \(a lease not renewed for 300s is "
        rf"taken over; delete the file only if that job is gone\).", refusal(here, age=5))
    elsewhere = {**here, "host": "node7", "boot_id": "another machine", "pid": dead.pid}
    assert "its rank 0, pid" in refusal(elsewhere, age=STALE_SECONDS - 30)  # its pid means nothing here
    for gone, age in (({**here, "pid": dead.pid}, 0), (elsewhere, STALE_SECONDS + 1)):
        path.write_text(json.dumps({**gone, "heartbeat": time.time() - age}))
        held = RunLease(out)
        assert {k: read_lease(out)[k] for k in ("host", "boot_id", "pid")} == {"host": host, "boot_id": boot_id(),
                                                                                "pid": os.getpid()}
        held.release()
        assert not path.exists()


def test_two_jobs_taking_over_a_stale_lease_at_once_one_wins_and_the_other_is_refused(tmp_path):
    """Two processes told to take over a gone job's lease in the same moment, 20 times: each time one holds it and
    the other is refused, naming the winner (without the lock both won in 48 of 50 rounds)."""
    out, host = str(tmp_path), socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    takers = [subprocess.Popen([sys.executable, "-c", LEASE_TAKER, out], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, bufsize=1) for _ in range(2)]
    try:
        for _ in range(20):
            (tmp_path / LEASE_FILE).write_text(json.dumps({"host": host, "boot_id": boot_id(), "pid": dead.pid,
                                                           "token": "a gone job", "heartbeat": time.time()}))
            for taker in takers:
                taker.stdin.write("take\n")
            for taker in takers:
                taker.stdin.flush()
            answers = [taker.stdout.readline().strip() for taker in takers]
            assert sorted(answers)[1] == "won", answers
            winner = takers[answers.index("won")]
            assert re.fullmatch(rf"output_dir '{out}' is being written by another live job: its rank 0, pid "
                                rf"{winner.pid} on {host}, renewed {tmp_path / LEASE_FILE} \d+s ago; .*",
                                sorted(answers)[0]), answers
            assert read_lease(out)["pid"] == winner.pid
            for taker in takers:
                taker.stdin.write("drop\n")
                taker.stdin.flush()
            assert [taker.stdout.readline() for taker in takers] == ["dropped\n"] * 2
    finally:
        for taker in takers:
            taker.stdin.close()
            taker.wait(timeout=30)


# A job's rank 0 running "trainer_pipe.py -cn tiny output_dir=OUT" plus extra arguments, heartbeats every
# HEARTBEAT seconds: takes OUT's lease (prints "won", or its refusal) and holds it until stdin closes.
SAME_COMMAND = """
import sys
from resilience import run_lease
out, run_lease.HEARTBEAT_SECONDS, run_lease.STALE_SECONDS = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
sys.argv = ["trainer_pipe.py", "-cn", "tiny", f"output_dir={out}", *sys.argv[4:]]
try:
    lease = run_lease.RunLease(out)
except ValueError as error:
    print(error, flush=True)
    sys.exit(1)
print("won", flush=True)
sys.stdin.read()
lease.release()
"""


def holder(out, heartbeat, stale, *arguments):
    return subprocess.Popen([sys.executable, "-c", SAME_COMMAND, str(out), str(heartbeat), str(stale), *arguments],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_requeued_job_takes_its_own_lease_without_waiting_out_the_stale_limit(tmp_path, monkeypatch, capsys):
    """A job ended uncleanly on another node left a fresh lease. Its requeue (Slurm: the same job id, a later
    restart count) takes it at once; a rerun of the same command (less resume=) takes it once it missed two
    renewals, saying so; another job is refused as before. The old lease refused both for 300 s, with exit 78."""
    from resilience import run_lease
    out, path = str(tmp_path), tmp_path / LEASE_FILE
    elsewhere = {"host": "node7", "boot_id": "another machine", "pid": 4242, "token": "the job's first run",
                 "taken": time.time() - 3600}
    monkeypatch.setattr(sys, "argv", ["trainer_pipe.py", "-cn", "tiny", f"output_dir={out}"])
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    path.write_text(json.dumps({**elsewhere, "job": "77", "restart": 0, "command": "another", "heartbeat": time.time()}))
    RunLease(out).release()  # at once
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setattr(run_lease, "HEARTBEAT_SECONDS", 1)
    command = run_lease.job_command()
    monkeypatch.setattr(sys, "argv", [*sys.argv, "resume=auto"])  # a supervised restart's: the same command
    assert run_lease.job_command() == command
    path.write_text(json.dumps({**elsewhere, "job": None, "command": command, "heartbeat": time.time() - 0.5}))
    capsys.readouterr()
    started = time.monotonic()
    lease = RunLease(out)
    assert 1 <= time.monotonic() - started < 10 and read_lease(out)["pid"] == os.getpid()
    assert re.fullmatch(rf"output_dir '{out}' holds the lease of an earlier run of this job \(pid 4242 on node7, "
                        rf"renewed [01]s ago\): taking it over unless it is renewed within 2s of that\n",
                        capsys.readouterr().out)
    lease.release()
    path.write_text(json.dumps({**elsewhere, "job": None, "command": "another", "heartbeat": time.time()}))
    with pytest.raises(ConfigError, match="is being written by another live job: its rank 0, pid 4242 on node7"):
        RunLease(out)


@pytest.mark.slow
def test_the_same_command_launched_twice_is_refused_once_the_first_renews(tmp_path):
    """The same command started again while its first run still runs (a live twin, not a requeue): the second
    waits for the first's renewal, then refuses like any other live job."""
    first = holder(tmp_path, 1, 300)
    try:
        assert first.stdout.readline() == "won\n", first.stderr.read()
        time.sleep(0.1)  # a later start: a start time is read to the kernel's clock tick (10 ms)
        second = holder(tmp_path, 1, 300, "resume=auto")
        out, _ = second.communicate(timeout=60)
        lines = out.splitlines()
        assert lines[0].startswith(f"output_dir '{tmp_path}' holds the lease of an earlier run of this job (pid "
                                   f"{first.pid} on {socket.gethostname()}"), out
        assert lines[1].startswith(f"output_dir '{tmp_path}' is being written by another live job: its rank 0, pid "
                                   f"{first.pid}"), out
        assert second.returncode == 1 and read_lease(str(tmp_path))["pid"] == first.pid
    finally:
        first.stdin.close()
        first.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["read_only", "taken_over"])
def test_a_lease_that_cannot_be_renewed_ends_the_run_restartably(tmp_path, small_disk, failure):
    """The heartbeat's filesystem fails (here a tmpfs remounted read-only: EROFS; on NFS ESTALE or EIO) for half of
    the stale limit, or another job took the lease over: rank 0 says so in one line and exits LEASE_LOST, which a
    supervisor restarts, before two jobs write output_dir. The old heartbeat thread ended without a word, and the
    run went on (exit 0 here)."""
    disk = small_disk(2**20)
    first = holder(disk, 0.2, 2)
    assert first.stdout.readline() == "won\n", first.stderr.read()
    if failure == "read_only":
        small_disk(2**20, read_only=True)
    else:
        (disk / LEASE_FILE).write_text(json.dumps({**read_lease(str(disk)), "pid": 4242, "host": "node7",
                                                   "token": "another job", "heartbeat": time.time()}))
    try:
        first.wait(timeout=60)  # its stdin open: it holds the lease until the heartbeat ends it
    finally:
        first.kill()
    err = first.stderr.read()
    assert first.returncode == LEASE_LOST, err
    why = (rf"{disk / LEASE_FILE} could not be renewed for [12]s \(OSError: \[Errno 30\] Read-only file system: .*\)"
           if failure == "read_only" else
           rf"{disk / LEASE_FILE} was taken over by pid 4242 on node7 while this job did not renew it")
    assert re.search(rf"^trainer_pipe: error: {why}; stopping \(exit 69\) before another job can take {disk} over; a "
                     rf"restart goes on from the last complete checkpoint$", err, re.MULTILINE), err
