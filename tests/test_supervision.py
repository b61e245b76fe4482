"""A run that finishes without a person: the supervisor restarts failed launches with resume=auto, the hang
watchdog names and ends a stuck rank, and what a restart cannot fix is not restarted. Real launches, real signals."""
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from checkpoints.integrity import read_manifest
from resilience.run_lease import LEASE_FILE
from tests.conftest import ROOT
from tests.distributed import free_port
from tests.launch import (REFERENCE, SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, per_step_losses,
                          process_environment, read_metrics, run_python, trainer_command)
from tests.test_run_lease import LEASE_TAKER
from resilience import exit_codes
from cluster.distributed import elastic_restart_error
from resilience.hang_watchdog import startup_limit_warning
from engines.instruction_listeners import add_instruction_listener
from resilience.stragglers import find_stragglers
from resilience.supervisor import (children_of, explain_failure, failed_children, first_failure_code,
                                 reaped_failures)

FAULT_SCRIPT = os.path.join("tests", "fault_injection.py")
# 2 stages, fp32, checkpoints every 2 steps; the watchdog's step limit (at least 10 x the median step) well above a
# loaded machine's step time, and a hung step's wait short.
RUN = dict(num_stages=2, gradient_accumulation_steps=2, max_steps=8, save_steps=2, save_total_limit=10,
           logging_steps=1, learning_rate=1e-3, warmup_steps=2, eval_file="null")
WATCHDOG = {"hang_watchdog.min_step_seconds": 5, "hang_watchdog.startup_seconds": 300}


def supervise(command, *flags, env=None, timeout=900):
    return run_python(["supervise.py", *flags, "--", *command], timeout=timeout, env=env)


@pytest.fixture(scope="module")
def straight_run(demo_model, tmp_path_factory):
    """RUN without faults or a supervisor, synchronous saves: what the faulted runs must end equal to."""
    out = tmp_path_factory.mktemp("straight") / "run"
    check_ok(launch_trainer(2, demo_overrides(demo_model, out, **RUN)))
    return out


@pytest.mark.slow
def test_a_killed_and_a_hung_rank_are_restarted_and_the_run_ends_equal_to_a_straight_one(demo_model, straight_run,
                                                                                         tmp_path):
    """One supervised launch through DeepSpeed's runner: rank 1 is SIGKILLed at step 3 (latest: step 2), restarted;
    SIGSTOPped at step 6 (latest: step 4), which rank 0's watchdog finds stuck sending it step
    6's first activation and ends; restarted again, the run finishes with the straight run's weights, bit for bit,
    and losses. A new checkpoint between the failures renews the budget: --max-restarts 1 suffices. Each step is
    logged once in metrics.jsonl, TensorBoard, the CSV monitor and W&B (one run, resumed)."""
    straight, out = straight_run, tmp_path / "supervised"
    (tmp_path / "once").mkdir()
    (tmp_path / "wandb_package").mkdir()
    (tmp_path / "wandb_package" / "wandb.py").write_text(RECORDING_WANDB)
    faults = {"FAULT": "sigkill:1:3,sigstop:1:6", "FAULT_ONCE_DIR": str(tmp_path / "once")}
    monitors = {"deepspeed.csv_monitor.enabled": "true", "deepspeed.wandb.enabled": "true"}
    command, _ = trainer_command(2, demo_overrides(demo_model, out, **RUN, **WATCHDOG, **monitors), "tiny", None,
                                 FAULT_SCRIPT, faults)
    wandb = {"WANDB_CALLS": str(tmp_path / "wandb_calls.jsonl"), "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "wandb_package"), process_environment("cpu")["PYTHONPATH"]])}
    result = supervise(command, "--max-restarts", "1", "--backoff-seconds", "0", env={**faults, **wandb})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    # a rank's progress bar may be mid-line when the supervisor writes to the stderr they share
    restarts = re.findall(r"supervise: restart[^\r\n]*", result.stderr)
    assert len(restarts) == 2, restarts
    # the stopped rank 1 is ended as soon as rank 0's watchdog has: no wait for the launcher's SIGTERM to time out
    assert re.search(r"supervise: SIGKILLed rank 1 \(pid \d+\): stopped, it cannot take the SIGTERM that ends "
                     r"the attempt after a rank failed$", result.stderr, re.M), output[-5000:]
    assert re.fullmatch(r"supervise: restart 1 of 1 in 0s with resume=auto \(from global_step2\): attempt 1 ended "
                        r"with exit code 247: killed by SIGKILL; rank 1 on \S+ \(pid \d+\) ended without a word "
                        r"\(killed by SIGKILL or the OOM killer, stopped, or its node lost\)"
                        # rank 0 may be computing, not yet waiting for rank 1, when the attempt is ended
                        r"(; waiting for rank 1: rank 0 .+)?",
                        restarts[0])
    assert "first failed" not in restarts[0]  # rank 0's send failed after rank 1 died: the consequence, not named
    hang = (r"hang watchdog: rank 0 \(stage 0, data-parallel 0\) hung in SendActivation of micro-batch 1 at step 6, "
            r"waiting for rank 1: no progress for \d+s \(limit \d+s: 10 x the median step time [\d.]+s, at least "
            rf"hang_watchdog.min_step_seconds=5\); every thread's stack: {out}/hang/rank00000-stacks.txt; exiting 70 "
            r"for a restart")
    assert re.search(f"^{hang}$", result.stderr, re.M), output[-5000:]  # on a line of its own
    assert re.fullmatch(rf"supervise: restart 1 of 1 in 0s with resume=auto \(from global_step4\): attempt 2 ended "
                        rf"with exit code 70: a rank hung; rank 1 on \S+ \(pid \d+\) ended without a word .*; first "
                        rf"failed: rank 0 on \S+ \(exit code 70: a rank hung\): {hang}; waiting for rank 1: rank 0 "
                        rf"in SendActivation of micro-batch 1 at step 6", restarts[1])
    assert "train_batch" in (out / "hang" / "rank00000-stacks.txt").read_text()
    for name in sorted(os.listdir(straight / "global_step8")):
        if name.startswith("layer_") and name.endswith("-model_states.pt"):
            expected, got = (torch.load(run / "global_step8" / name, weights_only=True) for run in (straight, out))
            assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
    # each restart dropped the records of the steps it replayed: each step once, in order
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in logged] == list(range(1, 9))
    assert [record["loss"] for record in logged] == per_step_losses(straight)
    assert (f"{out}/metrics.jsonl: dropped the records of step(s) 5, which this run logs again (it starts after step "
            f"4)") in result.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard" / "train"))  # and hidden in TensorBoard
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("Train/loss")] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss in enumerate(per_step_losses(straight), 1)]
    with open(out / "csv" / "train" / "Train_loss.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "loss"]] + [[str(step), str(loss)] for step, loss in enumerate(
            per_step_losses(straight), 1)]
    wandb_calls = [json.loads(line) for line in (tmp_path / "wandb_calls.jsonl").read_text().splitlines()]
    run_id = (out / "wandb_run_id").read_text()
    assert [call["init"] for call in wandb_calls if "init" in call] == 3 * [
        {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow", "WANDB_MODE": "offline"}]
    assert [(call["step"], call["Train/loss"]) for call in wandb_calls if "Train/loss" in call] == list(
        enumerate(per_step_losses(straight), 1))


# A restart's rank 0 (world size 1): a first attempt's logger logs steps 1-6 (and lm-eval scores at 4 and 6, the
# pipeline's and an export's); its restart's logger, for a resume from step 4, logs steps 5-8.
REPLAYING_LOGGER = """
import os
import sys
from cluster.distributed import init_distributed
from training.metrics import RunLogger
out = sys.argv[1]
sys.path.insert(0, f"{out}/wandb_package")  # a recording wandb (RECORDING_WANDB)
init_distributed(timeout_minutes=1)
monitors = {"tensorboard": {"enabled": True, "output_path": f"{out}/tensorboard", "job_name": "train"},
            "csv_monitor": {"enabled": True, "output_path": f"{out}/csv", "job_name": "train"},
            "wandb": {"enabled": True, "project": "replay"}}
first_attempt = RunLogger(out, monitors, total_steps=8, start_step=0, replays_after=0)
for step in range(1, 7):
    first_attempt.log({"step": step, "loss": 10 + step})
first_attempt.close()
for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_MODE"):  # set for the first attempt's process only
    os.environ.pop(name)
with open(f"{out}/lm_eval.jsonl", "w") as f:
    f.writelines(f'{{"step": {step}, "source": "{source}", "lm_eval/demo/acc": 0.5}}\\n'
                 for step, source in ((4, "pipeline"), (6, "pipeline"), (6, "hf_export")))
logger = RunLogger(out, monitors, total_steps=8, start_step=4, replays_after=4)
for step in range(5, 9):
    logger.log({"step": step, "loss": step})
logger.close()
"""
# wandb's calls, each a JSON line in WANDB_CALLS (the package is not a requirement): which run, which steps.
RECORDING_WANDB = """
import json, os
def _record(call):
    with open(os.environ["WANDB_CALLS"], "a") as f:
        f.write(json.dumps(call) + "\\n")
def init(**kwargs):
    _record({"init": {k: os.environ.get(k) for k in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_MODE")}})
def log(data, step=None, commit=None):
    _record({"step": step, **data})
"""


@pytest.mark.slow
def test_a_replay_logs_each_step_once_in_metrics_lm_eval_tensorboard_csv_and_wandb(tmp_path):
    """The records of the steps a restart logs again are dropped from metrics.jsonl, from lm_eval.jsonl (the
    pipeline's scores; an export's stay) and from the CSV monitor's files (rewritten, one header), hidden in
    TensorBoard (SummaryWriter's purge_step), and the restart goes on in the first attempt's W&B run from the step
    after the last one logged there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (tmp_path / "wandb_package").mkdir()
    (tmp_path / "wandb_package" / "wandb.py").write_text(RECORDING_WANDB)
    port, calls = str(free_port()), tmp_path / "wandb_calls.jsonl"
    result = run_python(["-c", REPLAYING_LOGGER, tmp_path], env=dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WANDB_CALLS=str(calls)))
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [(1, 11), (2, 12), (3, 13), (4, 14), (5, 5), (6, 6), (7, 7), (8, 8)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == logged
    assert f"{tmp_path}/metrics.jsonl: dropped the records of step(s) 5, 6, which this run logs again" in result.stdout
    scores = [json.loads(line) for line in (tmp_path / "lm_eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["source"]) for r in scores] == [(4, "pipeline"), (6, "hf_export")]
    assert f"{tmp_path}/lm_eval.jsonl: dropped the records of step(s) 6, which this run logs again" in result.stdout
    events = EventAccumulator(str(tmp_path / "tensorboard" / "train"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("Train/loss")] == logged
    with open(tmp_path / "csv" / "train" / "Train_loss.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "loss"]] + [[str(step), str(loss)] for step, loss in logged]
    run_id = (tmp_path / "wandb_run_id").read_text()
    wandb_calls = [json.loads(line) for line in calls.read_text().splitlines()]
    resumed = {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow", "WANDB_MODE": "offline"}
    first_attempt = [(step, 10 + step) for step in range(1, 7)]  # W&B keeps a step's first values
    assert wandb_calls == ([{"init": resumed}] + [{"step": s, "Train/loss": v} for s, v in first_attempt]
                           + [{"init": resumed}] + [{"step": s, "Train/loss": v} for s, v in logged[6:]])


@pytest.mark.slow
def test_a_config_error_is_not_restarted(demo_model, tmp_path):
    command = [sys.executable, "trainer_pipe.py", "-cp", "conf", "-cn", "tiny",
               *demo_overrides(demo_model, tmp_path / "run", num_stages=2)]
    result = supervise(command, "--backoff-seconds", "0", timeout=300)
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stderr[-3000:]
    assert result.stderr.count("trainer_pipe: error: num_stages=2 does not divide the world size 1") == 1
    assert result.stderr.splitlines()[-1] == (
        "supervise: not restarting after a config error, which a restart cannot fix: attempt 1 ended with exit code "
        "78: a config error")


def test_a_rank_that_failed_in_a_collective_is_named_first_only_where_nothing_else_is_to_blame():
    """Rank 0's receive failed first (its peer's connection reset) while rank 1 was killed without a word, or
    before rank 2's watchdog ended it: the killed or hung rank is the cause, not rank 0; with no other failure,
    rank 0's is named."""
    def record(rank, ended=None, **end):
        return {"rank": rank, "host": "node1", "pid": 100 + rank, "started": 0.0,
                **({"ended": ended, "follows_another": False, **end} if ended else {})}
    lost_peer = record(0, ended=1.0, exit_code=1, cause="RuntimeError: Connection reset by peer",
                       in_communication=True)
    hung = record(2, ended=2.0, exit_code=exit_codes.HUNG, cause="hang watchdog: rank 2 ...", in_communication=False)
    assert explain_failure(247, [lost_peer, record(1)]) == (
        "exit code 247: killed by SIGKILL; rank 1 on node1 (pid 101) ended without a word (killed by SIGKILL or the "
        "OOM killer, stopped, or its node lost)")
    assert "first failed: rank 2 on node1 (exit code 70: a rank hung): hang watchdog" in explain_failure(
        70, [lost_peer, record(1), hung])
    assert explain_failure(1, [lost_peer]) == ("exit code 1: a rank crashed; first failed: rank 0 on node1 (exit code "
                                               "1: a rank crashed): RuntimeError: Connection reset by peer")
    # the exit code of an attempt the supervisor ends (DeepSpeed's launcher not having looked yet) is the cause's
    ended_by_launcher = record(3, ended=3.0, exit_code=143, cause="ended by its launcher", follows_another=True)
    records = [lost_peer, record(1), hung, ended_by_launcher, record(5, ended=5.0, exit_code=0, cause="finished")]
    assert first_failure_code({100: 1, 101: 247, 103: 143}, records, "node1") == 247
    assert first_failure_code({100: 1, 102: exit_codes.HUNG}, records, "node1") == exit_codes.HUNG
    assert first_failure_code({100: 1, 103: 143}, records, "node1") == 1
    assert first_failure_code({103: 143}, records, "node1") is None  # each ended by its launcher
    assert first_failure_code({104: 1}, records, "node1") is None  # no rank: the launcher's
    # the launcher has reaped rank 2 (hung: it recorded its 70) or rank 1 (killed: its 247 is the launcher's to pass
    # on), not rank 5 (finished); its teardown is under way
    assert reaped_failures({101, 102, 105}, records, "node1") == {101: None, 102: exit_codes.HUNG}
    assert first_failure_code({100: 1, 103: 143, **reaped_failures({102}, records, "node1")}, records,
                              "node1") == exit_codes.HUNG
    assert first_failure_code({100: 1, 103: 143, **reaped_failures({101}, records, "node1")}, records,
                              "node1") is None


def test_a_second_end_waits_until_the_first_is_on_disk(tmp_path, monkeypatch):
    """The main thread records its crash while the SIGTERM thread, about to os._exit, records being ended by the
    launcher: the second end returns only once the first is written, so the exit cannot cut that write short (a CI
    run's rank 0 was once left with its start-up record only)."""
    from resilience import rank_records
    record = rank_records.RankRecord(str(tmp_path), 0)
    writing, release, write = threading.Event(), threading.Event(), rank_records.write_text_atomic

    def slow_write(path, text):
        if "ended" in text:
            writing.set()
            release.wait(10)
        write(path, text)
    monkeypatch.setattr(rank_records, "write_text_atomic", slow_write)
    crash = threading.Thread(target=record.end, args=(1, "RuntimeError: Connection reset by peer", True))
    crash.start()
    assert writing.wait(10)
    threading.Timer(0.2, release.set).start()
    record.end(143, "ended by its launcher after another rank exited", follows_another=True)
    on_disk = json.loads((tmp_path / "rank_records" / "rank00000.json").read_text())
    assert (on_disk["exit_code"], on_disk["in_communication"]) == (1, True)
    crash.join()


def test_ranks_that_exited_non_zero_are_seen_with_their_exit_code_before_their_launcher_reaps_them():
    """A launcher that has not reaped its ranks yet: one exited 70, one SIGKILLed (as DeepSpeed's launcher passes it
    on: 247), one exited 0 (no failure), one running."""
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                                 "ranks = [subprocess.Popen(c) for c in (['sh', '-c', 'exit 70'], ['sleep', '60'], "
                                 "['true'], ['sleep', '60'])]\n"
                                 "print(*[r.pid for r in ranks], flush=True)\ntime.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    hung, killed, finished, running = map(int, launcher.stdout.readline().split())
    try:
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(failed_children(children_of(launcher.pid))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed_children(children_of(launcher.pid)) == {hung: exit_codes.HUNG, killed: 247}
        assert sorted(children_of(launcher.pid)) == sorted([hung, killed, finished, running])
    finally:
        os.kill(running, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_a_spent_restart_budget_is_one_line(tmp_path):
    """Each attempt takes output_dir's lease under the supervisor's token and dies holding it: the supervisor
    removes it after each attempt (its ranks are gone)."""
    takes_lease_and_dies = ("import os, sys; from resilience.run_lease import RunLease; RunLease(sys.argv[1]); "
                            "os._exit(1)")
    result = supervise([sys.executable, "-c", takes_lease_and_dies, str(tmp_path)], "--max-restarts", "2",
                       "--backoff-seconds", "0", "--output-dir", str(tmp_path), timeout=120)
    assert result.returncode == 1 and not (tmp_path / LEASE_FILE).exists()
    lines = result.stderr.splitlines()
    assert lines[:2] == [f"supervise: restart {n} of 2 in 0s with the same command (this run has saved no checkpoint "
                         f"yet): attempt {n} ended with exit code 1: a rank crashed" for n in (1, 2)]
    assert lines[2:] == [
        "supervise: error: 3 failures in a row without a new checkpoint spent the restart budget (--max-restarts 2); "
        "the last ended with exit code 1: a rank crashed; fix the cause and rerun the same command (it resumes from "
        "the start: no complete checkpoint yet)."]


@pytest.mark.slow
def test_a_slow_rank_is_named_a_straggler_and_not_ended(demo_model, tmp_path):
    """2 data-parallel ranks of one stage; from step 3 rank 1's forwards take 0.5 s longer: the logging interval
    that holds slow steps names it (in a line and the metrics), and the run finishes: the hang watchdog leaves a
    rank that is only slow alone."""
    out = tmp_path / "run"
    result = check_ok(launch_trainer(2, demo_overrides(
        demo_model, out, num_stages=1, gradient_accumulation_steps=2, max_steps=6, logging_steps=2, save_steps=0,
        eval_file="null", **{"hang_watchdog.min_step_seconds": 5}), script=FAULT_SCRIPT,
        env={"FAULT": "slow:1:3", "FAULT_SLOW_SECONDS": "0.5"}))
    lines = re.findall(r"straggler: rank (\d) \(stage 0\) computed ([\d.]+)s in this interval, [\d.]+x the median "
                       r"of its stage's other ranks; it waited [\d.]+s on peers", result.stdout)
    # steps 3-4 and 5-6, each 2 steps x 2 forwards x 0.5 s slower (steps 1-2 are left to the machine's noise)
    assert [rank for rank, seconds in lines if float(seconds) >= 2.0] == ["1", "1"], result.stdout[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(r["straggler_ranks"] == [1] and r["slowest_rank"] == 1 for r in records[1:]), records


def test_stragglers_are_named_against_their_peers():
    """A rank against its stage's other ranks; a stage against the other stages (its ranks' median)."""
    ranks, stages = find_stragglers(compute=[1.0, 1.1, 1.0, 2.0, 1.0, 1.0], stages=[0, 0, 0, 1, 1, 1],
                                    communication=[0.9, 0.8, 0.9, 0.1, 0.5, 0.5], margin=0.25)
    assert ranks == {3: "straggler: rank 3 (stage 1) computed 2.00s in this interval, 2.00x the median of its stage's "
                        "other ranks; it waited 0.10s on peers"}
    assert stages == {}
    ranks, stages = find_stragglers(compute=[1.0, 1.0, 1.5, 1.4], stages=[0, 0, 1, 1],
                                    communication=[0.5, 0.5, 0.0, 0.1], margin=0.25)
    assert ranks == {} and list(stages) == [1] and stages[1].startswith(
        "straggler: stage 1 computed 1.45s in this interval, 1.45x the median of the other stages; its ranks waited "
        "0.05s on peers")


@pytest.mark.slow
def test_async_saves_write_the_synchronous_files_and_a_kill_mid_write_keeps_latest(demo_model, straight_run,
                                                                                   tmp_path):
    """async_save=auto (this host has room: saves in the background), then true: rank 1 is killed right after
    handing step 4's checkpoint to its writer process: `latest`
    stays step 2, step 4 is not complete; resumed, the run's checkpoints hold the synchronous run's files byte for
    byte (all but run_config.yaml, which names the setting, and its checksum) and its losses."""
    sync, out = straight_run, tmp_path / "async"
    killed = launch_trainer(2, demo_overrides(demo_model, out, async_save="auto", **RUN), script=FAULT_SCRIPT,
                            env={"FAULT": "kill_while_writing:1:4"})
    assert killed.returncode != 0 and "FAULT kill_while_writing AT 4" in killed.stdout, killed.stderr[-3000:]
    assert (out / "latest").read_text() == "global_step2" and not (out / "global_step4" / "COMPLETE").exists()
    check_ok(launch_trainer(2, demo_overrides(demo_model, out, async_save="true", resume="auto", **RUN)))
    for tag in ("global_step2", "global_step4", "global_step6", "global_step8"):
        names = sorted(os.listdir(sync / tag))
        assert sorted(os.listdir(out / tag)) == names, tag
        # The RNG files (written directly, as in a synchronous save) of the steps after the resume differ: a resumed
        # process's torch generator is not the uninterrupted one's (with or without async_save; losses are equal).
        differ = {"run_config.yaml", "checksums.json"} | ({n for n in names if n.startswith("rng_state")}
                                                          if tag != "global_step2" else set())
        for name in set(names) - differ:
            assert (out / tag / name).read_bytes() == (sync / tag / name).read_bytes(), (tag, name)
        expected, got = ({name: checksum for name, checksum in read_manifest(str(run_dir / tag)).items()
                          if name not in differ} for run_dir in (sync, out))
        assert got == expected, tag
    assert per_step_losses(out) == per_step_losses(sync)  # each step once: the resume dropped the replayed ones


@pytest.mark.slow
def test_a_writer_killed_with_a_checkpoint_in_hand_costs_no_step_and_no_checkpoint(demo_model, straight_run,
                                                                                   tmp_path):
    """async_save=true: rank 1's writer process is SIGKILLed holding step 4's checkpoint (the OOM killer). The old
    writer posted nothing and the next save waited for it forever; now the ranks find it after the next step, rank
    0 says so in one line, every rank writes step 4 again from its snapshot and the run goes on with synchronous
    saves: no restart, and every checkpoint holds the synchronous run's files byte for byte (all but
    run_config.yaml, which names the setting, and its checksum), with its losses."""
    out = tmp_path / "run"
    result = check_ok(launch_trainer(2, demo_overrides(demo_model, out, async_save="true", **RUN),
                                     script=FAULT_SCRIPT, env={"FAULT": "kill_writer:1:4"}, timeout=300))
    writer = re.search(r"FAULT kill_writer AT 4 PID (\d+)", result.stdout).group(1)
    assert (f"trainer_pipe: warning: async_save: the background write of {out}/global_step4 failed on rank 1: its "
            f"writer process (pid {writer}) was killed by SIGKILL (the kernel's OOM killer, or a person); every rank "
            f"writes it again from its snapshot, and saves synchronously from now on\n") in result.stdout, result.stdout
    assert (out / "latest").read_text() == "global_step8"
    for tag in ("global_step2", "global_step4", "global_step6", "global_step8"):
        names = sorted(os.listdir(straight_run / tag))
        assert sorted(os.listdir(out / tag)) == names, tag
        for name in set(names) - {"run_config.yaml", "checksums.json"}:
            assert (out / tag / name).read_bytes() == (straight_run / tag / name).read_bytes(), (tag, name)
    assert per_step_losses(out) == per_step_losses(straight_run)


def test_a_startup_limit_below_the_measured_step_limit_is_a_warning():
    settings = SimpleNamespace(step_time_factor=10, min_step_seconds=300, startup_seconds=1800)
    assert startup_limit_warning(settings, median_step_seconds=120.0) is None
    assert startup_limit_warning(settings, median_step_seconds=200.04) == (
        "hang watchdog: warning: hang_watchdog.startup_seconds=1800 is shorter than 10 x the measured median step "
        "time 200.0s (2000s): a restart's first steps, which run under it, and the saves and evaluations between "
        "steps may be ended as hangs; raise it to at least 2001.")


# A job's rank 0 on stdin's commands: "take" output_dir's lease (prints "won" or the refusal), "drop" it ("dropped").


@pytest.mark.slow
def test_a_job_refused_another_live_jobs_output_dir_changes_none_of_its_files(demo_model, straight_run, tmp_path):
    """The straight run's directory while a live job (LEASE_TAKER) holds its lease: a second job's ranks stop with
    the one-line refusal (exit 78) having written nothing there: every file byte for byte as it was (the rank
    records too, which each rank writes once its job holds the lease)."""
    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    holder = subprocess.Popen([sys.executable, "-c", LEASE_TAKER, str(out)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        holder.stdin.write("take\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "won\n"
        before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
        result = launch_trainer(2, demo_overrides(demo_model, out, **RUN, resume="auto"))
        refusal = (f"trainer_pipe: error: output_dir '{out}' is being written by another live job: its rank 0, pid "
                   f"{holder.pid} on {socket.gethostname()}, renewed {out / LEASE_FILE}")
        assert result.returncode == exit_codes.CONFIG_ERROR and refusal in result.stderr, result.stderr[-3000:]
        after = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
        lease = out / LEASE_FILE  # its holder renews it every HEARTBEAT_SECONDS
        assert json.loads(after.pop(lease))["pid"] == json.loads(before.pop(lease))["pid"] == holder.pid
        assert (out / "rank_records" / "rank00000.json") in after and after == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_the_watchers_share_one_wrapper_around_the_instruction_handlers():
    """The hang watchdog, the straggler report and the profile each add a listener: the handlers are wrapped once,
    each listener hears every instruction (its own start value back at the end, the last started ending first),
    and the handler's result comes back."""
    class Engine:
        _INSTRUCTION_MAP = {schedule.ForwardPass: lambda engine, buffer_id: ("forward", buffer_id)}
    heard = []

    class Listener:
        def __init__(self, name):
            self.name = name

        def instruction_started(self, instruction):
            heard.append((self.name, "started", instruction.__name__))
            return self.name

        def instruction_ended(self, instruction, started):
            heard.append((self.name, "ended", started))
    engine = Engine()
    add_instruction_listener(engine, Listener("watchdog"))
    wrapped = engine._INSTRUCTION_MAP[schedule.ForwardPass]
    add_instruction_listener(engine, Listener("stragglers"))
    assert engine._INSTRUCTION_MAP[schedule.ForwardPass] is wrapped
    assert wrapped(engine, buffer_id=1) == ("forward", 1)
    assert heard == [("watchdog", "started", "ForwardPass"), ("stragglers", "started", "ForwardPass"),
                     ("stragglers", "ended", "stragglers"), ("watchdog", "ended", "watchdog")]


def test_slurm_rank_derives_the_launcher_environment_from_sruns(tmp_path):
    """scripts/slurm_rank.sh under the environment srun gives task 5 of a 2-node, 8-task job step (Slurm's scontrol
    expands the node list; here a stand-in that prints what it would for 'gpu[07-08]')."""
    scontrol = '#!/bin/sh\n[ "$*" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n'
    (tmp_path / "scontrol").write_text(scontrol)
    (tmp_path / "scontrol").chmod(0o755)
    srun = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_TASKS_PER_NODE": "4(x2)"}
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "MASTER_"))}
    env.update(srun, PATH=f"{tmp_path}:{env['PATH']}")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    show = f"import json, os; print(json.dumps({{k: os.environ[k] for k in {names}}}))"
    result = subprocess.run(["bash", "scripts/slurm_rank.sh", "-c", show], env=env, capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert json.loads(result.stdout) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_SIZE": "4",
                                         "MASTER_ADDR": "gpu07", "MASTER_PORT": str(10000 + 123456 % 20000)}, \
        result.stderr
    env.update(SLURM_NTASKS_PER_NODE="4", MASTER_PORT="29400")  # --ntasks-per-node, and a port the job chose
    result = subprocess.run(["bash", "scripts/slurm_rank.sh", "-c", show], env=env, capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert json.loads(result.stdout)["MASTER_PORT"] == "29400" and json.loads(result.stdout)["LOCAL_SIZE"] == "4"


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_equal_to_a_straight_one(demo_model, reference_run, tmp_path):
    """torchrun's own restart (--max-restarts 1, resume=auto) of the reference run (2 stages x 2 data-parallel,
    ZeRO-1, fp32) after rank 3 is SIGKILLed at step 5: resumed from step 4, it ends with the reference run's losses
    and final weights, bit for bit. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torchrun's shared rendezvous store made
    the restarted ranks hang (refused at start-up: test_torchrun_restarts_sharing_its_store_are_refused)."""
    out = tmp_path / "run"
    (tmp_path / "once").mkdir()
    faults = {"FAULT": "sigkill:3:5", "FAULT_ONCE_DIR": str(tmp_path / "once")}
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "--max-restarts", "1", "--monitor-interval", "1", FAULT_SCRIPT, "-cp", os.path.join(ROOT, "conf"),
               "-cn", "tiny", *demo_overrides(demo_model, out, **REFERENCE, eval_file="null", resume="auto")]
    result = run_python(command, timeout=900, env={**faults, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "FAULT sigkill AT 5" in output, output[-5000:]
    assert f"resumed from {out}/global_step4" in output
    for name in sorted(os.listdir(reference_run / "global_step8")):
        if name.startswith("layer_") and name.endswith("model_states.pt"):
            expected, got = (torch.load(run / "global_step8" / name, weights_only=True) for run in (reference_run, out))
            assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
    assert per_step_losses(out) == per_step_losses(reference_run)


def test_torchrun_restarts_sharing_its_store_are_refused():
    """torchrun --max-restarts 3 as it sets the ranks' environment, with its store shared (its default) and not."""
    elastic = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert elastic_restart_error(elastic) == (
        "torchrun --max-restarts 3 shares its rendezvous store with the ranks' process groups, where a restart's ranks "
        "find the previous attempt's addresses and hang (pytorch#135712): start torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, or with --max-restarts 0 under supervise.py.")
    assert elastic_restart_error({**elastic, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert elastic_restart_error({**elastic, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None


@pytest.mark.slow
def test_a_killed_single_process_run_resumes_to_the_straight_runs_weights(demo_model, single_process_run, tmp_path):
    """The 1-process run of the parity tests (tests/launch.py SINGLE_PROCESS), saving every 2 steps, SIGKILLed at
    step 5 and resumed: its losses and final weights are the uninterrupted run's, bit for bit."""
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, **{**SINGLE_PROCESS, "save_steps": 2, "eval_file": "null"})
    killed = launch_trainer(1, overrides, script=FAULT_SCRIPT, env={"FAULT": "sigkill:0:5"})
    assert killed.returncode != 0 and "FAULT sigkill AT 5" in killed.stdout, killed.stderr[-3000:]
    check_ok(launch_trainer(1, overrides + ["resume=auto"]))
    for name in sorted(os.listdir(single_process_run / "global_step8")):
        if name.startswith("layer_") and name.endswith("model_states.pt"):
            expected, got = (torch.load(run / "global_step8" / name, weights_only=True)
                             for run in (single_process_run, out))
            assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
    assert per_step_losses(out) == per_step_losses(single_process_run)
