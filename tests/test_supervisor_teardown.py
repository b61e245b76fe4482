"""How the supervisor ends a failed attempt under DeepSpeed's launcher (resilience/supervisor.py wait_for_attempt): with
the failed rank's exit code, as soon as the ranks have exited, whether or not their launcher has reaped them. A real
runner, launcher and rank (small stand-ins: no training), real signals."""
import contextlib
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT
from resilience import exit_codes


# A rank that records its start, waits for the file argv[2], then records being hung and exits 70; a launcher (its
# command line names DeepSpeed's) that ignores SIGTERM and either reaps the rank at once, as DeepSpeed's does at its
# poll, or leaves it a zombie, as DeepSpeed's teardown does while it ends the ranks before it, and exits a minute
# later; a runner that exits with the launcher's exit code.
HUNG_RANK = ("import os, sys, time\nfrom resilience.rank_records import RankRecord\nrecord = RankRecord(sys.argv[1], 0)\n"
             "while not os.path.exists(sys.argv[2]):\n    time.sleep(0.01)\nrecord.end(70, 'hang watchdog: ...')\n"
             "os._exit(70)")
LAUNCHER = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "rank = subprocess.Popen([sys.executable, '-c', *sys.argv[3:]])\n"
            "if sys.argv[2] == 'reaps':\n    rank.wait()\ntime.sleep(60)\nsys.exit(rank.wait())")


@pytest.mark.parametrize("launcher", ["reaps", "leaves a zombie"])
def test_a_hung_rank_ends_the_attempt_with_its_exit_code_once_exited_whenever_its_launcher_reaps_it(tmp_path,
                                                                                                   monkeypatch,
                                                                                                   launcher):
    """The hung rank exits 70: whether DeepSpeed's launcher reaped it before the supervisor looked (the exit code is
    then the one the rank recorded) or has not yet, the attempt ends with 70 once its ranks have exited, not after the
    launcher has reaped them or has exited (here a minute later), nor the runner."""
    from resilience import supervisor
    go, looks, look = tmp_path / "go", [], supervisor.children_of

    def children_of(pid):  # the rank goes on once the supervisor has seen it as its launcher's child twice
        children = look(pid)
        if pid != attempt.process.pid and children:
            looks.append(children)
            if len(looks) == 2:
                go.touch()
        return children
    monkeypatch.setattr(supervisor, "children_of", children_of)
    attempt, started = supervisor.Supervisor([], str(tmp_path), 0, 0, 0), time.time()
    attempt.process = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                        "sys.exit(subprocess.call(sys.argv[1:]))", sys.executable, "-c", LAUNCHER,
                                        "deepspeed.launcher.launch", launcher, HUNG_RANK, str(tmp_path), str(go)],
                                       cwd=ROOT)
    try:
        assert attempt.wait_for_attempt(started) == exit_codes.HUNG
        assert time.time() - started < 30 and len(psutil.Process(attempt.process.pid).children()) == 1
    finally:
        for process in psutil.Process(attempt.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        attempt.process.wait()
