"""Saves that do not stop training (async_save=true, or auto where every node has room for the snapshots).

At a save each rank takes a snapshot of the files it writes (its layers' weights and optimizer state, DeepSpeed's
model-states file): host buffers kept from one save to the next (in shared memory, pinned under CUDA) that a thread
of its own fills while the next step's forward and backward run (its optimizer step waits for the copy), then
hands to a writer process (spawned once per rank: a separate interpreter, so writing never holds the trainer's
GIL), which writes, fsyncs and hashes them while training goes on. The checkpoint becomes COMPLETE and `latest`
exactly as a synchronous save does (checkpoints/saving.py: complete_checkpoint), once every rank's writer is done:
after each step, while a write is in flight, the ranks agree on it with one all-reduce of a flag. The next save, a
preemption and the end of training wait for it. A rank killed mid-write takes its writer with it (the parent's
death kills it), so the previous `latest` stays and the partial directory is removed at the next start. A writer
that fails or dies is found at the next step, and every rank acts on it together (BackgroundSave: a full disk stops
the run, anything else is written again by the trainer, which saves synchronously from then on).
"""
import contextlib
import ctypes
import itertools
import multiprocessing.connection
import os
import shutil
import signal

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.multiprocessing
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.schedule import OptimizerStep

import collectives
from checkpoints.disk_space import DiskFullError, disk_full_is_one_line, disk_full_message
from checkpoints.files import free_bytes, is_disk_full, size_text
from checkpoints.integrity import durable_checksum
from checkpoints.tag_dirs import begin_change
from errors import ConfigError
from cluster.console import say

PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal this process gets when its parent dies
SHARED_MEMORY_DIR = "/dev/shm"  # where share_memory_() places the snapshot's storages
ASYNC_SAVE_SETTINGS = (False, True, "auto")
WRITER_NICENESS = 19  # the lowest CPU priority: on a busy host the writer takes the time training leaves idle


def available_host_bytes():
    """The kernel's estimate of the memory new allocations can take without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def snapshot_room_error(needed_bytes, ranks, shared_free_bytes, available_bytes, setting=True):
    """One line when this node cannot hold the async_save snapshots of its ranks (the planner's needed_bytes: they
    live in shared memory from the first save on), else None. setting: async_save's value (True or "auto")."""
    room = min(shared_free_bytes, available_bytes)
    if needed_bytes <= room:
        return None
    fix = ("set async_save=false (saves then stop training while they write), or " if setting is True else
           "so every rank saves synchronously (saves stop training while they write); to save in the background, ")
    return (f"async_save={str(setting).lower()} holds about {size_text(needed_bytes)} of host memory on this node "
            f"from the first save on (a snapshot of the checkpoint files of its {ranks} rank(s), in "
            f"{SHARED_MEMORY_DIR}), but {SHARED_MEMORY_DIR} has {size_text(shared_free_bytes)} free and the host "
            f"{size_text(available_bytes)} available: {fix}give the job more memory or a larger {SHARED_MEMORY_DIR} "
            f"(docker --shm-size, a memory-backed emptyDir), or spread the run over more nodes.")


def snapshot_shortfall(setting, needed_bytes, ranks):
    """snapshot_room_error of this host, before any process group: for async_save=true raised as a ConfigError (a
    config error: not restarted); for auto returned (None: room), for agreed_async_save."""
    error = snapshot_room_error(needed_bytes, ranks, shutil.disk_usage(SHARED_MEMORY_DIR).free,
                                available_host_bytes(), setting)
    if error and setting is True:
        raise ConfigError(error)
    return error


def agreed_async_save(shortfall):
    """async_save=auto's verdict, the same on every rank (one all-reduce: a checkpoint's ranks must save one way,
    complete_if_written is a collective): in the background where every node has room for its snapshots. Each
    rank without room says why, once per node."""
    room = torch.tensor([int(shortfall is None)], device=collectives.device())
    collectives.all_reduce(room, op=collectives.ReduceOp.MIN)
    if shortfall and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        say(f"trainer_pipe: warning: {shortfall}")
    return bool(room.item())


class HostSnapshot:
    """Host copies of the tensors each file holds, reused while a file's tensors keep their sizes."""

    def __init__(self, pinned):
        self.pinned, self.storages = pinned, {}
        self.pending = []  # [(host clone, tensor)] that copy() returned and BackgroundSave's copier has yet to fill

    def copy(self, name, state):
        """What DeepSpeed's clone_tensors_for_torch_save(state) returns before a synchronous torch.save (each tensor
        in its dicts, lists and tuples cloned into a storage of its own), with the clones in this snapshot's host
        storages: torch.save writes the same bytes from it once `pending` is copied. DeepSpeed skips its own clone
        while snapshots are taken (BackgroundSave.snapshots), so each tensor is copied once."""
        tensors = itertools.count()  # the key of each tensor's buffer in the file's: its place in state

        def cloned(item):
            if torch.is_tensor(item):
                return self._host_clone((name, next(tensors)), item)
            if isinstance(item, list):
                return [cloned(value) for value in item]
            if isinstance(item, tuple):
                return tuple(cloned(value) for value in item)
            if isinstance(item, dict):
                return type(item)({key: cloned(value) for key, value in item.items()})
            return item
        return cloned(state)

    def release(self):
        """Give the host buffers back (shared memory; unpinned first under CUDA)."""
        if self.pinned:
            for host in self.storages.values():
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        self.storages.clear()

    def _host_clone(self, key, tensor):
        like = torch.empty_like(tensor, device="meta")  # clone's layout: the strides empty_like keeps
        host = self.storages.get(key)
        if host is None or host.nbytes() != like.untyped_storage().nbytes():
            host = torch.UntypedStorage(like.untyped_storage().nbytes()).share_memory_()
            if self.pinned:  # device-to-host copies at full speed, without a staging copy
                torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes(), 0)
            self.storages[key] = host
        clone = torch.empty(0, dtype=tensor.dtype).set_(host, 0, like.size(), like.stride())
        self.pending.append((clone, tensor.detach()))
        return clone


class CheckpointWriteError(RuntimeError):
    """A checkpoint file that could not be written; the message names it and the error, with its type."""

    def __init__(self, path, error):
        super().__init__(f"{path}: {type(error).__name__}: {error}")


def write_job(job):
    """[(path, state, zip serialization)] written, fsynced and hashed: {path: checksum}."""
    written = {}
    for path, state, zip_serialization in job:
        try:
            torch.save(state, path, _use_new_zipfile_serialization=zip_serialization)
            written[path] = durable_checksum(path)
        except Exception as error:  # torch.save's zip writer raises RuntimeError on a full disk, EIO, a missing dir
            raise CheckpointWriteError(path, error) from error
    return written


def write_files(jobs, results):
    """The writer process: each job's ("written", {path: checksum}) back (write_job), or ("failed", what, whether
    the disk is full), whatever the error's type."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the rank (a restart rewrites the tag)
    os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICENESS)
    while True:
        try:
            outcome = ("written", write_job(jobs.recv()))
        except EOFError:  # the rank closed its end: it is exiting
            return
        except Exception as error:
            text = str(error) if isinstance(error, CheckpointWriteError) else f"{type(error).__name__}: {error}"
            outcome = ("failed", text, is_disk_full(error))
        results.send(outcome)


def death_of(process):
    """What ended a process that is gone, for a line."""
    process.join()
    code = process.exitcode
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}" + (" (the kernel's OOM killer, or a person)"
                                                               if -code == signal.SIGKILL else "")
    else:
        how = f"exited with code {code}"
    return f"its writer process (pid {process.pid}) {how}"


# What each rank's write of the checkpoint in flight came to, as agreed by every rank (one all-reduce of a flag each,
# the maximum over the ranks): a failure on any rank decides for all.
IN_FLIGHT, FAILED, DISK_FULL, SNAPSHOT_LOST = range(4)


class BackgroundSave:
    """A save's snapshot is copied by a thread of its own (torch's copies release the GIL; under CUDA on a side
    stream into pinned memory) while the next step's forward and backward run, which only read the tensors: the
    optimizer step is what changes them, so it waits for the copy (instruction_started), as do the next save, a
    preemption and the end; the copier then hands the files to the writer process. It listens to the engine's
    instructions (engines/instruction_listeners.py), which its owner attaches it to.

    A write that fails on any rank (any error, or its writer process dead: polled with the result) never hangs the
    run: after the step where the ranks find it (one all-reduce), a full disk stops every rank with the disk-full
    line (DiskFullError, not restarted); otherwise every rank writes the checkpoint again from its snapshot, which
    nothing has changed since (the next save waits for this one), in the trainer process, completes it, and saves
    synchronously from then on (`synchronous`), saying so in one line: the run keeps its checkpoint and goes on, where
    a restart would replay every step since the last complete one."""

    def __init__(self):
        pinned = get_accelerator().device_name() == "cuda"
        self.snapshot, self.copy_stream = HostSnapshot(pinned), torch.cuda.Stream() if pinned else None
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-copier")
        self.writer = self.copying = self.completion = self.outcome = self.tag_dir = self.files = None
        self.needed_bytes = None
        self.synchronous = False  # set once a write failed: every later save is written by the trainer itself

    def instruction_started(self, instruction):
        if instruction is OptimizerStep:  # the handlers are keyed by instruction class
            self.copied()

    def instruction_ended(self, instruction, started):
        pass

    @contextlib.contextmanager
    def snapshots(self, checkpoint_engine):
        """Yields the [(path, host copy, zip serialization)] of every file the checkpoint engine is asked to write
        inside the block, instead of writing it."""
        save, preserves_storage_sharing, files = checkpoint_engine.save, checkpoint_engine.preserves_storage_sharing, []

        def snapshot(state_dict, path):  # keyed by the file's name, which every save's tag directory repeats
            host_copy = self.snapshot.copy(os.path.basename(path), state_dict)
            files.append((path, host_copy, checkpoint_engine.zipfile_serialization))
        checkpoint_engine.save = snapshot
        checkpoint_engine.preserves_storage_sharing = lambda: False  # DeepSpeed's clone: the snapshot is one
        try:
            yield files
        finally:
            checkpoint_engine.save, checkpoint_engine.preserves_storage_sharing = save, preserves_storage_sharing

    def submit(self, files, tag_dir, completion, needed_bytes):
        """Write `files` of tag_dir in the background; completion({path: checksum}) (collective) once every rank's
        are. needed_bytes: what the checkpoint takes on disk, for the line a full disk gives."""
        if self.writer is None:
            context = torch.multiprocessing.get_context("spawn")
            job_reader, self.jobs = context.Pipe(duplex=False)
            self.results, result_writer = context.Pipe(duplex=False)
            self.writer = context.Process(target=write_files, args=(job_reader, result_writer), daemon=True,
                                          name="checkpoint-writer")
            self.writer.start()
            job_reader.close(), result_writer.close()  # the writer's ends: its death then ends their pipes here
        copies, self.snapshot.pending = self.snapshot.pending, []
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream())  # after the kernels that wrote the weights
        self.copying = self.copier.submit(self._copy_and_hand_over, copies, files)
        self.completion, self.outcome, self.tag_dir, self.files = completion, None, tag_dir, files
        self.needed_bytes = needed_bytes

    def _copy_and_hand_over(self, copies, files):
        with torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext():
            for clone, tensor in copies:
                clone.copy_(tensor, non_blocking=self.copy_stream is not None)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # landed, before `copies` lets the device tensors go
        try:
            self.jobs.send(files)
        except OSError:  # the writer is gone (its end of the pipe closed): _poll finds it dead
            pass

    def copied(self):
        """Block until the snapshot in flight is whole: before anything changes the tensors it copies. A copy that
        failed is this rank's outcome, for every rank to agree on after the step (raising here, inside the step,
        would leave the peers waiting on this rank)."""
        if self.copying is not None:
            copying, self.copying = self.copying, None
            if (error := copying.exception()) is not None:
                self.outcome = ("lost", f"copying the snapshot failed: {type(error).__name__}: {error}", False)

    def complete_if_written(self):
        """Collective, after each step: complete the checkpoint in flight if every rank's writer is done (see the
        class for a failed one). Returns its tag directory if it did, else None."""
        if self.completion is None:
            return None
        return self._settle(self._agreed(self._poll(block=False)))

    def wait(self):
        """Collective: wait for the checkpoint in flight and complete it (the next save, a preemption, the end)."""
        self.copied()
        if self.completion is not None:
            self._settle(self._agreed(self._poll(block=True)))

    def _poll(self, block):
        """This rank's outcome of the write in flight, once known: the writer's answer, or its death."""
        if self.copying is not None and self.copying.done():  # a step without an optimizer step did not ask
            self.copied()
        if self.outcome is None and self.copying is None:  # the job is with the writer
            ready = multiprocessing.connection.wait([self.results, self.writer.sentinel], None if block else 0)
            if self.results in ready:
                with contextlib.suppress(EOFError):  # its end closed: it died
                    self.outcome = self.results.recv()
            if self.outcome is None and ready:
                self.outcome = ("failed", death_of(self.writer), False)
        return self.outcome

    def _agreed(self, outcome):
        """Every rank's view of the write, after one all-reduce: flags indexed by IN_FLIGHT ... SNAPSHOT_LOST."""
        kind = outcome[0] if outcome else None
        flags = torch.tensor([kind is None, kind == "failed", kind == "failed" and outcome[2], kind == "lost"],
                             dtype=torch.float32, device=collectives.device())
        collectives.all_reduce(flags, op=collectives.ReduceOp.MAX)
        return [bool(flag) for flag in flags.tolist()]

    def _settle(self, agreed):
        if agreed[DISK_FULL] or agreed[SNAPSHOT_LOST] or not agreed[IN_FLIGHT] and agreed[FAILED]:
            return self._fail()
        if agreed[IN_FLIGHT]:
            return None
        (_, written), completion, tag_dir = self.outcome, self.completion, self.tag_dir
        self.completion = self.outcome = self.tag_dir = self.files = None
        completion(written)
        return tag_dir

    def _fail(self):
        """Every rank, together: the write of the checkpoint in flight failed on one of them."""
        tag_dir = self.tag_dir
        outcomes = [None] * dist.get_world_size()
        collectives.all_gather_object(outcomes, self.outcome if self.outcome and self.outcome[0] != "written" else None)
        failed = {rank: outcome for rank, outcome in enumerate(outcomes) if outcome is not None}
        if any(disk_full for _, _, disk_full in failed.values()):
            output_dir = os.path.dirname(tag_dir)
            raise DiskFullError(disk_full_message(output_dir, os.path.basename(tag_dir), self.needed_bytes,
                                                  free_bytes(output_dir)), every_rank=True)
        causes = "; ".join(f"on rank {rank}: {text}" for rank, (_, text, _) in failed.items())
        if any(kind == "lost" for kind, _, _ in failed.values()):
            raise RuntimeError(f"async_save: the snapshot of {tag_dir} was lost {causes}; the run stops for a "
                               f"restart from the last complete checkpoint")
        if dist.get_rank() == 0:
            say(f"trainer_pipe: warning: async_save: the background write of {tag_dir} failed {causes}; every rank "
                f"writes it again from its snapshot, and saves synchronously from now on")
            begin_change(tag_dir, "save")  # again: the failed write may have taken the directory or its marker
        collectives.barrier()
        with disk_full_is_one_line(os.path.dirname(tag_dir), os.path.basename(tag_dir), self.needed_bytes):
            written = write_job(self.files)
        completion = self.completion
        self.completion = self.outcome = self.tag_dir = self.files = None
        self._give_up()
        completion(written)
        return tag_dir

    def _give_up(self):
        """Every later save is synchronous: the writer process (idle or dead) and the snapshot's memory go."""
        self.synchronous = True
        self.writer.kill()
        self.writer.join()
        self.jobs.close(), self.results.close()
        self.snapshot.release()
