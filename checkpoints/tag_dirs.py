"""The checkpoints of a training run's output_dir: tag directories ``global_stepN``, each complete once its COMPLETE
marker is written (last, after every rank's files and the manifest) and deleted marker first, so a crash mid-delete
never leaves a partial directory that counts as complete.

Before a save writes anything into a tag directory, or a deletion removes anything from it, an IN_PROGRESS marker
says that this trainer is changing it: a start removes only incomplete directories that hold it, and refuses an
output_dir holding any other incomplete one (a converted model's global_step0, another tool's checkpoint)."""
import contextlib
import os
import re
import shutil

from checkpoints.files import COMPLETE_MARKER, IN_PROGRESS_MARKER, LATEST, write_text_atomic

TAG_PATTERN = re.compile(r"^global_step(\d+)$")


def tag_of_step(step):
    return f"global_step{step}"


def is_complete(tag_dir):
    return os.path.isfile(os.path.join(tag_dir, COMPLETE_MARKER))


def complete_tags(output_dir):
    """Complete checkpoint tags in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    tags = [(int(m.group(1)), name) for name in os.listdir(output_dir)
            if (m := TAG_PATTERN.match(name)) and is_complete(os.path.join(output_dir, name))]
    return [name for _, name in sorted(tags)]


def checkpoint_identities(output_dir):
    """{tag: (inode, mtime) of its COMPLETE marker} of the complete checkpoints in output_dir: a checkpoint saved
    again under an old tag (a fresh start over an older run) is a new one."""
    identities = {}
    for tag in complete_tags(output_dir):
        with contextlib.suppress(FileNotFoundError):  # deleted since it was listed (pruned)
            marker = os.stat(os.path.join(output_dir, tag, COMPLETE_MARKER))
            identities[tag] = (marker.st_ino, marker.st_mtime_ns)
    return identities


def newest_tag(tags):
    """The newest of checkpoint tags (by step), or None."""
    return max(tags, key=lambda tag: int(TAG_PATTERN.match(tag).group(1)), default=None)


def begin_change(tag_dir, what):
    """Mark tag_dir as this trainer's, incomplete until its COMPLETE marker is written again (rank 0, before a save
    writes into it or a deletion removes anything); what: "save" or "delete"."""
    os.makedirs(tag_dir, exist_ok=True)
    write_text_atomic(os.path.join(tag_dir, IN_PROGRESS_MARKER), what)
    if is_complete(tag_dir):
        os.remove(os.path.join(tag_dir, COMPLETE_MARKER))


def end_save(tag_dir):
    """After COMPLETE: the directory no longer needs its in-progress marker."""
    os.remove(os.path.join(tag_dir, IN_PROGRESS_MARKER))


def delete_tag_dir(tag_dir):
    begin_change(tag_dir, "delete")  # a crash mid-delete leaves a directory the next start removes
    shutil.rmtree(tag_dir)


def incomplete_tags(output_dir):
    """(interrupted saves and deletions of this trainer, other incomplete tag directories) in output_dir."""
    ours, others = [], []
    if not os.path.isdir(output_dir):
        return ours, others
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if TAG_PATTERN.match(name) and os.path.isdir(path) and not is_complete(path):
            (ours if os.path.isfile(os.path.join(path, IN_PROGRESS_MARKER)) else others).append(name)
    return ours, others


def remove_incomplete_checkpoints(output_dir):
    """Delete the tag directories an interrupted save or deletion of this trainer left (rank 0, before training
    starts); any other incomplete directory is left as it is (run_spec refuses to start beside one)."""
    removed = incomplete_tags(output_dir)[0]
    for name in removed:
        shutil.rmtree(os.path.join(output_dir, name))
    return removed


def clear_previous_run(output_dir):
    """overwrite_output_dir=true: remove an older run's checkpoints, 'latest' and metrics, lm-eval's included
    (rank 0)."""
    for tag in complete_tags(output_dir):
        delete_tag_dir(os.path.join(output_dir, tag))
    for name in (LATEST, "metrics.jsonl", "lm_eval.jsonl"):
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    shutil.rmtree(os.path.join(output_dir, "lm_eval_samples"), ignore_errors=True)


def prune_checkpoints(output_dir, keep):
    """Delete the oldest complete checkpoints beyond the newest `keep` (at least one is always kept)."""
    tags = complete_tags(output_dir)
    for tag in tags[:-max(1, keep)]:
        delete_tag_dir(os.path.join(output_dir, tag))
