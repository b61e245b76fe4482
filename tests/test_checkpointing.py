"""Checkpoint bookkeeping on disk: what counts as complete, what is resumed, what is pruned."""
import os
import socket

import pytest

from checkpoints.files import atomic_path, atomic_write, staged_directory, temporary_name, write_text_atomic
from checkpoints.tag_dirs import complete_tags, prune_checkpoints, remove_incomplete_checkpoints
from training.loop import data_position
from training.resume import check_fresh_start, resolve_resume


def make_tag(root, step, complete=True):
    tag = root / f"global_step{step}"
    tag.mkdir()
    (tag / "layer_00-model_states.pt").write_bytes(b"weights")
    if complete:
        (tag / "COMPLETE").write_text(tag.name)
    return tag


def test_only_complete_checkpoints_are_resumed_and_incomplete_ones_removed(tmp_path):
    make_tag(tmp_path, 2)
    make_tag(tmp_path, 10)
    make_tag(tmp_path, 12, complete=False)  # a save that was killed
    assert complete_tags(tmp_path) == ["global_step2", "global_step10"]  # numeric, not lexical, order
    assert resolve_resume("auto", str(tmp_path)) == (str(tmp_path), "global_step10")
    assert remove_incomplete_checkpoints(str(tmp_path)) == ["global_step12"]
    assert sorted(os.listdir(tmp_path)) == ["global_step10", "global_step2"]


def test_resume_paths(tmp_path):
    assert resolve_resume(None, str(tmp_path)) is None
    assert resolve_resume("auto", str(tmp_path)) is None
    tag = make_tag(tmp_path, 4)
    write_text_atomic(str(tmp_path / "latest"), "global_step4")
    assert resolve_resume(str(tag), "unused") == (str(tmp_path), "global_step4")
    assert resolve_resume(str(tmp_path), "unused") == (str(tmp_path), "global_step4")
    incomplete = make_tag(tmp_path, 6, complete=False)
    with pytest.raises(FileNotFoundError, match="neither a complete checkpoint tag directory"):
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
    with pytest.raises(FileExistsError, match="already holds checkpoints \\(global_step3\\)"):
        check_fresh_start(str(tmp_path), overwrite=False)
    check_fresh_start(str(tmp_path), overwrite=True)


def test_staged_directory_leaves_the_old_output_on_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_directory(str(out)) as staging:
            open(os.path.join(staging, "new.txt"), "w").close()
            raise RuntimeError("crash mid-write")
    assert os.listdir(out) == ["old.txt"] and os.listdir(tmp_path) == ["out"]
    with staged_directory(str(out)) as staging:
        open(os.path.join(staging, "new.txt"), "w").close()
    assert os.listdir(out) == ["new.txt"] and os.listdir(tmp_path) == ["out"]


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
