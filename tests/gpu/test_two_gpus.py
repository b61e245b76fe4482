"""The GPU check on two GPUs (bash scripts/gpu_check.sh): NCCL between pipeline stages and within tensor- and
context-parallel groups, each against what the CPU suite proves over gloo, in fp32 so that equal means equal."""
import pytest
import torch

from tests.gpu.test_one_gpu import loss_difference
from tests.launch import SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, per_step_losses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason=f"needs 2 GPUs, {torch.cuda.device_count()} found")]


def launched_losses(demo_model, out, num_gpus, **layout):
    """The per-step losses of tests/launch.py's SINGLE_PROCESS steps (8 fp32 steps of 8 sequences) on this layout."""
    check_ok(launch_trainer(num_gpus, demo_overrides(demo_model, out, **dict(SINGLE_PROCESS, **layout)),
                            accelerator="cuda"))
    losses = per_step_losses(out)
    assert len(losses) == 8, losses
    return losses


@pytest.fixture(scope="module")
def one_gpu_losses(demo_model, tmp_path_factory):
    """What the tensor- and context-parallel runs must equal, as the CPU suite's single_process_run."""
    return launched_losses(demo_model, tmp_path_factory.mktemp("one_gpu") / "run", 1)


def test_two_stages_1f1b_equals_zero_bubble(demo_model, tmp_path, record_property):
    """The zero-bubble schedule's split backward against DeepSpeed's 1F1B (tests/test_schedule.py on CPU)."""
    losses = {schedule: launched_losses(demo_model, tmp_path / schedule, 2, num_stages=2, pipeline_schedule=schedule)
              for schedule in ("1f1b", "zero_bubble")}
    difference = loss_difference(losses["zero_bubble"], losses["1f1b"])
    assert difference <= 1e-5, losses
    record_property("figure", f"8 fp32 steps: max |loss difference| {difference:.1e} (allowed 1e-5)")


@pytest.mark.parametrize("split", ["tensor_parallel_size", "context_parallel_size"])
def test_split_over_2_gpus_equals_1_gpu(demo_model, one_gpu_losses, tmp_path, record_property, split):
    """tests/test_tensor_parallel.py's and tests/test_context_parallel.py's training parity, over NCCL."""
    difference = loss_difference(launched_losses(demo_model, tmp_path / "run", 2, **{split: 2}), one_gpu_losses)
    assert difference <= 1e-4, difference
    record_property("figure", f"{split}=2, 8 fp32 steps: max |loss difference| {difference:.1e} (allowed 1e-4)")
