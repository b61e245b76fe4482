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

from resilience.run_lease import LEASE_FILE, STALE_SECONDS, RunLease, boot_id, read_lease
from tests.conftest import ROOT

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
