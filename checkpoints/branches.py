"""A run's history in its output_dir. A resume from a checkpoint older than the newest one there (a corrupt newest
checkpoint, a loss spike rolled back) starts a new branch: the checkpoints of later steps, the abandoned branch, are
moved, never deleted, into output_dir/abandoned/after_global_stepN-<UTC time>/ with the run's metrics as they were,
so that retention (save_total_limit), `latest` and resume=auto follow the current branch, and no save of the new
branch writes into a tag directory of the old one.

The move is crash-safe and decided once, by rank 0: it writes the plan (which tags) into the branch directory
first, then renames each tag directory into it (one rename each: a checkpoint is either here or there, never lost,
never in both), points `latest` at the newest checkpoint left and marks the plan done. Every start finishes a move
a crash interrupted (finish_moves) before it looks at the checkpoints."""
import json
import os
import shutil
import time

from checkpoints.files import LATEST, atomic_path, fsync_path, write_text_atomic
from checkpoints.tag_dirs import TAG_PATTERN, complete_tags, newest_tag

ABANDONED_DIR = "abandoned"
PLAN = "moving.json"  # in a branch directory until its move is done
DONE = "moved.json"  # the plan, once done
RUN_LOGS = ("metrics.jsonl", "lm_eval.jsonl")  # copied as they were: the new branch logs its own steps again


def step_of(tag):
    return int(TAG_PATTERN.match(tag).group(1))


def start_branch(output_dir, resumed_tag_dir, now=None):
    """Rank 0, before a resume from resumed_tag_dir trains: move output_dir's complete checkpoints of later steps
    into a new branch directory. Returns (that directory, the tags moved), or None when there were none."""
    step = step_of(os.path.basename(resumed_tag_dir))
    tags = [tag for tag in complete_tags(output_dir) if step_of(tag) > step]
    if not tags:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    branch = os.path.join(output_dir, ABANDONED_DIR, f"after_{os.path.basename(resumed_tag_dir)}-{stamp}")
    os.makedirs(branch)  # refuses an existing one: a branch directory is never reused
    write_text_atomic(os.path.join(branch, PLAN), json.dumps({"resumed": resumed_tag_dir, "tags": tags}))
    fsync_path(os.path.dirname(branch))
    finish_move(output_dir, branch)
    return branch, tags


def finish_move(output_dir, branch):
    """Carry out branch's plan from where it stands: the tags still in output_dir renamed into it, the run's logs
    copied as they were, `latest` pointed at the newest checkpoint left (removed if none), the plan marked done."""
    with open(os.path.join(branch, PLAN)) as f:
        plan = json.load(f)
    for tag in plan["tags"]:
        source, target = os.path.join(output_dir, tag), os.path.join(branch, tag)
        if os.path.isdir(source) and not os.path.exists(target):
            os.rename(source, target)
    for name in RUN_LOGS:
        source, target = os.path.join(output_dir, name), os.path.join(branch, name)
        if os.path.isfile(source) and not os.path.exists(target):
            with atomic_path(target) as tmp:
                shutil.copyfile(source, tmp)
    fsync_path(branch)
    fsync_path(output_dir)
    latest = newest_tag(complete_tags(output_dir))
    if latest:
        write_text_atomic(os.path.join(output_dir, LATEST), latest)
    elif os.path.exists(os.path.join(output_dir, LATEST)):
        os.remove(os.path.join(output_dir, LATEST))
    os.replace(os.path.join(branch, PLAN), os.path.join(branch, DONE))
    fsync_path(branch)


def finish_moves(output_dir):
    """Rank 0 at every start, before the checkpoints are looked at: finish each move a crash interrupted. Returns
    the branch directories finished."""
    root = os.path.join(output_dir, ABANDONED_DIR)
    if not os.path.isdir(root):
        return []
    interrupted = [os.path.join(root, name) for name in sorted(os.listdir(root))
                   if os.path.isfile(os.path.join(root, name, PLAN))]
    for branch in interrupted:
        finish_move(output_dir, branch)
    return interrupted
