"""A run's history and the checkpoint it starts from: a resume from an older checkpoint starts a new branch (the
abandoned one moved aside, never deleted, crash-safely; retention, `latest` and resume=auto follow the new branch; no
save writes into an existing tag directory), and rank 0's choice of the checkpoint, not each rank's own look at a
lagging shared directory, is what every rank loads, checked after loading. Real launches (2 stages, gloo)."""
import json
import os
import shutil

import pytest

from checkpoints.branches import ABANDONED_DIR, DONE, PLAN, finish_moves, start_branch
from checkpoints.integrity import read_manifest
from checkpoints.tag_dirs import complete_tags
from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics, run_python
from training.resume import resolve_resume

FAULT_SCRIPT = os.path.join("tests", "fault_injection.py")
RUN = dict(num_stages=2, gradient_accumulation_steps=2, max_steps=6, save_steps=2, save_total_limit=10,
           logging_steps=1, learning_rate=1e-3, warmup_steps=2, eval_file="null")


@pytest.fixture(scope="module")
def history(demo_model, tmp_path_factory):
    """RUN's 6 steps: global_step2, 4 and 6."""
    out = tmp_path_factory.mktemp("history") / "run"
    check_ok(launch_trainer(2, demo_overrides(demo_model, out, **RUN)))
    return out


def files_of(directory):
    return {path.relative_to(directory): path.read_bytes() for path in directory.rglob("*") if path.is_file()}


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_starts_a_new_branch(demo_model, history, tmp_path):
    """resume=OUT/global_step2 with another learning rate (a loss spike rolled back), save_total_limit=1: global_step4
    and 6 of the abandoned branch and its metrics are moved into OUT/abandoned/ byte for byte, named in one line; the
    new branch's global_step4 is a new directory (its manifest naming only its own files), and retention keeps it,
    not the abandoned step 6; resume=auto then continues the new branch from it (its checksums verified first)."""
    out = tmp_path / "run"
    shutil.copytree(history, out)
    rolled_back = check_ok(launch_trainer(2, demo_overrides(demo_model, out, **{
        **RUN, "max_steps": 4, "save_total_limit": 1, "learning_rate": 5e-4, "resume": str(out / "global_step2")})))
    (branch,) = (out / ABANDONED_DIR).iterdir()
    assert branch.name.startswith("after_global_step2-")
    assert (f"resuming {out}/global_step2, older than {out}'s newest checkpoint (global_step6): the run's history "
            f"branches here; the abandoned branch's checkpoints (global_step4, global_step6) and logs were moved, not "
            f"deleted, to {branch}") in rolled_back.stdout
    for tag in ("global_step4", "global_step6"):
        assert files_of(branch / tag) == files_of(history / tag), tag
    assert (branch / "metrics.jsonl").read_bytes() == (history / "metrics.jsonl").read_bytes()
    assert json.loads((branch / DONE).read_text())["tags"] == ["global_step4", "global_step6"]
    assert complete_tags(str(out)) == ["global_step4"] and (out / "latest").read_text() == "global_step4"
    new = out / "global_step4"
    assert (new / "layer_01-model_states.pt").read_bytes() != (history / "global_step4" /
                                                              "layer_01-model_states.pt").read_bytes()
    assert sorted(read_manifest(str(new))) == sorted(set(os.listdir(new)) - {"checksums.json", "COMPLETE"})
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4]
    assert per_step_losses(out)[:2] == per_step_losses(history)[:2] != per_step_losses(out)[2:]

    resumed = check_ok(launch_trainer(2, demo_overrides(demo_model, out, **{**RUN, "resume": "auto"})))
    assert f"resumed from {out}/global_step4" in resumed.stdout
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert files_of(branch / "global_step6") == files_of(history / "global_step6")


def test_a_move_a_crash_interrupted_is_finished_before_the_checkpoints_are_looked_at(tmp_path, monkeypatch):
    """A crash after the first of two renames: no checkpoint lost or in both places; the next start finishes the
    move, after which resume=auto picks the resumed checkpoint, not the abandoned newest one; finishing again
    changes nothing."""
    for step in (2, 4, 6, 8):
        (tmp_path / f"global_step{step}").mkdir()
        (tmp_path / f"global_step{step}" / "COMPLETE").write_text(f"global_step{step}")
    (tmp_path / "latest").write_text("global_step8")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    renames = []

    def crash_on_the_second(source, target):
        if renames:
            raise OSError("the node died")
        renames.append(source)
        os.replace(source, target)
    monkeypatch.setattr(os, "rename", crash_on_the_second)
    with pytest.raises(OSError, match="the node died"):
        start_branch(str(tmp_path), str(tmp_path / "global_step4"), now=0)
    monkeypatch.undo()
    branch = tmp_path / ABANDONED_DIR / "after_global_step4-19700101T000000Z"
    assert (branch / PLAN).is_file() and complete_tags(str(branch)) == ["global_step6"]
    assert complete_tags(str(tmp_path)) == ["global_step2", "global_step4", "global_step8"]
    assert finish_moves(str(tmp_path)) == [str(branch)]
    assert complete_tags(str(tmp_path)) == ["global_step2", "global_step4"]
    assert complete_tags(str(branch)) == ["global_step6", "global_step8"] and not (branch / PLAN).exists()
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert (branch / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert resolve_resume("auto", str(tmp_path)) == (str(tmp_path), "global_step4")
    before = files_of(tmp_path)
    assert finish_moves(str(tmp_path)) == [] and files_of(tmp_path) == before


@pytest.mark.slow
def test_every_rank_resumes_the_checkpoint_rank_0_chose(demo_model, history, tmp_path):
    """resume=auto while rank 1's node lists output_dir without global_step6 (its directory cache lagging): rank 1
    follows rank 0's choice, says so, and the two go on from step 6 together."""
    out = tmp_path / "run"
    shutil.copytree(history, out)
    result = check_ok(launch_trainer(2, demo_overrides(demo_model, out, **{**RUN, "max_steps": 8, "resume": "auto"}),
                                     script=FAULT_SCRIPT, env={"FAULT": "stale_listing:1:6"}, timeout=180))
    assert (f"rank 1: starting from {out}/global_step6, as rank 0 decided; this node saw {out}/global_step4 (a shared "
            f"filesystem's directory cache lagging?)") in result.stdout, result.stdout[-3000:]
    assert f"resumed from {out}/global_step6" in result.stdout
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 9))


@pytest.mark.slow
def test_a_rank_that_loaded_another_checkpoint_stops_the_run_in_one_line(demo_model, history, tmp_path):
    """Rank 1's DeepSpeed reads global_step4 where global_step6 was chosen: after loading, every rank stops with
    the line naming both, before any step."""
    out = tmp_path / "run"
    shutil.copytree(history, out)
    result = launch_trainer(2, demo_overrides(demo_model, out, **{**RUN, "max_steps": 8, "resume": "auto"}),
                            script=FAULT_SCRIPT, env={"FAULT": "load_tag:1:4"}, timeout=180)
    assert result.returncode == 1
    assert (f"RuntimeError: rank 1 loaded {out}/global_step4 at step 6, rank 0 {out}/global_step6 at step 6 (resume "
            f"chose {out}/global_step6): a node saw another checkpoint; a restart resumes it on every rank once every "
            f"node sees it") in result.stderr, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 7))


# save_checkpoint on a world of one (gloo) into output_dir/global_step4, which holds a file already.
SAVE_INTO_EXISTING = """
import sys
from types import SimpleNamespace
import torch.distributed as dist
from checkpoints.saving import save_checkpoint
from errors import ConfigError
out = sys.argv[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{out}/../store")
try:
    save_checkpoint(None, SimpleNamespace(output_dir=out), None, {"step": 4}, needed_bytes=1)
except ConfigError as error:
    print(error)
"""


@pytest.mark.slow
def test_a_save_never_writes_into_an_existing_tag_directory(tmp_path):
    """Its files would mix with the ones there, and the manifest hash those: refused before anything is written."""
    out = tmp_path / "run"
    (out / "global_step4").mkdir(parents=True)
    (out / "global_step4" / "layer_01-model_states.pt").write_bytes(b"another save's")
    result = run_python(["-c", SAVE_INTO_EXISTING, out], timeout=120)
    assert result.stdout.splitlines()[-1] == (
        f"{out}/global_step4 exists already, and a save never writes into an existing checkpoint (a resume from an "
        f"older one moves the newer ones aside first, checkpoints/branches.py): is another job writing {out}? Move "
        f"{out}/global_step4 away, or give the run another output_dir.")
    assert {str(path): data for path, data in files_of(out).items()} == {
        "global_step4/layer_01-model_states.pt": b"another save's"}
