"""Per-file checksums of a checkpoint directory: recorded when it is written, verified before it is read.

Layer files are written without zip CRCs (and torch.load checks none), so a flipped byte would otherwise load and
export silently. Every converted directory and every training checkpoint holds ``checksums.json``: for each file of
its tag directory (and, in a converted directory, one more for the config and tokenizer files at its top level), the
size and an xxh3-128 hash (xxhash: fast enough to hash every file as it is written, bench/checksum_cost.py). A
file is hashed (a training checkpoint's also fsynced) right after it is written, while its pages are still in the
page cache; the manifest is written atomically and before the checkpoint is declared complete, so a complete
checkpoint always has a complete manifest.
"""
import json
import os

import torch.distributed as dist
import xxhash

import collectives
from checkpoints.files import MANIFEST_NAME, fsync_path, write_text_atomic
from cluster.console import say

ALGORITHM = "xxh3_128"
CHUNK_BYTES = 16 << 20


class ChecksumError(ValueError):
    """A file of a checkpoint differs from what its manifest recorded; the message names the file."""


def file_checksum(path):
    """{"bytes": size, ALGORITHM: hex digest} of a file, read in chunks into one reused buffer."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
            size += count
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


def durable_checksum(path):
    """file_checksum of a file just written, once fsync has put it on stable storage: a checkpoint declared complete
    names no file that a power loss or a node's crash could leave empty or short."""
    fsync_path(path)
    return file_checksum(path)


def write_manifest(directory, checksums):
    """checksums: {file name in directory: file_checksum(...)}; written atomically (temporary file, rename)."""
    write_text_atomic(os.path.join(directory, MANIFEST_NAME),
                      json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(checksums.items()))}, indent=1))


def read_manifest(directory):
    """{file name: recorded checksum}, or None for a directory written before checksums were recorded."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {manifest['algorithm']!r}")
        return manifest["files"]
    except (ValueError, KeyError, TypeError) as error:
        raise ChecksumError(f"checksum manifest '{path}' is unreadable ({error}); the checkpoint cannot be verified. "
                            f"Restore it from a copy, or skip the check (verify_checksums=false / "
                            f"--skip_checksums) if you trust the files.") from None


def verify_file(directory, name, recorded):
    """None if the file matches its recorded checksum, else the message naming it."""
    path = os.path.join(directory, name)
    skip = "restore the file from a copy or resume from an older checkpoint (verify_checksums=false / " \
           "--skip_checksums skips this check)"
    if not os.path.isfile(path):
        return f"checkpoint file '{path}' is missing but listed in {MANIFEST_NAME}; {skip}."
    size = os.path.getsize(path)
    if size != recorded["bytes"]:
        return (f"checkpoint file '{path}' is {size} bytes, {MANIFEST_NAME} recorded {recorded['bytes']} when it was "
                f"written (truncated or replaced); {skip}.")
    actual = file_checksum(path)[ALGORITHM]
    if actual != recorded[ALGORITHM]:
        return (f"checkpoint file '{path}' is corrupt: its {ALGORITHM} checksum {actual} differs from the "
                f"{recorded[ALGORITHM]} {MANIFEST_NAME} recorded when it was written; {skip}.")
    return None


def verify_files(directory, names):
    """The messages of the named files (listed in the manifest) that fail."""
    recorded = read_manifest(directory)
    return [message for name in names if (message := verify_file(directory, name, recorded[name]))]


def verify_directory(directory, needed=lambda name: True):
    """Check the manifest's files that needed(name) selects (those the caller will read); raise ChecksumError
    naming every file that fails. Returns False when there is no manifest to check."""
    recorded = read_manifest(directory)
    if recorded is None:
        return False
    failures = verify_files(directory, [name for name in sorted(recorded) if needed(name)])
    if failures:
        raise ChecksumError("\n".join(failures))
    return True


def read_by_export(name):
    """Export to Hugging Face reads the layer files and the side files, not optimizer, engine or RNG states."""
    return name.startswith("layer_") or not name.endswith(".pt")


def is_model_side_file(name):
    """config.json, generation_config.json, the tokenizer: what a run or an export reads beside the layer files."""
    return not name.endswith(".pt")


def verify_model_side_files(directory):
    """Check the side files in directory's manifest (a converted directory's top level, or a training checkpoint's
    tag directory) before any is read; False when there is no manifest (converted before they were recorded)."""
    return verify_directory(directory, is_model_side_file)


def read_by_weights_only_load(name):
    """A weights-only load (a converted model, resume_weights_only) reads everything but the optimizer states."""
    return "optim_states" not in name


def no_manifest_note(directory):
    return (f"note: '{directory}' has no {MANIFEST_NAME} (written before checksums were recorded): its files are "
            f"not verified.")


def manifest_digest(directory):
    """One checksum of a whole directory as its manifest recorded it (every file's size and hash), or None without
    a manifest: what a LoRA checkpoint records of the frozen base it was trained on, checked again on resume."""
    recorded = read_manifest(directory)
    if recorded is None:
        return None
    return xxhash.xxh3_128(json.dumps(recorded, sort_keys=True).encode()).hexdigest()


def verify_checkpoint(tag_dir, weights_only):
    """Check the files of a checkpoint about to be loaded (weights_only: all but the optimizer states) against its
    manifest, before the engine is built. File i (sorted) is checked by rank i mod world size: each byte is read
    once, all ranks in parallel, whatever DeepSpeed's file layout (stages, ZeRO shards, tensor-parallel slices);
    every rank then raises the same error, naming each file that fails, so none is left waiting at a collective."""
    recorded = read_manifest(tag_dir)
    if recorded is None:
        if dist.get_rank() == 0:
            say(no_manifest_note(tag_dir))
        return
    needed = sorted(name for name in recorded if not weights_only or read_by_weights_only_load(name))
    mine = needed[dist.get_rank()::dist.get_world_size()]
    every_rank = [None] * dist.get_world_size()
    collectives.all_gather_object(every_rank, verify_files(tag_dir, mine))
    failures = [message for messages in every_rank for message in messages]
    if failures:
        raise ChecksumError("\n".join(failures))
