"""Crash-safe training checkpoints on top of DeepSpeed's save.

A save writes tag directory ``global_stepN`` through DeepSpeed (every rank its own files, each fsynced and hashed
right after it is written), then, only after every rank has finished, rank 0 writes the checksum manifest, drops a
COMPLETE marker in it and atomically points ``latest`` at it: what COMPLETE names is on stable storage first. A
process killed mid-save therefore leaves the previous checkpoint as ``latest``; tag directories without the marker
are never resumed from, and the next run removes them (those that rank 0 marked IN_PROGRESS before the save wrote
anything: checkpoints/tag_dirs.py).
"""
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist
from omegaconf import OmegaConf

import collectives
from checkpoints.disk_space import check_space_for_checkpoint, disk_full_is_one_line
from checkpoints.files import (COMPLETE_MARKER, IN_PROGRESS_MARKER, LATEST, copy_model_side_files,
                               copy_tokenizer_files, fsync_path, link_or_copy, read_latest, write_text_atomic)
from checkpoints.integrity import durable_checksum, file_checksum, read_manifest, write_manifest
from checkpoints.optimizer_state import save_training_state
from checkpoints.rng_state import rng_state_path, save_rng_state
from checkpoints.tag_dirs import begin_change, end_save, prune_checkpoints, tag_of_step
from checkpoints.trainer_state import write_trainer_state
from deepspeed_internals.access import checkpoint_engine_of
from errors import ConfigError
from models.layout import CARRIED_FILE_NAME

RUN_CONFIG_NAME = "run_config.yaml"


@contextlib.contextmanager
def hashing_saves(checkpoint_engine):
    """Yields {path: checksum} of every file DeepSpeed's checkpoint engine writes on this rank, filled on exit. Each
    file is fsynced and hashed by a second thread while the next one is written (its pages still in the page
    cache)."""
    save, hasher, pending, checksums = checkpoint_engine.save, ThreadPoolExecutor(max_workers=1), {}, {}

    def save_and_hash(state_dict, path):
        save(state_dict, path)
        pending[path] = hasher.submit(durable_checksum, path)
    checkpoint_engine.save = save_and_hash
    try:
        yield checksums
        checksums.update({path: future.result() for path, future in pending.items()})
    finally:
        checkpoint_engine.save = save
        hasher.shutdown()


def save_checkpoint(engine, cfg, model_files_dir, trainer_state, needed_bytes, background=None, wait=True):
    """Save global_step<step> crash-safely; needed_bytes: what the checkpoint takes on disk (the last one's size,
    or the planner's estimate before the first), checked against the free space before anything is written.
    background (async_save, checkpoints/background_save.py): the files are snapshot and written by its writer
    process, and the checkpoint is completed once every rank's are (now, with wait); a save still in flight is
    completed first (written by the trainer if its writer failed, and then this save too). Returns the tag directory
    once complete, else None."""
    output_dir, tag = cfg.output_dir, tag_of_step(trainer_state["step"])
    tag_dir = os.path.join(output_dir, tag)
    if background is not None:
        background.wait()
        if background.synchronous:  # a background write failed: the trainer writes every save from now on
            background = None
    check_space_for_checkpoint(output_dir, tag, needed_bytes)
    # rank 0 looks, every rank acts on its answer: an existing tag directory's files would mix with this save's,
    # and its manifest hash them
    exists = [os.path.exists(tag_dir) if dist.get_rank() == 0 else None]
    collectives.broadcast_object_list(exists, src=0)
    if exists[0]:
        raise ConfigError(f"{tag_dir} exists already, and a save never writes into an existing checkpoint (a resume "
                          f"from an older one moves the newer ones aside first, checkpoints/branches.py): is another "
                          f"job writing {output_dir}? Move {tag_dir} away, or give the run another output_dir.")
    if dist.get_rank() == 0:
        begin_change(tag_dir, "save")  # before any file: a crash leaves a directory the next start may remove
    collectives.barrier()
    checkpoint_engine = checkpoint_engine_of(engine)
    if background is None:
        with disk_full_is_one_line(output_dir, tag, needed_bytes), hashing_saves(checkpoint_engine) as written:
            trainer_state = write_rank_files(engine, tag_dir, trainer_state)
        complete_checkpoint(cfg, model_files_dir, tag_dir, trainer_state, written, needed_bytes)
        return tag_dir
    with disk_full_is_one_line(output_dir, tag, needed_bytes), background.snapshots(checkpoint_engine) as files:
        trainer_state = write_rank_files(engine, tag_dir, trainer_state)
    background.submit(files, tag_dir, lambda written: complete_checkpoint(cfg, model_files_dir, tag_dir,
                                                                          trainer_state, written, needed_bytes),
                      needed_bytes)
    if wait:
        background.wait()
        return tag_dir
    return None


def write_rank_files(engine, tag_dir, trainer_state):
    """This rank's files of the checkpoint, through DeepSpeed's checkpoint engine (its weights, its layers'
    optimizer state) and its RNG state; returns trainer_state with what the resume needs added."""
    # Frozen parameters (LoRA's base) are not saved: the checkpoint points at the converted base instead.
    engine.save_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir), client_state=trainer_state,
                           save_latest=False, exclude_frozen_parameters=True)
    trainer_state = {**trainer_state, **save_training_state(engine, tag_dir)}
    save_rng_state(tag_dir, dist.get_rank())
    return trainer_state


def complete_checkpoint(cfg, model_files_dir, tag_dir, trainer_state, written, needed_bytes):
    """Collective, once every rank's files are written ({path: checksum} of this rank's): rank 0 writes the side
    files, the manifest, COMPLETE and `latest`, and prunes the oldest checkpoints."""
    output_dir, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    rng_path = rng_state_path(tag_dir, dist.get_rank())
    written[rng_path] = durable_checksum(rng_path)
    every_rank = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    collectives.gather_object({os.path.relpath(p, tag_dir): c for p, c in written.items()}, every_rank, dst=0)
    # gather_object returned: every rank's files are written before the checkpoint is declared complete
    if dist.get_rank() == 0:
        with disk_full_is_one_line(output_dir, tag, needed_bytes):
            write_side_files_and_complete(cfg, model_files_dir, tag_dir, trainer_state, every_rank)
        prune_checkpoints(output_dir, cfg.save_total_limit)
    collectives.barrier()


def write_side_files_and_complete(cfg, model_files_dir, tag_dir, trainer_state, every_rank):
    """Rank 0, once every rank's files are written: the side files, the checksum manifest, COMPLETE, `latest`."""
    output_dir, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    copy_model_side_files(model_files_dir, tag_dir)
    if cfg.tokenizer_name_or_path:
        copy_tokenizer_files(cfg.tokenizer_name_or_path, tag_dir)
    OmegaConf.save(cfg, os.path.join(tag_dir, RUN_CONFIG_NAME), resolve=True)
    write_trainer_state(tag_dir, trainer_state)
    checksums = {name: checksum for files in every_rank for name, checksum in files.items()}
    carry_untrained_tensors(cfg.model_name_or_path, tag_dir, checksums)
    for name in os.listdir(tag_dir):  # the small side files rank 0 just wrote
        if name not in checksums and name != IN_PROGRESS_MARKER and os.path.isfile(os.path.join(tag_dir, name)):
            checksums[name] = durable_checksum(os.path.join(tag_dir, name))
    write_manifest(tag_dir, checksums)  # atomically: which fsyncs the directory, every file's name in it
    write_text_atomic(os.path.join(tag_dir, COMPLETE_MARKER), tag)
    end_save(tag_dir)
    write_text_atomic(os.path.join(output_dir, LATEST), tag)


def carry_untrained_tensors(model_dir, tag_dir, checksums):
    """The tensors of the converted model the run trains that the pipeline does not run (conversion keeps them
    beside its layer files, models/layout.py CARRIED_FILE_NAME: multi-token-prediction layers, vision and audio
    towers, and the record of the checkpoint's hub layout), into the checkpoint as they are, so that its export
    writes them back bit for bit: a hard link where the filesystem takes one, else a copy. Its checksum is the one
    model_dir's manifest recorded for the same bytes (computed where there is none)."""
    source_dir = os.path.join(model_dir, read_latest(model_dir) or "")
    source = os.path.join(source_dir, CARRIED_FILE_NAME)
    if not os.path.isfile(source):
        return
    target = os.path.join(tag_dir, CARRIED_FILE_NAME)
    link_or_copy(source, target)
    fsync_path(target)  # on stable storage before COMPLETE names it (a link's data is the base's, already there)
    checksums[CARRIED_FILE_NAME] = (read_manifest(source_dir) or {}).get(CARRIED_FILE_NAME) or file_checksum(target)
