"""Checkpoint bookkeeping on disk: what counts as complete, what is resumed, what is pruned."""
import os
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from checkpoints.background_save import write_job
from checkpoints.files import atomic_path, atomic_write, staged_directory, temporary_name, write_text_atomic
from checkpoints.integrity import durable_checksum
from checkpoints.rng_state import rng_state_path
from checkpoints.saving import hashing_saves, write_side_files_and_complete
from checkpoints.tag_dirs import complete_tags, prune_checkpoints, remove_incomplete_checkpoints
from errors import ConfigError
from training.resume import data_position
from training.resume import check_fresh_start, check_output_dir_is_ours, resolve_resume


def make_tag(root, step, complete=True):
    """A checkpoint as the trainer's save leaves it: complete, or killed mid-save (its IN_PROGRESS marker, written
    before anything else, still there)."""
    tag = root / f"global_step{step}"
    tag.mkdir()
    (tag / "layer_00-model_states.pt").write_bytes(b"weights")
    (tag / ("COMPLETE" if complete else "IN_PROGRESS")).write_text(tag.name if complete else "save")
    return tag


def disk_state(root):
    """Every file under root with its bytes: what a refusal must leave unchanged."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_only_complete_checkpoints_are_resumed_and_incomplete_ones_removed(tmp_path):
    make_tag(tmp_path, 2)
    make_tag(tmp_path, 10)
    make_tag(tmp_path, 12, complete=False)  # a save that was killed
    assert complete_tags(tmp_path) == ["global_step2", "global_step10"]  # numeric, not lexical, order
    assert resolve_resume("auto", str(tmp_path)) == (str(tmp_path), "global_step10")
    assert remove_incomplete_checkpoints(str(tmp_path)) == ["global_step12"]
    assert sorted(os.listdir(tmp_path)) == ["global_step10", "global_step2"]


def test_only_this_trainers_interrupted_saves_are_removed_and_a_start_refuses_others(tmp_path):
    """A tag directory without COMPLETE that no save of this trainer marked (a converted model's global_step0,
    another tool's checkpoint) is never removed: a start beside it is refused, naming it, and nothing changes."""
    make_tag(tmp_path, 2)
    make_tag(tmp_path, 12, complete=False)
    foreign = tmp_path / "global_step0"
    foreign.mkdir()
    (foreign / "layer_00-model_states.pt").write_bytes(b"a converted model")
    with pytest.raises(ConfigError) as refusal:
        check_output_dir_is_ours(str(tmp_path), str(tmp_path / "model"))
    assert str(refusal.value) == (
        f"output_dir '{tmp_path}' holds global_step0, which no save of this trainer wrote (neither COMPLETE nor "
        f"IN_PROGRESS in it: a converted model, another tool's checkpoint?); move it out of output_dir or choose "
        f"another output_dir.")
    before = disk_state(tmp_path)
    assert remove_incomplete_checkpoints(str(tmp_path)) == ["global_step12"]
    assert disk_state(tmp_path) == {name: content for name, content in before.items()
                                    if not name.startswith("global_step12")}


def test_output_dir_that_is_the_starting_model_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "latest").write_text("global_step0")
    with pytest.raises(ConfigError) as refusal:
        check_output_dir_is_ours(str(tmp_path / "." / "model"), str(model))
    assert str(refusal.value) == (
        f"output_dir '{tmp_path / '.' / 'model'}' is model_name_or_path, the converted model this run starts from: "
        f"its checkpoints would replace the model's 'latest' and mix with its global_step0; choose another "
        f"output_dir.")


def test_a_deletion_killed_midway_leaves_a_directory_the_next_start_removes(tmp_path, monkeypatch):
    for step in (2, 4):
        make_tag(tmp_path, step)

    def killed_after_one_file(path, *args, **kwargs):
        os.remove(os.path.join(path, "layer_00-model_states.pt"))
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(str(tmp_path), keep=1)
    monkeypatch.undo()
    assert complete_tags(tmp_path) == ["global_step4"]
    check_output_dir_is_ours(str(tmp_path), str(tmp_path / "model"))  # the half-deleted directory is the trainer's
    assert remove_incomplete_checkpoints(str(tmp_path)) == ["global_step2"]


def test_resume_paths(tmp_path):
    assert resolve_resume(None, str(tmp_path)) is None
    assert resolve_resume("auto", str(tmp_path)) is None
    tag = make_tag(tmp_path, 4)
    write_text_atomic(str(tmp_path / "latest"), "global_step4")
    assert resolve_resume(str(tag), "unused") == (str(tmp_path), "global_step4")
    assert resolve_resume(str(tmp_path), "unused") == (str(tmp_path), "global_step4")
    incomplete = make_tag(tmp_path, 6, complete=False)
    with pytest.raises(ConfigError, match="neither a complete checkpoint tag directory"):
        resolve_resume(str(incomplete), "unused")


@pytest.mark.parametrize("keep,left", [(2, ["global_step4", "global_step6"]), (0, ["global_step6"])])
def test_pruning_keeps_the_newest_and_never_the_last_one(tmp_path, keep, left):
    for step in (2, 4, 6):
        make_tag(tmp_path, step)
    make_tag(tmp_path, 8, complete=False)  # never counted as a checkpoint to keep
    prune_checkpoints(str(tmp_path), keep)
    assert complete_tags(tmp_path) == left
    assert (tmp_path / "global_step8").is_dir()


def test_fresh_start_refuses_existing_checkpoints(tmp_path):
    check_fresh_start(str(tmp_path), overwrite=False)
    make_tag(tmp_path, 3)
    with pytest.raises(ConfigError, match="already holds checkpoints \\(global_step3\\)"):
        check_fresh_start(str(tmp_path), overwrite=False)
    check_fresh_start(str(tmp_path), overwrite=True)


def test_staged_directory_leaves_the_old_output_on_failure_and_syncs_the_new_before_it_replaces_it(tmp_path,
                                                                                                    monkeypatch):
    """A conversion's output (both ways) is on stable storage before its name is: a crash right after cannot leave
    an empty or short weight file under the output's name."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_directory(str(out)) as staging:
            open(os.path.join(staging, "new.txt"), "w").close()
            raise RuntimeError("crash mid-write")
    assert os.listdir(out) == ["old.txt"] and os.listdir(tmp_path) == ["out"]
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", str(dst))), replace(src, dst)))
    with staged_directory(str(out)) as staging:
        os.mkdir(os.path.join(staging, "tokenizer"))
        for name in ("new.txt", "tokenizer/vocab.json"):
            open(os.path.join(staging, name), "w").close()
    assert sorted(os.listdir(out)) == ["new.txt", "tokenizer"] and os.listdir(tmp_path) == ["out"]
    synced = set(events[:events.index(("replace", str(out)))])
    staging = os.path.realpath(staging)
    assert {staging, f"{staging}/new.txt", f"{staging}/tokenizer", f"{staging}/tokenizer/vocab.json"} <= synced


def test_atomic_write_is_whole_or_absent_under_names_no_other_writer_takes(tmp_path):
    """Two writers with the same host and pid (containers on two nodes) get different temporary names; a write
    that fails leaves the old file and no temporary one; one that succeeds replaces it whole."""
    path = tmp_path / "shared.json"
    assert temporary_name(path) != temporary_name(path)
    assert os.path.basename(temporary_name(path)).startswith(f".shared.json.{socket.gethostname()}.{os.getpid()}.")
    path.write_text("old")
    with pytest.raises(RuntimeError, match="died mid-write"):
        with atomic_path(path) as tmp:
            with open(tmp, "w") as f:
                f.write("half")
                raise RuntimeError("died mid-write")
    assert os.listdir(tmp_path) == ["shared.json"] and path.read_text() == "old"
    atomic_write(path, lambda f: f.write(b"new"))
    assert os.listdir(tmp_path) == ["shared.json"] and path.read_text() == "new"


@pytest.mark.parametrize("consumed,dp,micro,per_epoch,position", [
    (0, 2, 2, 10, (0, 0)),
    (32, 2, 2, 10, (0, 8)),     # 8 micro-batches into the first epoch
    (96, 2, 2, 10, (2, 4)),     # past two whole epochs
    (32, 1, 2, 20, (0, 16)),    # weights-only resume on half the data-parallel ranks: same samples consumed
])
def test_data_position_from_consumed_samples(consumed, dp, micro, per_epoch, position):
    assert data_position({"consumed_samples": consumed}, per_epoch, dp, micro) == position


def test_every_file_complete_names_is_fsynced_before_complete_is_written(tmp_path, monkeypatch):
    """A rank's files (synchronous: hashing_saves; asynchronous: the writer's job), its RNG file, rank 0's side files
    and the tag directory's entries are on stable storage before COMPLETE is renamed into place: a power loss or a
    node's crash cannot leave a complete checkpoint with an empty or short file (ext4/xfs delayed allocation)."""
    tag_dir, model_dir = tmp_path / "global_step2", tmp_path / "model"
    tag_dir.mkdir()
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (tag_dir / "IN_PROGRESS").write_text("save")
    events, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", str(dst))), replace(src, dst)))
    engine = SimpleNamespace(save=lambda state, path: torch.save(state, path))
    with hashing_saves(engine) as written:
        engine.save({"weight": torch.ones(3)}, str(tag_dir / "layer_01-model_states.pt"))
    written.update(write_job([(str(tag_dir / "layer_02-model_states.pt"), {"weight": torch.zeros(2)}, True)]))
    torch.save({}, rng_state_path(str(tag_dir), 0))
    written[rng_state_path(str(tag_dir), 0)] = durable_checksum(rng_state_path(str(tag_dir), 0))
    cfg = OmegaConf.create({"tokenizer_name_or_path": None, "model_name_or_path": str(model_dir)})
    write_side_files_and_complete(cfg, str(model_dir), str(tag_dir), {"step": 2},
                                  [{os.path.relpath(p, tag_dir): c for p, c in written.items()}])
    complete_at = events.index(("replace", str(tag_dir / "COMPLETE")))
    synced_before = {path for kind, path in events[:complete_at] if kind == "fsync"}
    files = {str(path) for path in tag_dir.iterdir()} - {str(tag_dir / "COMPLETE")}
    assert {"config.json", "run_config.yaml", "trainer_state.json", "checksums.json", "rng_state_rank00000.pt",
            "layer_01-model_states.pt", "layer_02-model_states.pt"} == {os.path.basename(f) for f in files}
    assert files | {str(tag_dir)} <= synced_before | {str(tag_dir / "checksums.json")}
    assert (tag_dir / "COMPLETE").read_text() == "global_step2" and (tmp_path / "latest").read_text() == "global_step2"
