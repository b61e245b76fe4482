"""What a run starts from: the checkpoint `resume` names (auto: the newest complete one), else the converted
model, and a fresh start's refusal to mix its checkpoints with an older run's."""
import os

from checkpoints.files import COMPLETE_MARKER, read_latest
from checkpoints.tag_dirs import complete_tags, is_complete


def resolve_resume(resume, output_dir):
    """(checkpoint dir, tag) to resume from, or None for a fresh start. resume: auto | a checkpoint dir | a tag dir."""
    if resume in (None, "", False):
        return None
    if resume == "auto":
        tags = complete_tags(output_dir)
        return (output_dir, tags[-1]) if tags else None
    path = os.path.abspath(str(resume))
    if is_complete(path):
        return os.path.dirname(path), os.path.basename(path)
    tag = read_latest(path)
    if tag and is_complete(os.path.join(path, tag)):
        return path, tag
    raise FileNotFoundError(f"resume='{resume}' is neither a complete checkpoint tag directory (with a "
                            f"{COMPLETE_MARKER} file) nor a directory whose 'latest' names one; use resume=auto or a "
                            f"valid path.")


def check_fresh_start(output_dir, overwrite):
    """A run that does not resume must not mix its checkpoints with an older run's."""
    tags = complete_tags(output_dir)
    if tags and not overwrite:
        raise FileExistsError(f"output_dir '{output_dir}' already holds checkpoints ({', '.join(tags)}); set "
                              f"resume=auto to continue from {tags[-1]}, choose another output_dir, or set "
                              f"overwrite_output_dir=true to delete them.")


def start_checkpoint_dir(model_name_or_path, resume_from):
    """The tag directory a run loads: the resumed checkpoint's, else the converted model's."""
    if resume_from:
        return os.path.join(*resume_from)
    return os.path.join(model_name_or_path, read_latest(model_name_or_path))
