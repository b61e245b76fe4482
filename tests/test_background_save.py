"""async_save's snapshot and writer (checkpoints/background_save.py): in one process, and on 2 ranks whose writers
fail (a full disk, a missing directory, a writer killed mid-write); tests/test_supervision.py and
tests/test_reliability.py do both in real runs."""
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.pipe import schedule

import collectives
from checkpoints.background_save import BackgroundSave
from checkpoints.disk_space import DiskFullError
from checkpoints.files import COMPLETE_MARKER, LATEST, is_disk_full, write_text_atomic
from checkpoints.integrity import file_checksum
from engines.instruction_listeners import add_instruction_listener
from tests.distributed import free_port, spawn

NEEDED_BYTES = 2**20  # what the test's checkpoint is said to take, for the full disk's line


@pytest.fixture
def one_rank_group():
    """A process group of this process alone: BackgroundSave's completion is agreed by an all-reduce."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_async_saves_write_deepspeeds_clones_from_reused_host_memory_copied_before_the_next_optimizer_step(
        tmp_path, one_rank_group):
    """A snapshot takes the place of the clone DeepSpeed makes before a synchronous torch.save (it is told the engine
    does not preserve storage sharing): the writer process writes the synchronous save's bytes, also for a weight
    that is a view into a larger flat buffer (ZeRO's). Its copy runs on a thread while the next step's forward and
    backward run; the optimizer step, which changes the weights, waits for it (here the copier is held until that
    step starts). Each save's files (the same names in another tag directory) are copied into the last save's host
    buffers: a run holds one snapshot (what the planner counts), not one more per save. The writer process runs at
    the lowest CPU priority."""
    flat, start_copy = torch.randn(40), threading.Event()

    class Engine:  # what BackgroundSave listens to: the handlers a pipeline engine runs its instructions with
        _INSTRUCTION_MAP = {schedule.OptimizerStep: lambda engine: flat.add_(1)}

    class CopyStarter:  # heard first at each instruction: only then may the held copier start
        def instruction_started(self, instruction):
            start_copy.set()

        def instruction_ended(self, instruction, started):
            pass
    engine, checkpoint_engine = Engine(), SimpleNamespace(save=None, zipfile_serialization=True,
                                                          preserves_storage_sharing=lambda: True)
    add_instruction_listener(engine, CopyStarter())
    background = BackgroundSave()
    add_instruction_listener(engine, background)
    copy = background._copy_and_hand_over
    background._copy_and_hand_over = lambda *args: (start_copy.wait(), copy(*args))
    layer, buffers = {"weight": flat[4:20].view(4, 4), "bias": flat[20:24], "step": 3}, []
    for step in (2, 4):
        tag_dir, written = tmp_path / f"global_step{step}", {}
        tag_dir.mkdir()
        sync = tmp_path / "sync" / f"global_step{step}" / "layer_01-model_states.pt"  # torch.save names the archive
        sync.parent.mkdir(parents=True)  # after the file: the same name as the asynchronous one
        torch.save(clone_tensors_for_torch_save(layer), sync)
        with background.snapshots(checkpoint_engine) as files:
            assert checkpoint_engine.preserves_storage_sharing() is False
            checkpoint_engine.save(layer, str(tag_dir / "layer_01-model_states.pt"))
        assert checkpoint_engine.preserves_storage_sharing() is True
        background.submit(files, str(tag_dir), completion=written.update, needed_bytes=NEEDED_BYTES)
        engine._INSTRUCTION_MAP[schedule.OptimizerStep](engine)  # the next step's: training goes on
        background.wait()
        start_copy.clear()
        assert (tag_dir / "layer_01-model_states.pt").read_bytes() == sync.read_bytes(), step
        assert written == {str(tag_dir / "layer_01-model_states.pt"): file_checksum(str(sync))}
        buffers.append({k: t.untyped_storage().data_ptr() for k, t in files[0][1].items() if torch.is_tensor(t)})
    assert buffers[0] == buffers[1] and len(background.snapshot.storages) == 2
    assert os.getpriority(os.PRIO_PROCESS, background.writer.pid) == 19  # yields the CPU to training



def test_a_full_disk_is_recognised_in_the_text_of_any_error():
    """torch.save's writers report ENOSPC as RuntimeErrors: its zip writer's short write, its plain writer's text, an
    OSError's text carried inside another error; EIO is not a full disk."""
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"))
    assert is_disk_full(RuntimeError("write(): fd 3 failed with No space left on device"))
    assert is_disk_full(RuntimeError("[Errno 28] No space left on device: '/out/global_step4/layer_01.pt'"))
    assert is_disk_full(OSError(28, "No space left on device"))
    assert not is_disk_full(RuntimeError("[Errno 5] Input/output error"))
    assert not is_disk_full(RuntimeError("Parent directory /out/global_step4 does not exist."))


def layer_state(rank):
    return {"weight": torch.arange(64 * 64, dtype=torch.float32).view(64, 64) + rank, "step": 4}


def _write_with_a_fault(rank, fault, out):
    """Two saves on 2 ranks through BackgroundSave (its writer processes started by the first); the second meets
    `fault` (on rank 1, or on both: the missing directory) and each rank records what came of it."""
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        sys.stdout = open(os.path.join(out, "rank0.out"), "w", buffering=1)
    checkpoint_engine = SimpleNamespace(save=None, zipfile_serialization=True, preserves_storage_sharing=lambda: True)
    background, written = BackgroundSave(), {}

    def completion(tag_dir):
        def complete(files):  # what complete_checkpoint does that matters here: collective, then COMPLETE, latest
            written[tag_dir] = files
            collectives.barrier()
            if rank == 0:
                write_text_atomic(os.path.join(tag_dir, COMPLETE_MARKER), os.path.basename(tag_dir))
                write_text_atomic(os.path.join(out, LATEST), os.path.basename(tag_dir))
        return complete

    def save(step):
        tag_dir = os.path.join(out, f"global_step{step}")
        if rank == 0:
            os.makedirs(tag_dir)
        collectives.barrier()
        with background.snapshots(checkpoint_engine) as files:
            path = "/dev/full" if fault == "full_disk" and step == 4 and rank == 1 else \
                os.path.join(tag_dir, f"layer_0{rank}-model_states.pt")
            checkpoint_engine.save(layer_state(rank), path)
        if step == 4 and fault == "missing_directory":
            collectives.barrier()
            if rank == 0:
                shutil.rmtree(tag_dir)  # gone before either writer gets to it (a cleanup, a flapping mount)
            collectives.barrier()
        if step == 4 and fault == "killed_writer" and rank == 1:
            os.kill(background.writer.pid, signal.SIGSTOP)  # it cannot take the job before it is killed
        background.submit(files, tag_dir, completion(tag_dir), NEEDED_BYTES)
        return tag_dir

    save(2)
    background.wait()
    result = {"writer": background.writer.pid}
    started = time.monotonic()
    try:
        tag_dir = save(4)
        if fault == "killed_writer" and rank == 1:
            background.copied()  # the job is in the pipe
            os.kill(background.writer.pid, signal.SIGKILL)
        if fault == "killed_writer":
            background.wait()  # what the next save, a preemption or the end does
        else:  # after each step, as the loop does
            while background.complete_if_written() is None:
                time.sleep(0.05)
        result["completed"] = {os.path.relpath(path, tag_dir): checksum for path, checksum in written[tag_dir].items()}
    except DiskFullError as error:
        result["error"] = str(error)
    result.update(seconds=time.monotonic() - started, synchronous=background.synchronous)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def failing_write(fault, out):
    """_write_with_a_fault on 2 ranks, bounded: each rank's result."""
    spawn(_write_with_a_fault, 2, fault, str(out), timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_a_writer_meeting_a_full_disk_stops_every_rank_with_the_disk_full_line(tmp_path):
    """Rank 1's writer meets a full disk (/dev/full: torch.save's zip writer raises a RuntimeError): both ranks stop
    together at the next step with the full disk's line, not restarted (trainer_pipe exits 74); `latest` and the
    previous checkpoint are untouched, the new one never complete."""
    ranks = failing_write("full_disk", tmp_path)
    line = (rf"checkpoint global_step4 does not fit on the disk of '{tmp_path}': [\d.]+ [MG]iB free, a checkpoint "
            rf"needs about 1.0 MiB; free space there \(or lower save_total_limit, or choose an output_dir on a larger "
            rf"disk\); resume=auto continues from the last complete checkpoint, {tmp_path}/global_step2\.")
    for rank, result in enumerate(ranks):
        assert re.fullmatch(line, result.get("error", "")), (rank, result)
        assert result["seconds"] < 60, result
    assert (tmp_path / LATEST).read_text() == "global_step2" and (tmp_path / "global_step2" / COMPLETE_MARKER).exists()
    assert not (tmp_path / "global_step4" / COMPLETE_MARKER).exists()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing_directory", "killed_writer"])
def test_a_failed_or_dead_writer_is_found_and_the_checkpoint_written_again_by_the_trainer(tmp_path, fault):
    """Both writers meet a missing directory (a RuntimeError from torch.save's zip writer, not an OSError), found
    after the step they fail in; or rank 1's writer is SIGKILLed before it writes (the OOM killer), which the
    blocking wait of the next save, a preemption or the end finds: every rank agrees, rank 0 says so in one line,
    and each rank writes the checkpoint again from its snapshot, the synchronous save's bytes, and completes it;
    later saves are synchronous. The old writer hung forever (its error was not an OSError, or it posted nothing)."""
    ranks = failing_write(fault, tmp_path)
    tag = tmp_path / "global_step4"
    if fault == "missing_directory":
        cause = "; ".join(f"on rank {rank}: {tag}/layer_0{rank}-model_states.pt: RuntimeError: Parent directory "
                          f"{tag} does not exist." for rank in (0, 1))
    else:
        cause = (f"on rank 1: its writer process (pid {ranks[1]['writer']}) was killed by SIGKILL (the kernel's OOM "
                 f"killer, or a person)")
    assert (tmp_path / "rank0.out").read_text().splitlines() == [
        f"trainer_pipe: warning: async_save: the background write of {tag} failed {cause}; every rank writes it "
        f"again from its snapshot, and saves synchronously from now on"]
    for rank, result in enumerate(ranks):
        name = f"layer_0{rank}-model_states.pt"
        sync = tmp_path / "sync" / name  # torch.save names the archive after the file
        sync.parent.mkdir(exist_ok=True)
        torch.save(clone_tensors_for_torch_save(layer_state(rank)), sync)
        assert (tag / name).read_bytes() == sync.read_bytes(), rank
        assert result["completed"] == {name: file_checksum(str(tag / name))}, (rank, result)
        assert result["synchronous"] and result["seconds"] < 60, (rank, result)
    assert (tmp_path / LATEST).read_text() == "global_step4" and (tag / COMPLETE_MARKER).exists()
