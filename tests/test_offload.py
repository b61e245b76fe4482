"""Optimizer offload (offload_optimizer=cpu: ZeRO-1's fp32 partition and Adam moments in host memory, DeepSpeed's
CPU Adam): same losses as the device optimizer under pipeline, data and tensor parallelism; bf16 saves, resumes
and exports; bad values are refused before any process starts."""
import os
import re

import pytest

from tests.launch import (REFERENCE, SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, per_step_losses,
                          read_metrics, run_in_process)

# bf16 losses of a resume on another layout against the run that never stopped: measured 9.3e-5 at most
# (docs/checkpoints.md), allowed 5x that.
BF16_RESUME_TOLERANCE = 5e-4


@pytest.mark.slow
def test_fp32_offload_matches_the_device_optimizer(demo_model, reference_run, tmp_path):
    """2 stages x 2 data-parallel: offload against the reference run (ZeRO-1 on the device), 8 steps."""
    run = dict(REFERENCE, save_steps=0, eval_file="null", zero_stage=1, offload_optimizer="cpu")
    check_ok(launch_trainer(4, demo_overrides(demo_model, tmp_path / "cpu", **run)))
    assert per_step_losses(tmp_path / "cpu") == pytest.approx(per_step_losses(reference_run), abs=1e-4)


@pytest.mark.slow
def test_fp32_offload_matches_the_device_optimizer_under_tensor_parallelism(demo_model, single_process_run, tmp_path):
    """1 stage x tensor parallel 2, ZeRO-1 offloaded, against 1 process with the device optimizer, 8 steps."""
    run = dict(SINGLE_PROCESS, eval_file="null", zero_stage=1, offload_optimizer="cpu", tensor_parallel_size=2)
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "cpu", **run)))
    assert per_step_losses(tmp_path / "cpu") == pytest.approx(per_step_losses(single_process_run), abs=1e-4)


@pytest.mark.slow
def test_bf16_offload_on_2_stages_resumes_on_another_layout_and_exports(demo_model, tmp_path):
    """bf16 with offload on 2 stages, resumed from step 3 on 1 stage x 2 data-parallel without offload (the same
    global batch): the fp32 master weights and moments carry over; the losses differ from the run that never stopped
    only by bf16's other rounding of the other reduction order."""
    run = dict(max_steps=5, save_steps=3, save_total_limit=5, logging_steps=1, eval_file="null", precision="bf16",
               zero_stage=1, learning_rate=1e-3, warmup_steps=2, num_stages=2, offload_optimizer="cpu")
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "full", export_hf="true", **run)))
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "resumed", **{
        **run, "num_stages": 1, "offload_optimizer": "none", "gradient_accumulation_steps": 2,
        "resume": str(tmp_path / "full" / "global_step3")})))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed if "loss" in r] == [4, 5]
    assert [r["loss"] for r in resumed if "loss" in r] == pytest.approx(per_step_losses(tmp_path / "full")[3:],
                                                                         abs=BF16_RESUME_TOLERANCE)
    assert os.path.isfile(tmp_path / "full" / "hf" / "model.safetensors")


@pytest.mark.parametrize("overrides,message", [
    ({"offload_optimizer": "nvme"}, "offload_optimizer 'nvme' is not one of ('none', 'cpu')"),
    ({"offload_optimizer": "disk"}, "offload_optimizer 'disk' is not one of ('none', 'cpu')"),
    ({"offload_optimizer": "cpu", "zero_stage": 0}, "offload_optimizer=cpu needs ZeRO's partitioned optimizer: set "
                                                    "zero_stage=1 (got zero_stage=0)"),
    ({"offload_optimizer": "cpu", "zero_stage": 1, "nan_policy": "skip"}, "use nan_policy=stop with "
                                                                           "offload_optimizer=cpu"),
], ids=["nvme", "unknown", "zero0", "nan_skip"])
def test_bad_offload_config_is_refused_before_any_work(demo_model, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), 2)
    assert not (tmp_path / "run").exists()
