"""Resume, crash-safe saves, preemption, prompt failure and NaN handling, with real processes and real faults."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch

from training.resume import check_resume_topology
from tests.launch import (REFERENCE, check_ok, demo_overrides, launch_ranks_separately, launch_trainer,
                          per_step_losses, read_metrics, run_python, start_trainer)
from resilience.exit_codes import CRASHED, DISK_FULL
from resilience.preemption import PREEMPTED_EXIT_CODE

FAULT_SCRIPT = os.path.join("tests", "fault_injection.py")
STOP_DEADLINE_S = 60  # seconds from SIGTERM to every process gone: a step and a save of the tiny model, with margin


@pytest.mark.slow
def test_killed_save_resumes_from_previous_checkpoint_with_identical_losses(demo_model, reference_run, tmp_path):
    """The run that gets killed trains under pipeline_schedule=zero_bubble and its resume under 1F1B: a checkpoint
    carries over between the schedules (the other way round: the SIGTERM test's resume)."""
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, **REFERENCE)
    killed = launch_trainer(4, overrides + ["pipeline_schedule=zero_bubble"], script=FAULT_SCRIPT,
                            env={"FAULT": "kill_during_save:1:6"})
    assert killed.returncode != 0
    # Rank 1 died after writing its share of step 6: that checkpoint is incomplete and 'latest' still names step 4.
    assert (out / "latest").read_text() == "global_step4"
    assert (out / "global_step6").is_dir() and not (out / "global_step6" / "COMPLETE").exists()
    # The checksum manifest is written with the checkpoint, after every rank's files and before COMPLETE.
    assert (out / "global_step4" / "checksums.json").is_file()
    assert not (out / "global_step6" / "checksums.json").exists()

    resumed = check_ok(launch_trainer(4, overrides + ["resume=auto"]))
    assert "removed incomplete checkpoints left by an interrupted save: ['global_step6']" in resumed.stdout
    assert "resumed from" in resumed.stdout and "global_step4" in resumed.stdout
    reference = per_step_losses(reference_run)
    # Weights, optimizer, LR schedule, data position (mid-epoch) and RNG restored: fp32 losses equal the
    # uninterrupted 1F1B run's, before and after the resume, up to the schedules' summation order.
    assert per_step_losses(out)[:4] == pytest.approx(reference[:4], abs=1e-6, rel=0)
    assert per_step_losses(out)[-4:] == pytest.approx(reference[4:8], abs=1e-6, rel=0)
    assert [r["step"] for r in read_metrics(out) if "loss" in r][-4:] == [5, 6, 7, 8]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["runner", "launcher", "rank"])
def test_sigterm_mid_run_saves_that_step_and_resume_matches_uninterrupted_run(demo_model, reference_run, tmp_path,
                                                                             target):
    """SIGTERM, while rank 0 is in step 5, to DeepSpeed's runner (which dies without forwarding it), to its per-node
    launcher (which forwards it to rank 0 first) or to rank 0: every rank finishes step 5, saves it (not a
    save_steps multiple) and exits; resume=auto, under pipeline_schedule=zero_bubble, then gives the uninterrupted
    1F1B run's losses (resumed once: the checkpoint is the same whichever process got the signal, so the launcher
    and rank cases run on 2 processes, 2 stages, under the schedules whose ranks each hold two chunks: the launcher
    case under interleaved 1F1B, the rank case under ZB-V)."""
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, **REFERENCE)
    schedule = {"runner": [], "launcher": ["pipeline_schedule=interleaved_1f1b", "virtual_stages=2"],
                "rank": ["pipeline_schedule=zbv"]}[target]
    runner = start_trainer(4 if target == "runner" else 2, overrides + schedule, script=FAULT_SCRIPT,
                           env={"FAULT": "pause:0:5"})
    output = []
    for line in runner.stdout:
        output.append(line)
        if "PAUSED_AT 5" in line:  # tqdm's bar (stderr, merged) may lead the line
            break
    assert "PAUSED_AT 5" in output[-1], "".join(output)[-3000:]
    launcher = psutil.Process(runner.pid).children()[0]
    ranks = launcher.children()
    signalled = time.time()
    paused = int(re.search(r"PAUSED_AT 5 PID (\d+)", output[-1]).group(1))  # rank 0
    target_process = {"runner": runner, "launcher": launcher, "rank": next(p for p in ranks if p.pid == paused)}[target]
    target_process.send_signal(signal.SIGTERM)
    output.append(runner.stdout.read())  # until the ranks and the launcher, orphaned or not, have all exited
    _, alive = psutil.wait_procs([launcher, *ranks], timeout=30)
    output = "".join(output)
    assert not alive and time.time() - signalled < STOP_DEADLINE_S, output[-3000:]
    # The ranks' code passes through DeepSpeed's launcher and runner; a signalled launcher exits 1, a runner dies.
    expected_exit = {"runner": -signal.SIGTERM, "launcher": 1, "rank": PREEMPTED_EXIT_CODE}[target]
    assert runner.wait(timeout=30) == expected_exit, output[-3000:]
    reason = ("the process that started the DeepSpeed launcher (the deepspeed runner) is gone" if target == "runner"
              else "SIGTERM")
    assert f"trainer_pipe: preempted ({reason}) after step 5: saved {out}/global_step5" in output, output[-3000:]
    assert (out / "latest").read_text() == "global_step5" and (out / "global_step5" / "COMPLETE").is_file()
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4, 5]
    assert ("ZB-V schedule, 2 chunks per rank" in output) == (target == "rank"), output[-3000:]
    assert ("interleaved 1F1B, 2 chunks per rank" in output) == (target == "launcher"), output[-3000:]
    if target != "runner":
        return
    resumed = check_ok(launch_trainer(4, overrides + ["resume=auto", "pipeline_schedule=zero_bubble"]))
    assert f"resumed from {out}/global_step5" in resumed.stdout
    assert per_step_losses(out)[-3:] == pytest.approx(per_step_losses(reference_run)[5:8], abs=1e-6, rel=0)
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 9))


SIGTERM_AFTER_A_SIBLING_EXITED = """
import os, signal, sys, threading
from resilience.preemption import PreemptionWatch
watch = PreemptionWatch(grace_seconds=60)
watch.sibling_rank_has_exited = lambda: True  # the launcher has reaped another of its ranks and ends the job
handled, request = threading.Event(), watch.request
watch.request = lambda reason: (request(reason), handled.set())
if sys.argv[1] == "stopping":
    watch.request("SIGTERM")  # this rank's own stop, under way when the sibling that saved with it exits
    handled.clear()
os.kill(os.getpid(), signal.SIGTERM)
handled.wait(timeout=60)
print("finished its own exit", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("state", ["training", "stopping"])
def test_a_launchers_sigterm_after_a_sibling_exited_ends_a_training_rank_but_not_a_stopping_one(state):
    """A rank's SIGTERM from DeepSpeed's launcher once another rank has exited: a training rank ends at once (a
    failed job: no step can complete); a rank already stopping for a preemption finishes its exit (its sibling
    exited after their common save, and this rank still has its line and its exit code to give)."""
    result = run_python(["-c", SIGTERM_AFTER_A_SIBLING_EXITED, state], timeout=120)
    if state == "training":
        assert result.returncode == 128 + signal.SIGTERM and "finished" not in result.stdout, result
    else:
        assert result.returncode == 0 and "finished its own exit" in result.stdout, result


@pytest.mark.slow
def test_weights_only_resume_into_another_stage_count_keeps_eval_loss(demo_model, reference_run, tmp_path):
    """The 2-stage reference run's step-8 weights evaluated on 1 stage: the eval loss it logged at step 8."""
    out = tmp_path / "eval1"
    check_ok(launch_trainer(1, demo_overrides(demo_model, out, num_stages=1, eval_only="true",
                                              resume=str(reference_run / "global_step8"), resume_weights_only="true")))
    (record,) = read_metrics(out)
    assert record["step"] == 8 and record["eval_examples"] > 0
    (reference,) = [r for r in read_metrics(reference_run) if "eval_loss" in r]
    assert reference["step"] == 8
    assert record["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)


def test_checkpoints_of_deepspeeds_own_optimizer_files_resume_on_their_layout_only():
    """Checkpoints written before the optimizer state was saved per layer hold DeepSpeed's per-rank files: their
    own layout resumes them (before the stages' layers were recorded, the parallel degrees alone decide)."""
    current = {"num_stages": 2, "data_parallel": 2, "stage_bounds": [0, 3, 7]}
    check_resume_topology({"topology": {"num_stages": 2, "data_parallel": 2}}, current, False, "old")
    with pytest.raises(ValueError, match=re.escape("was trained with {'num_stages': 2, 'data_parallel': 1}")):
        check_resume_topology({"topology": {"num_stages": 2, "data_parallel": 1}}, current, False, "old")


@pytest.mark.slow
def test_exception_on_one_rank_ends_the_whole_job_promptly(demo_model, tmp_path):
    result = launch_trainer(2, demo_overrides(demo_model, tmp_path / "run", max_steps=20, eval_file="null"),
                            script=FAULT_SCRIPT, env={"FAULT": "raise:1:3"}, timeout=180, launcher=True)
    ended = time.time()
    assert result.returncode != 0
    assert "RuntimeError: injected failure on rank 1 at step 3" in result.stdout + result.stderr
    fault_at = float(re.search(r"FAULT_AT (\S+)", result.stdout).group(1))
    assert ended - fault_at < 60, f"the job took {ended - fault_at:.0f}s to end after one rank failed"


@pytest.mark.slow
def test_nan_loss_stops_with_step_and_last_good_checkpoint(demo_model, tmp_path):
    out = tmp_path / "run"
    result = launch_trainer(2, demo_overrides(demo_model, out, max_steps=6, save_steps=2, eval_file="null"),
                            script=FAULT_SCRIPT, env={"FAULT": "nan:1:3", "FAULT_GAS": "4"}, timeout=120)
    assert result.returncode != 0
    assert (f"loss is nan at step 3; stopping (nan_policy=stop). Last good checkpoint: {out}/global_step2"
            in result.stdout + result.stderr)
    assert (out / "latest").read_text() == "global_step2"


@pytest.mark.slow
def test_a_step_with_no_labelled_token_is_named_and_changes_nothing(demo_model, tmp_path):
    """A global batch without a labelled token (all -100 on both data-reading stages at step 2): the step is named
    and skipped rather than dividing by zero; no loss is logged for it, its checkpoint holds step 1's weights, and
    training goes on."""
    out = tmp_path / "run"
    result = check_ok(launch_trainer(2, demo_overrides(demo_model, out, max_steps=3, save_steps=1, save_total_limit=3,
                                                       logging_steps=1, eval_file="null"),
                                     script=FAULT_SCRIPT, env={"FAULT": "unlabelled:0:2"}, timeout=120))
    assert "step 2: the global batch has no labelled token (every label is -100): no update" in result.stdout
    losses = per_step_losses(out)
    assert losses[1] is None and all(math.isfinite(loss) for loss in (losses[0], losses[2])), losses
    for name in ("layer_00-model_states.pt", "layer_03-model_states.pt"):
        before, after = (torch.load(out / tag / name, weights_only=True) for tag in ("global_step1", "global_step2"))
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_nan_loss_step_is_skipped_when_configured(demo_model, tmp_path):
    out = tmp_path / "run"
    check_ok(launch_trainer(2, demo_overrides(demo_model, out, max_steps=5, logging_steps=1, eval_file="null",
                                        nan_policy="skip"),
                      script=FAULT_SCRIPT, env={"FAULT": "nan:1:3", "FAULT_GAS": "4"}, timeout=120))
    records = {r["step"]: r for r in read_metrics(out)}
    assert records[3].get("skipped_steps") == 1 and records[3]["loss"] != records[3]["loss"]  # NaN
    assert all(records[s]["loss"] < records[1]["loss"] for s in (4, 5))
    for name in ("layer_00-model_states.pt", "layer_03-model_states.pt"):
        weights = torch.load(out / "global_step5" / name)
        assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_log_line_cut_short_mid_append_is_dropped_at_the_next_start_not_fatal(tmp_path, capsys):
    """A node lost mid-append leaves metrics.jsonl or lm_eval.jsonl ending in part of a record (it raised
    JSONDecodeError at the resume before, exit 78, never restarted): the next start drops it in one line, and the
    run's next record starts a line of its own; a last record missing only its newline is kept. A bad line before
    the last is no interrupted append: a ConfigError naming it."""
    from errors import ConfigError
    from training.metrics import drop_records_after
    metrics, scores = tmp_path / "metrics.jsonl", tmp_path / "lm_eval.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n{"step": 3, "lo')
    scores.write_text('{"step": 2, "source": "pipeline", "acc": 0.5}\n{"step": 2, "source": "hf_export", "acc": 0.5}')
    assert drop_records_after(str(metrics), 2) == []
    assert drop_records_after(str(scores), 2, source="pipeline") == []
    assert capsys.readouterr().out == (f"{metrics}: dropped its last line, a record cut short when the run writing it "
                                       f"stopped mid-append: '{{\"step\": 3, \"lo'\n")
    assert metrics.read_text() == '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'
    assert scores.read_text().endswith('"acc": 0.5}\n') and len(scores.read_text().splitlines()) == 2
    metrics.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo\n{"step": 2, "loss": 2.25}\n')
    with pytest.raises(ConfigError, match=rf"^{metrics}: line 2 is not a JSON record \(.*\); fix or remove it$"):
        drop_records_after(str(metrics), 1)


@pytest.mark.slow
def test_rank_0_killed_while_building_the_data_is_a_restartable_failure_on_the_others(demo_model, tmp_path):
    """Rank 0 dies as it starts tokenizing (a node lost, the OOM killer): the rank waiting for it on the store says
    so and exits 1, which a supervisor restarts; it exited 78 (a config error, never restarted) before."""
    rank0, rank1 = launch_ranks_separately(2, demo_overrides(demo_model, tmp_path / "run", eval_file="null",
                                                             **{"data.cache_dir": str(tmp_path / "cache")}),
                                           script=FAULT_SCRIPT, env={"FAULT": "kill_building:0:0"})
    assert rank0.returncode == -signal.SIGKILL and "FAULT kill_building" in rank0.stdout, rank0.stderr[-3000:]
    assert rank1.returncode == CRASHED, rank1.stderr[-3000:]
    assert (f"SharedFileError: rank 0 stopped while building the tokenized cache of {demo_model['train']}; its log "
            f"says why") in rank1.stderr, rank1.stderr[-3000:]


@pytest.mark.slow
def test_malformed_jsonl_line_is_named(demo_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "a fine line"}) + "\n" + '{"text": "broken\n')
    result = launch_trainer(1, demo_overrides(demo_model, tmp_path / "run", num_stages=1, train_file=str(data),
                                              eval_file="null"), timeout=120)
    assert result.returncode != 0
    assert f"{data}: line 2: malformed JSON line" in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["bf16", "fp32"])
def test_bf16_zero1_resume_matches_uninterrupted_run(demo_model, tmp_path, accumulation):
    """The production setting: bf16 with ZeRO-1 and fp32 gradient accumulation (the default: DeepSpeed's bf16
    optimizer over ZeRO's partitions; its tensor-parallel-aware norm and its checkpoint), or bf16 accumulation
    (ZeRO's optimizer, warned at start-up), here under tensor parallel 2 (2 processes: pipeline stages resume in the
    fp32 tests)."""
    run = dict(max_steps=5, save_steps=3, save_total_limit=5, logging_steps=1, eval_file="null", precision="bf16",
               zero_stage=1, learning_rate=1e-3, warmup_steps=2, num_stages=1, tensor_parallel_size=2,
               grad_accum_dtype=accumulation)
    full = check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "full", **run)))
    warned = "warning: grad_accum_dtype=bf16: each step sums 4 micro-batches' gradients in bf16" in full.stdout
    assert warned == (accumulation == "bf16"), full.stdout[-2000:]
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "resumed",
                                              resume=str(tmp_path / "full" / "global_step3"), **run)))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx(per_step_losses(tmp_path / "full")[3:], rel=1e-3)


@pytest.mark.slow
def test_preemption_grace_bounds_a_stop_that_cannot_finish():
    """A SIGTERM while the main thread never reaches a step boundary (a hung peer): the process still ends, with the
    preempted exit code, preemption_grace_seconds after the signal."""
    code = ("import os, signal, time\n"
            "from resilience.preemption import PreemptionWatch\n"
            "PreemptionWatch(grace_seconds=1)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)\n")
    started = time.time()
    result = run_python(["-c", code], timeout=60)
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-2000:]
    assert time.time() - started < 30
    assert ("preemption (SIGTERM): the step and the checkpoint did not finish within preemption_grace_seconds=1; "
            "exiting without it" in result.stdout)


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of a chosen size (tmpfs, resized with remount): mount(size_bytes) -> its path; read_only
    remounts it so."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def mount(size_bytes, read_only=False):
        options = f"size={size_bytes}" if not os.path.ismount(disk) else f"remount,size={size_bytes}"
        options += ",ro" if read_only else ""
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True)
        if result.returncode:
            pytest.skip(f"mounting a tmpfs needs root: {result.stderr.decode().strip()}")
        return disk
    yield mount
    if os.path.ismount(disk):
        subprocess.run(["umount", str(disk)], check=True)


def used_bytes(path):
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


@pytest.fixture(scope="module")
def two_step_run(demo_model, tmp_path_factory):
    """2 steps on 2 ranks with a checkpoint at step 2 (no export): what the disk tests size their disks from."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    check_ok(launch_trainer(2, two_step_overrides(demo_model, out)))
    return out


def two_step_overrides(demo_model, out, **extra):
    return demo_overrides(demo_model, out, **{"max_steps": 2, "save_steps": 2, "eval_file": "null",
                                              "export_hf": "false", **extra})


@pytest.mark.slow
def test_full_disk_is_one_line_before_anything_is_written_and_resume_continues(demo_model, two_step_run, small_disk):
    """The second save finds less free space than the first checkpoint took: every rank refuses it in one line
    naming the checkpoint, the sizes and where to resume; `latest` stays; the start-up warns of it."""
    from checkpoints.disk_space import checkpoint_bytes
    disk = small_disk(64 * 2**20)
    out = disk / "run"
    shutil.copytree(two_step_run, out)
    checkpoint = checkpoint_bytes(out / "global_step2")
    small_disk(used_bytes(disk) + checkpoint // 2)
    result = launch_trainer(2, two_step_overrides(demo_model, out, resume="auto", max_steps=4), timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"warning: the disk of output_dir '{out}' holds" in output and "less than save_total_limit + 1 = 3" in output
    refusal = re.findall(rf"trainer_pipe: error: checkpoint global_step4 does not fit on the disk of '{out}': "
                         rf"[\d.]+ MiB free, a checkpoint needs about {checkpoint / 2**20:.1f} MiB; .*; resume=auto "
                         rf"continues from the last complete checkpoint, {out}/global_step2\.", output)
    assert len(refusal) == 2, output[-3000:]  # one line from each rank
    assert "Traceback" not in output and "inline_container" not in output
    assert (out / "latest").read_text() == "global_step2" and not (out / "global_step4").exists()


@pytest.mark.slow
def test_disk_filling_during_the_first_save_is_one_line(demo_model, two_step_run, small_disk):
    """Before the first save only the planner's estimate is known (weights and optimizer state, without the
    tokenizer and other side files): a disk with room for the estimate but not the checkpoint fills mid-save,
    and the rank that hit it says so in one line (its peers then stop on the lost connection), with no checkpoint
    marked complete."""
    from checkpoints.disk_space import checkpoint_bytes
    from tests.helpers import compose_config
    from training.run_spec import run_spec
    estimate = run_spec(compose_config(two_step_overrides(demo_model, two_step_run, overwrite_output_dir="true")),
                        2).checkpoint_bytes
    actual = checkpoint_bytes(two_step_run / "global_step2")
    assert estimate < actual
    disk = small_disk(used_bytes(two_step_run) - actual + (estimate + actual) // 2)
    out = disk / "run"
    result = launch_trainer(2, two_step_overrides(demo_model, out), timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(rf"trainer_pipe: error: checkpoint global_step2 does not fit on the disk of '{out}': .*; no "
                     rf"complete checkpoint was saved yet\.", output), output[-3000:]
    assert "inline_container" not in output and "Errno 28" not in output, output[-6000:]
    assert not (out / "latest").exists() and not (out / "global_step2" / "COMPLETE").exists()


@pytest.mark.slow
def test_a_disk_filling_under_a_background_write_stops_every_rank_with_one_line(demo_model, two_step_run,
                                                                                 small_disk):
    """async_save=true: another writer fills the disk right after the step-4 save found room for it, so the writer
    processes meet the full disk (torch.save's zip writer: a RuntimeError, not an OSError). The old writer died
    without a word and the run hung; now both ranks stop together with the full disk's line and exit 74 (not
    restarted), and `latest` and step 2's checkpoint are as they were."""
    from checkpoints.disk_space import checkpoint_bytes
    disk = small_disk(64 * 2**20)
    out = disk / "run"
    shutil.copytree(two_step_run, out)
    checkpoint = checkpoint_bytes(out / "global_step2")
    started = time.monotonic()
    result = launch_trainer(2, two_step_overrides(demo_model, out, resume="auto", max_steps=6, async_save="true"),
                            script=FAULT_SCRIPT, env={"FAULT": "fill_disk:0:4"}, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == DISK_FULL and time.monotonic() - started < 180, output[-3000:]
    assert "FAULT fill_disk AT 4" in result.stdout
    refusal = re.findall(rf"trainer_pipe: error: checkpoint global_step4 does not fit on the disk of '{out}': "
                         rf"[\d.]+ MiB free, a checkpoint needs about {checkpoint / 2**20:.1f} MiB; .*; resume=auto "
                         rf"continues from the last complete checkpoint, {out}/global_step2\.", output)
    assert len(refusal) == 2, output[-3000:]  # one line from each rank
    assert (out / "latest").read_text() == "global_step2" and not (out / "global_step4" / "COMPLETE").exists()
    kept = {path.relative_to(out): path.read_bytes() for path in (out / "global_step2").rglob("*") if path.is_file()}
    assert kept == {path.relative_to(two_step_run): path.read_bytes()
                    for path in (two_step_run / "global_step2").rglob("*") if path.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("state_file", ["mp_rank_00_model_states.pt", "layer_01-optim_states.pt"])
def test_a_state_file_carrying_code_is_refused_naming_it_and_never_run(demo_model, two_step_run, tmp_path, state_file):
    """A shared checkpoint whose state file (DeepSpeed's own, or a layer's optimizer state) carries a pickle payload,
    with a checksums.json forged to match: resuming refuses the file by name (DeepSpeed's own loader would unpickle
    its file with weights_only=False)."""
    from checkpoints.integrity import file_checksum, read_manifest, write_manifest
    from tests.test_integrity import Payload
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    tag = out / "global_step2"
    forged, marker = tag / state_file, tmp_path / "payload_ran"
    torch.save({**torch.load(forged, weights_only=True), "extra": Payload(str(marker))}, forged)
    write_manifest(str(tag), {**read_manifest(str(tag)), forged.name: file_checksum(str(forged))})
    result = launch_trainer(2, two_step_overrides(demo_model, out, resume="auto", max_steps=4), timeout=120)
    assert result.returncode != 0
    assert (f"trainer_pipe: error: '{forged}' cannot be loaded safely with torch.load(weights_only=True): its pickle "
            f"refers to code" in result.stdout + result.stderr), (result.stdout + result.stderr)[-3000:]
    assert not marker.exists()
    torch.load(forged, weights_only=False)  # the file is armed: an unsafe load runs the payload
    assert marker.exists()
