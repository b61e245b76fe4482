"""async_save's snapshot and writer in one process (checkpoints/background_save.py); tests/test_supervision.py
kills a real run mid-write."""
import os
import threading
from types import SimpleNamespace

import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.pipe import schedule

from checkpoints.background_save import BackgroundSave
from checkpoints.integrity import file_checksum
from engines.instruction_listeners import add_instruction_listener


def test_async_saves_write_deepspeeds_clones_from_reused_host_memory_copied_before_the_next_optimizer_step(tmp_path):
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
        background.submit(files, str(tag_dir), completion=written.update)
        engine._INSTRUCTION_MAP[schedule.OptimizerStep](engine)  # the next step's: training goes on
        background.wait()
        start_copy.clear()
        assert (tag_dir / "layer_01-model_states.pt").read_bytes() == sync.read_bytes(), step
        assert written == {str(tag_dir / "layer_01-model_states.pt"): file_checksum(str(sync))}
        buffers.append({k: t.untyped_storage().data_ptr() for k, t in files[0][1].items() if torch.is_tensor(t)})
    assert buffers[0] == buffers[1] and len(background.snapshot.storages) == 2
    assert os.getpriority(os.PRIO_PROCESS, background.writer.pid) == 19  # yields the CPU to training
