"""The GPU check on two GPUs (bash scripts/gpu_check.sh): NCCL between pipeline stages and within tensor- and
context-parallel groups, and expert parallelism's all-to-alls, each against what the CPU suite proves over gloo, in
fp32 so that equal means equal."""
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


def test_expert_parallel_over_2_gpus_equals_the_experts_whole(demo_model, tmp_path, record_property):
    """tests/test_moe.py's demo Qwen3-MoE (the load-balancing loss on) on 2 data-parallel GPUs, its experts split
    over the two (expert_parallel_size=2: every token to its experts' GPU and back by NCCL all-to-all) against each
    GPU holding them all (tests/test_expert_parallel.py on CPU), ZeRO-1; and the experts' saved shards resume."""
    from tests.test_moe import demo_model_of
    from tests.tiny_models import MOE_CONFIGS
    model = dict(demo_model, **demo_model_of(MOE_CONFIGS["qwen3_moe"](), demo_model, tmp_path / "model"))
    losses = {size: launched_losses(model, tmp_path / f"ep{size}", 2, zero_stage=1, save_steps=4,
                                    expert_parallel_size=size) for size in (1, 2)}
    difference = loss_difference(losses[2], losses[1])
    assert difference <= 1e-5, losses
    resumed = tmp_path / "resumed"
    check_ok(launch_trainer(2, demo_overrides(model, resumed, **dict(
        SINGLE_PROCESS, zero_stage=1, expert_parallel_size=2, resume=tmp_path / "ep2" / "global_step4")),
        accelerator="cuda"))
    resume_difference = loss_difference(per_step_losses(resumed), losses[2][4:])
    assert resume_difference <= 1e-5, resume_difference
    record_property("figure", f"8 fp32 steps: max |loss difference| {difference:.1e} (allowed 1e-5); resumed from "
                              f"the experts' shards at step 4: {resume_difference:.1e}")
