"""The checkpoints of a training run's output_dir: tag directories ``global_stepN``, each complete once its COMPLETE
marker is written (last, after every rank's files and the manifest) and deleted marker first, so a crash mid-delete
never leaves a partial directory that counts as complete."""
import os
import re
import shutil

from checkpoints.files import COMPLETE_MARKER, LATEST

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


def remove_incomplete_checkpoints(output_dir):
    """Delete tag directories a crashed save left behind (rank 0, before training starts)."""
    if not os.path.isdir(output_dir):
        return []
    removed = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if TAG_PATTERN.match(name) and os.path.isdir(path) and not is_complete(path):
            shutil.rmtree(path)
            removed.append(name)
    return removed


def clear_previous_run(output_dir):
    """overwrite_output_dir=true: remove an older run's checkpoints, 'latest' and metrics, lm-eval's included
    (rank 0)."""
    for tag in complete_tags(output_dir):
        os.remove(os.path.join(output_dir, tag, COMPLETE_MARKER))
        shutil.rmtree(os.path.join(output_dir, tag))
    for name in (LATEST, "metrics.jsonl", "lm_eval.jsonl"):
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    shutil.rmtree(os.path.join(output_dir, "lm_eval_samples"), ignore_errors=True)


def prune_checkpoints(output_dir, keep):
    """Delete the oldest complete checkpoints beyond the newest `keep` (at least one is always kept)."""
    tags = complete_tags(output_dir)
    for tag in tags[:-max(1, keep)]:
        os.remove(os.path.join(output_dir, tag, COMPLETE_MARKER))  # a crash mid-delete must not leave it "complete"
        shutil.rmtree(os.path.join(output_dir, tag))
