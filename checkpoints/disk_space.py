"""Whether a checkpoint fits on its disk: checked before a save (every rank refuses together), warned about at
start-up, and a full disk mid-save turned into one line that says what to do."""
import contextlib
import os

import torch.distributed as dist

import collectives
from checkpoints.files import free_bytes, is_disk_full, size_text
from checkpoints.tag_dirs import complete_tags


class DiskFullError(OSError):
    """A checkpoint that does not fit on its disk; the message names it, what it needs and where to resume.
    every_rank: every rank refuses it together (before writing), so each can say so before any exits."""

    def __init__(self, message, every_rank=False):
        super().__init__(message)
        self.every_rank = every_rank


@contextlib.contextmanager
def disk_full_is_one_line(output_dir, tag, needed_bytes):
    """A full disk while writing a checkpoint becomes a DiskFullError saying what to do, instead of torch's
    "[enforce fail at inline_container.cc] unexpected pos" (or ENOSPC) traceback."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if not is_disk_full(error):
            raise
        raise DiskFullError(disk_full_message(output_dir, tag, needed_bytes, free_bytes(output_dir))) from None


def checkpoint_bytes(tag_dir):
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(tag_dir) for name in names)


def check_space_for_checkpoint(output_dir, tag, needed_bytes):
    """Every rank takes rank 0's reading of the free space, so all refuse together, before anything is written:
    `latest` stays on the last complete checkpoint."""
    reading = [(free_bytes(output_dir), needed_bytes) if dist.get_rank() == 0 else None]
    collectives.broadcast_object_list(reading, src=0)
    free, needed = reading[0]
    if free < needed:
        raise DiskFullError(disk_full_message(output_dir, tag, needed, free), every_rank=True)


def disk_full_message(output_dir, tag, needed_bytes, free):
    tags = complete_tags(output_dir)
    resume = (f"resume=auto continues from the last complete checkpoint, {os.path.join(output_dir, tags[-1])}"
              if tags else "no complete checkpoint was saved yet")
    return (f"checkpoint {tag} does not fit on the disk of '{output_dir}': {size_text(free)} free, a checkpoint "
            f"needs about {size_text(needed_bytes)}; free space there (or lower save_total_limit, or choose an "
            f"output_dir on a larger disk); {resume}.")


def storage_warning(output_dir, needed_bytes, save_total_limit):
    """A start-up warning when output_dir's filesystem cannot hold the save_total_limit + 1 checkpoints a save
    needs at once (the kept ones and the one being written; this run's older checkpoints count as free); else None."""
    wanted = (max(1, save_total_limit) + 1) * needed_bytes
    capacity = free_bytes(output_dir) + sum(checkpoint_bytes(os.path.join(output_dir, tag))
                                            for tag in complete_tags(output_dir))
    if capacity >= wanted:
        return None
    return (f"warning: the disk of output_dir '{output_dir}' holds {size_text(capacity)} for checkpoints, less "
            f"than save_total_limit + 1 = {max(1, save_total_limit) + 1} checkpoints of about "
            f"{size_text(needed_bytes)}; a save will stop the run when the disk is full.")
