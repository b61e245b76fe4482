"""What a run starts from: the checkpoint `resume` names (auto: the newest complete one), else the converted
model; a fresh start's refusal to mix its checkpoints with an older run's, and every start's refusal of an
output_dir holding what the trainer did not write and would clean up."""
import os

from checkpoints.files import COMPLETE_MARKER, IN_PROGRESS_MARKER, read_latest
from checkpoints.tag_dirs import complete_tags, incomplete_tags, is_complete
from errors import ConfigError


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
    raise ConfigError(f"resume='{resume}' is neither a complete checkpoint tag directory (with a {COMPLETE_MARKER} "
                      f"file) nor a directory whose 'latest' names one; use resume=auto or a valid path.")


def check_fresh_start(output_dir, overwrite):
    """A run that does not resume must not mix its checkpoints with an older run's."""
    tags = complete_tags(output_dir)
    if tags and not overwrite:
        raise ConfigError(f"output_dir '{output_dir}' already holds checkpoints ({', '.join(tags)}); set "
                          f"resume=auto to continue from {tags[-1]}, choose another output_dir, or set "
                          f"overwrite_output_dir=true to delete them.")


def start_checkpoint_dir(model_name_or_path, resume_from):
    """The tag directory a run loads: the resumed checkpoint's, else the converted model's."""
    if resume_from:
        return os.path.join(*resume_from)
    return os.path.join(model_name_or_path, read_latest(model_name_or_path))


def check_output_dir_is_ours(output_dir, model_name_or_path):
    """Nothing in output_dir that a start's cleanup could delete was written by someone else: it is not the model
    the run starts from, and each incomplete global_stepN in it is an interrupted save of this trainer."""
    if os.path.realpath(output_dir) == os.path.realpath(model_name_or_path):
        raise ConfigError(f"output_dir '{output_dir}' is model_name_or_path, the converted model this run starts "
                          f"from: its checkpoints would replace the model's 'latest' and mix with its global_step0; "
                          f"choose another output_dir.")
    others = incomplete_tags(output_dir)[1]
    if others:
        raise ConfigError(f"output_dir '{output_dir}' holds {', '.join(others)}, which no save of this trainer "
                          f"wrote (neither {COMPLETE_MARKER} nor {IN_PROGRESS_MARKER} in it: a converted model, "
                          f"another tool's checkpoint?); move it out of output_dir or choose another output_dir.")
