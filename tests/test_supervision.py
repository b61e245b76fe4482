"""A run that finishes without a person: the supervisor restarts failed launches with resume=auto, the hang
watchdog names and ends a stuck rank, and what a restart cannot fix is not restarted. Real launches, real signals."""
import json
import os
import re
import sys

import pytest
import torch

from checkpoints.integrity import read_manifest
from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses, run_python, trainer_command
from training import exit_codes
from training.stragglers import find_stragglers

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
    SIGSTOPped at step 6 (latest: step 4), which rank 0's watchdog finds stuck sending it step 6's first activation
    and ends; restarted again, the run finishes with the straight run's weights, bit for bit, and losses. A new
    checkpoint between the failures renews the budget: --max-restarts 1 suffices."""
    straight, out = straight_run, tmp_path / "supervised"
    (tmp_path / "once").mkdir()
    faults = {"FAULT": "sigkill:1:3,sigstop:1:6", "FAULT_ONCE_DIR": str(tmp_path / "once")}
    command, _ = trainer_command(2, demo_overrides(demo_model, out, **RUN, **WATCHDOG), "tiny", None, FAULT_SCRIPT,
                                 faults)
    result = supervise(command, "--max-restarts", "1", "--backoff-seconds", "0", env=faults)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    restarts = [line for line in result.stderr.splitlines() if line.startswith("supervise:")]
    assert len(restarts) == 2, restarts
    assert re.fullmatch(r"supervise: restart 1 of 1 in 0s with resume=auto \(from global_step2\): attempt 1 ended "
                        r"with exit code 247: killed by SIGKILL; rank 1 on \S+ \(pid \d+\) ended without a word "
                        r"\(killed by SIGKILL or the OOM killer, stopped, or its node lost\); .*", restarts[0])
    hang = (r"hang watchdog: rank 0 \(stage 0, data-parallel 0\) made no progress for \d+s \(limit \d+s: 10 x the "
            r"median step time [\d.]+s, at least hang_watchdog.min_step_seconds=5\) in step 6, in SendActivation "
            rf"of micro-batch 1 \(to rank 1\); every thread's stack: {out}/hang/rank00000-stacks.txt; exiting 70 for "
            r"a restart")
    assert re.search(hang, result.stderr), output[-5000:]
    assert re.fullmatch(rf"supervise: restart 1 of 1 in 0s with resume=auto \(from global_step4\): attempt 2 ended "
                        rf"with exit code 70: a rank hung; rank 1 on \S+ \(pid \d+\) ended without a word .*; first "
                        rf"failed: rank 0 on \S+ \(exit code 70: a rank hung\): {hang}; waiting for rank 1: rank 0 "
                        rf"in step 6, in SendActivation of micro-batch 1 \(to rank 1\)", restarts[1])
    assert "train_batch" in (out / "hang" / "rank00000-stacks.txt").read_text()
    for name in sorted(os.listdir(straight / "global_step8")):
        if name.startswith("layer_") and name.endswith("-model_states.pt"):
            expected, got = (torch.load(run / "global_step8" / name, weights_only=True) for run in (straight, out))
            assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
    logged = {}  # a restart logs the steps it replays again: the last record of each step counts
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        logged[record["step"]] = record["loss"]
    assert list(logged.values()) == per_step_losses(straight)


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


def test_a_spent_restart_budget_is_one_line(tmp_path):
    result = supervise([sys.executable, "-c", "import sys; sys.exit(1)"], "--max-restarts", "2",
                       "--backoff-seconds", "0", "--output-dir", str(tmp_path), timeout=120)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[:2] == [f"supervise: restart {n} of 2 in 0s with resume=auto (from the start): attempt {n} ended "
                         f"with exit code 1: a rank crashed" for n in (1, 2)]
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
    """async_save=true: rank 1 is killed right after handing step 4's checkpoint to its writer process: `latest`
    stays step 2, step 4 is not complete; resumed, the run's checkpoints hold the synchronous run's files byte for
    byte (all but run_config.yaml, which names the setting, and its checksum) and its losses."""
    sync, out = straight_run, tmp_path / "async"
    killed = launch_trainer(2, demo_overrides(demo_model, out, async_save="true", **RUN), script=FAULT_SCRIPT,
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
    assert per_step_losses(out)[-6:] == per_step_losses(sync)[2:]
