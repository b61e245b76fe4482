"""The supervisor's first attempt and its signals: the command runs as given until the run has saved a checkpoint of
its own (then resume=auto), and a SIGTERM launches nothing more, waits for the ranks' preemption save and exits 75
with the lease dropped only after the ranks have exited. Real processes, real signals."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from resilience import exit_codes
from resilience.run_lease import LEASE_FILE
from tests.conftest import ROOT
from tests.launch import demo_overrides, process_environment, read_metrics, run_python, trainer_command, StartedRunner

FAULT_SCRIPT = os.path.join("tests", "fault_injection.py")
# An attempt: appends its arguments to ARGS_LOG; on the attempt SAVE_ON names, deletes output_dir's checkpoints (as
# overwrite_output_dir=true does) and saves a complete one, global_stepN (N its attempt number); exits 1, or 0 on the
# attempt FINISH_ON names.
ATTEMPT = """
import json, os, shutil, sys
out = os.environ["OUT"]
with open(os.environ["ARGS_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
attempt = sum(1 for _ in open(os.environ["ARGS_LOG"]))
if str(attempt) == os.environ.get("SAVE_ON"):
    for name in os.listdir(out):
        shutil.rmtree(f"{out}/{name}")
    os.makedirs(f"{out}/global_step{attempt}")
    open(f"{out}/global_step{attempt}/COMPLETE", "w").close()
sys.exit(0 if str(attempt) == os.environ.get("FINISH_ON") else 1)
"""


def attempt_args(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_the_command_runs_as_given_until_the_run_has_saved_then_with_resume_auto(tmp_path):
    """Attempt 1 (a fresh start with overwrite_output_dir=true) fails before it has deleted the older run's
    checkpoint or saved one: attempt 2 runs the same command (a resume=auto there would resume the older run,
    global_step9); it deletes it, saves global_step2 and fails: attempt 3 resumes that with resume=auto, in place of
    the resume= the command names."""
    log, out = tmp_path / "args.jsonl", tmp_path / "out"
    (out / "global_step9").mkdir(parents=True)
    (out / "global_step9" / "COMPLETE").write_text("global_step9")  # an older run's
    command = [sys.executable, "-c", ATTEMPT, "overwrite_output_dir=true", "resume=null"]
    result = supervise(command, "--backoff-seconds", "0", "--output-dir", str(out),
                       env=dict(OUT=str(out), ARGS_LOG=str(log), SAVE_ON="2", FINISH_ON="3"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert attempt_args(log) == [["overwrite_output_dir=true", "resume=null"]] * 2 + [
        ["overwrite_output_dir=true", "resume=auto"]]
    assert re.findall(r"supervise: restart .*", result.stderr) == [
        "supervise: restart 1 of 3 in 0s with the same command (this run has saved no checkpoint yet): attempt 1 "
        "ended with exit code 1: a rank crashed",
        "supervise: restart 1 of 3 in 0s with resume=auto (from global_step2): attempt 2 ended with exit code 1: a "
        "rank crashed"]


@pytest.mark.slow
def test_a_supervised_fresh_start_into_a_used_output_dir_is_refused(demo_model, tmp_path):
    """The trainer's refusal of an output_dir holding another run's checkpoints acts under the supervisor too (its
    first attempt is not turned into a resume of that run), and is not restarted."""
    out = tmp_path / "run"
    (out / "global_step4").mkdir(parents=True)
    (out / "global_step4" / "COMPLETE").write_text("global_step4")
    command = [sys.executable, "trainer_pipe.py", "-cp", "conf", "-cn", "tiny", *demo_overrides(demo_model, out, num_stages=1)]
    result = supervise(command, "--backoff-seconds", "0", timeout=300)
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stderr[-3000:]
    assert (f"trainer_pipe: error: output_dir '{out}' already holds checkpoints (global_step4); set resume=auto to "
            f"continue from global_step4, choose another output_dir, or set overwrite_output_dir=true to delete "
            f"them.") in result.stderr
    assert result.stderr.splitlines()[-1].startswith("supervise: not restarting after a config error")


@pytest.mark.slow
def test_a_sigterm_during_the_backoff_launches_nothing_more(tmp_path):
    """The first attempt fails; during the 60 s backoff the supervisor gets SIGTERM: it exits 75 at once, having
    launched no second attempt."""
    log, out = tmp_path / "args.jsonl", tmp_path / "out"
    out.mkdir()
    supervisor = subprocess.Popen([sys.executable, "supervise.py", "--backoff-seconds", "60", "--output-dir",
                                   str(out), "--", sys.executable, "-c", ATTEMPT], cwd=ROOT, stderr=subprocess.PIPE,
                                  text=True, env=process_environment("cpu", dict(OUT=str(out), ARGS_LOG=str(log))))
    line = supervisor.stderr.readline()
    assert line.startswith("supervise: restart 1 of 3 in 60s"), line
    signalled = time.monotonic()
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == exit_codes.PREEMPTED
    assert time.monotonic() - signalled < 10
    assert supervisor.stderr.read() == ("supervise: SIGTERM received during the backoff: nothing more is launched; "
                                        "rerun the same command to continue (no complete checkpoint yet).\n")
    assert len(attempt_args(log)) == 1


@pytest.mark.slow
def test_a_sigterm_during_a_run_waits_for_the_ranks_save_then_exits_75_and_drops_the_lease(demo_model, tmp_path):
    """A supervised `deepspeed` launch (2 stages) with rank 0 in step 3; SIGTERM to the supervisor, which passes it on
    to the runner: the runner dies at once, its ranks save step 3 and exit 75, and only then does the supervisor drop
    the lease and exit 75, launching nothing more."""
    out = tmp_path / "run"
    run = dict(num_stages=2, gradient_accumulation_steps=2, max_steps=6, save_steps=0, logging_steps=1,
               eval_file="null")
    command, env = trainer_command(2, demo_overrides(demo_model, out, **run), "tiny", None, FAULT_SCRIPT,
                                   {"FAULT": "pause:0:3"})
    supervisor = StartedRunner([sys.executable, "supervise.py", "--backoff-seconds", "0", "--", *command], env)
    output = []
    for line in supervisor.stdout:
        output.append(line)
        if "PAUSED_AT 3" in line:
            break
    assert "PAUSED_AT 3" in output[-1], "".join(output)[-3000:]
    launch = psutil.Process(supervisor.pid).children(recursive=True)  # the runner, its launcher and the 2 ranks
    assert len(launch) == 4 and (out / LEASE_FILE).exists()
    supervisor.send_signal(signal.SIGTERM)
    output.append(supervisor.stdout.read())  # until every process writing to it has exited
    code = supervisor.wait(timeout=120)
    output = "".join(output)
    assert code == exit_codes.PREEMPTED, output[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in launch)
    assert not (out / LEASE_FILE).exists()
    assert (out / "latest").read_text() == "global_step3" and (out / "global_step3" / "COMPLETE").is_file()
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3]
    assert ("supervise: SIGTERM received: attempt 1 stopped, its ranks saved (global_step3) and exited 75; nothing is "
            "restarted: rerun the same command (or requeue the job) to continue") in output, output[-3000:]
    assert "supervise: restart" not in output


def supervise(command, *flags, env=None, timeout=300):
    return run_python(["supervise.py", *flags, "--", *command], timeout=timeout, env=env)
