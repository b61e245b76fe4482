"""Crash-safe training checkpoints on top of DeepSpeed's save/load.

A save writes tag directory ``global_stepN`` through DeepSpeed (every rank its own files, each hashed right after
it is written), then, only after every rank has finished, rank 0 writes the checksum manifest, drops a COMPLETE
marker in it and atomically points ``latest`` at it. A process killed mid-save therefore leaves the previous
checkpoint as ``latest``; tag directories without the marker are never resumed from and are removed by the next run.
"""
import contextlib
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from checkpoints.files import (COMPLETE_MARKER, LATEST, copy_model_side_files, copy_tokenizer_files, free_bytes,
                               is_disk_full, read_latest, size_text, write_text_atomic)
from checkpoints.integrity import (ChecksumError, file_checksum, no_manifest_note, read_by_weights_only_load,
                                   read_manifest, verify_files, write_manifest)
from checkpoints.state_files import load_rng_file
from models.partition import decoder_counts_of_bounds
from training.optimizer_state import missing_state_message, save_training_state, saved_optimizer_state_paths

TAG_PATTERN = re.compile(r"^global_step(\d+)$")
RUN_CONFIG_NAME = "run_config.yaml"
TRAINER_STATE_NAME = "trainer_state.json"


class DiskFullError(OSError):
    """A checkpoint that does not fit on its disk; the message names it, what it needs and where to resume.
    every_rank: every rank refuses it together (before writing), so each can say so before any exits."""

    def __init__(self, message, every_rank=False):
        super().__init__(message)
        self.every_rank = every_rank


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


def clear_previous_run(output_dir):
    """overwrite_output_dir=true: remove an older run's checkpoints, 'latest' and metrics (rank 0)."""
    for tag in complete_tags(output_dir):
        os.remove(os.path.join(output_dir, tag, COMPLETE_MARKER))
        shutil.rmtree(os.path.join(output_dir, tag))
    for name in (LATEST, "metrics.jsonl"):
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))


def rng_state_path(tag_dir, rank):
    return os.path.join(tag_dir, f"rng_state_rank{rank:05d}.pt")


def save_rng_state(tag_dir, rank):
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               rng_state_path(tag_dir, rank))


def load_rng_state(tag_dir, rank):
    path = rng_state_path(tag_dir, rank)
    if not os.path.isfile(path):
        return
    state = load_rng_file(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def read_trainer_state(tag_dir):
    """{"step", "consumed_samples", "topology"} of a training checkpoint ({} for a converted model)."""
    path = os.path.join(tag_dir, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def has_layout_free_state(trainer_state):
    """Whether a checkpoint's optimizer state is saved per layer (training/optimizer_state.py), so that any layout
    resumes it; older checkpoints hold DeepSpeed's per-rank files, which only their own layout loads."""
    return "optimizer_step" in trainer_state


def check_resume_topology(trainer_state, topology, weights_only, tag_dir):
    """A checkpoint written before the optimizer state was saved per layer: its state is laid out per stage (and per
    data-parallel rank under ZeRO-1) and cannot follow a change."""
    saved = trainer_state.get("topology")
    if saved and "stage_bounds" not in saved:  # written before the stages' layers were recorded
        topology = degrees_of(topology)
    if saved and saved != topology and not weights_only:
        only_layers_differ = "stage_bounds" in saved and degrees_of(saved) == degrees_of(topology)
        partition = (f", or partition={decoder_counts_of_bounds(saved['stage_bounds'])} to build the checkpoint's "
                     f"stages" if only_layers_differ else "")
        raise ValueError(f"checkpoint {tag_dir} was trained with {saved}, this run has {topology}; its optimizer "
                         f"state (written before checkpoints saved it per layer) cannot follow a topology change. Set "
                         f"resume_weights_only=true to continue from its weights with a fresh optimizer (the data "
                         f"position is kept by consumed samples){partition}.")


def degrees_of(topology):
    """A saved or current topology without its stage bounds: the parallel degrees alone."""
    return {key: value for key, value in topology.items() if key != "stage_bounds"}


MODEL_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


def check_same_model(tag_dir, model_config):
    """A checkpoint resumes only onto the model it was trained as: its config.json against the run's model."""
    path = os.path.join(tag_dir, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f)
    current = model_config.to_dict()
    differ = [f"{key} {saved.get(key)} there, {current.get(key)} here" for key in MODEL_SHAPE_KEYS
              if saved.get(key) != current.get(key)]
    if differ:
        raise ValueError(f"checkpoint {tag_dir} is of another model than model_name_or_path ({'; '.join(differ)}): "
                         f"resume a checkpoint of this model, or set model_name_or_path to the converted model the "
                         f"checkpoint was trained from.")


def check_optimizer_state_files(tag_dir, trainer_state, layer_indices):
    """Every layer's optimizer state is in the checkpoint (one file per tensor-parallel rank that wrote it)."""
    slices = trainer_state.get("topology", {}).get("tensor_parallel", 1)
    for index in layer_indices:
        found = len(saved_optimizer_state_paths(tag_dir, index))
        if found != slices:
            raise FileNotFoundError(missing_state_message(tag_dir, index) if not found else
                                    f"checkpoint {tag_dir} has {found} optimizer-state files for layer {index}, its "
                                    f"{slices} tensor-parallel ranks wrote {slices}; copy the checkpoint again, or "
                                    f"set resume_weights_only=true to continue from its weights.")


def dropped_state(saved_settings, settings):
    """What a resume under `settings` cannot carry over from a checkpoint written under saved_settings."""
    if saved_settings.get("precision") == "fp16" and settings["precision"] != "fp16":
        return [f"fp16's loss scale (the run goes from fp16 to {settings['precision']})"]
    return []


def layout_change(trainer_state, layout, settings):
    """'key: old -> new' for each thing a resume changes about the run that wrote the checkpoint."""
    unsplit = {"tensor_parallel": 1, "context_parallel": 1}  # recorded only when > 1
    saved = {**unsplit, **trainer_state.get("topology", {}), **trainer_state.get("settings", {})}
    current = {**unsplit, **layout, **settings}
    return [f"{key} {saved[key]} -> {current[key]}" for key in current if key in saved and saved[key] != current[key]]


@contextlib.contextmanager
def hashing_saves(checkpoint_engine):
    """Yields {path: checksum} of every file DeepSpeed's checkpoint engine writes on this rank, filled on exit. Each
    file is hashed by a second thread while the next one is written, its pages still in the page cache."""
    save, hasher, pending, checksums = checkpoint_engine.save, ThreadPoolExecutor(max_workers=1), {}, {}

    def save_and_hash(state_dict, path):
        save(state_dict, path)
        pending[path] = hasher.submit(file_checksum, path)
    checkpoint_engine.save = save_and_hash
    try:
        yield checksums
        checksums.update({path: future.result() for path, future in pending.items()})
    finally:
        checkpoint_engine.save = save
        hasher.shutdown()


def save_checkpoint(engine, cfg, model_files_dir, trainer_state, needed_bytes):
    """Save global_step<step> crash-safely; needed_bytes: what the checkpoint takes on disk (the last one's size,
    or the planner's estimate before the first), checked against the free space before anything is written."""
    output_dir, tag = cfg.output_dir, tag_of_step(trainer_state["step"])
    tag_dir = os.path.join(output_dir, tag)
    check_space_for_checkpoint(output_dir, tag, needed_bytes)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(tag_dir, COMPLETE_MARKER)):
        os.remove(os.path.join(tag_dir, COMPLETE_MARKER))  # rewriting a tag: it is incomplete until done again
    dist.barrier()
    with disk_full_is_one_line(output_dir, tag, needed_bytes), hashing_saves(engine.checkpoint_engine) as written:
        # Frozen parameters (LoRA's base) are not saved: the checkpoint points at the converted base instead.
        engine.save_checkpoint(output_dir, tag=tag, client_state=trainer_state, save_latest=False,
                               exclude_frozen_parameters=True)
        trainer_state = {**trainer_state, **save_training_state(engine, tag_dir)}
        save_rng_state(tag_dir, dist.get_rank())
    rng_path = rng_state_path(tag_dir, dist.get_rank())
    written[rng_path] = file_checksum(rng_path)
    every_rank = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({os.path.relpath(p, tag_dir): c for p, c in written.items()}, every_rank, dst=0)
    # gather_object returned: every rank's files are written before the checkpoint is declared complete
    if dist.get_rank() == 0:
        with disk_full_is_one_line(output_dir, tag, needed_bytes):
            write_side_files_and_complete(cfg, model_files_dir, tag_dir, trainer_state, every_rank)
        prune_checkpoints(output_dir, cfg.save_total_limit)
    dist.barrier()
    return tag_dir


def write_side_files_and_complete(cfg, model_files_dir, tag_dir, trainer_state, every_rank):
    """Rank 0, once every rank's files are written: the side files, the checksum manifest, COMPLETE, `latest`."""
    output_dir, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    copy_model_side_files(model_files_dir, tag_dir)
    if cfg.tokenizer_name_or_path:
        copy_tokenizer_files(cfg.tokenizer_name_or_path, tag_dir)
    OmegaConf.save(cfg, os.path.join(tag_dir, RUN_CONFIG_NAME), resolve=True)
    with open(os.path.join(tag_dir, TRAINER_STATE_NAME), "w") as f:
        json.dump(trainer_state, f, indent=2)
    checksums = {name: checksum for files in every_rank for name, checksum in files.items()}
    for name in os.listdir(tag_dir):  # the small side files rank 0 just wrote
        if name not in checksums and os.path.isfile(os.path.join(tag_dir, name)):
            checksums[name] = file_checksum(os.path.join(tag_dir, name))
    write_manifest(tag_dir, checksums)
    write_text_atomic(os.path.join(tag_dir, COMPLETE_MARKER), tag)
    write_text_atomic(os.path.join(output_dir, LATEST), tag)


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
    dist.broadcast_object_list(reading, src=0)
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




def verify_checkpoint(tag_dir, weights_only):
    """Check the files of a checkpoint about to be loaded (weights_only: all but the optimizer states) against its
    manifest, before the engine is built. File i (sorted) is checked by rank i mod world size: each byte is read
    once, all ranks in parallel, whatever DeepSpeed's file layout (stages, ZeRO shards, tensor-parallel slices);
    every rank then raises the same error, naming each file that fails, so none is left waiting at a collective."""
    recorded = read_manifest(tag_dir)
    if recorded is None:
        if dist.get_rank() == 0:
            print(no_manifest_note(tag_dir), flush=True)
        return
    needed = sorted(name for name in recorded if not weights_only or read_by_weights_only_load(name))
    mine = needed[dist.get_rank()::dist.get_world_size()]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, verify_files(tag_dir, mine))
    failures = [message for messages in every_rank for message in messages]
    if failures:
        raise ChecksumError("\n".join(failures))


def start_checkpoint_dir(model_name_or_path, resume_from):
    """The tag directory a run loads: the resumed checkpoint's, else the converted model's."""
    if resume_from:
        return os.path.join(*resume_from)
    return os.path.join(model_name_or_path, read_latest(model_name_or_path))


def prune_checkpoints(output_dir, keep):
    """Delete the oldest complete checkpoints beyond the newest `keep` (at least one is always kept)."""
    tags = complete_tags(output_dir)
    for tag in tags[:-max(1, keep)]:
        os.remove(os.path.join(output_dir, tag, COMPLETE_MARKER))  # a crash mid-delete must not leave it "complete"
        shutil.rmtree(os.path.join(output_dir, tag))
