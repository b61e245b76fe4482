"""Optimizer offload (offload_optimizer=cpu: ZeRO-1's fp32 partition and Adam moments in host memory, DeepSpeed's
CPU Adam): same losses as the device optimizer under pipeline, data and tensor parallelism; bf16 saves, resumes
and exports; bad values are refused before any process starts."""
import os

import pytest

from tests.launch import (REFERENCE, check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics,
                          run_in_process)
from training.config import ConfigError


def test_fp32_offload_matches_device_optimizer_on_2_stages_x_2_data_parallel(demo_model, reference_run, tmp_path):
    run = dict(REFERENCE, max_steps=6, save_steps=0, zero_stage=1, offload_optimizer="cpu")
    check_ok(launch_trainer(4, demo_overrides(demo_model, tmp_path / "run", **run)))
    assert per_step_losses(tmp_path / "run") == pytest.approx(per_step_losses(reference_run)[:6], abs=1e-4)


def test_bf16_offload_on_2_stages_resumes_and_exports(demo_model, tmp_path):
    run = dict(max_steps=5, save_steps=3, save_total_limit=5, logging_steps=1, eval_file="null", precision="bf16",
               zero_stage=1, learning_rate=1e-3, warmup_steps=2, num_stages=2, offload_optimizer="cpu")
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "full", export_hf="true", **run)))
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "resumed",
                                              resume=str(tmp_path / "full" / "global_step3"), **run)))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed if "loss" in r] == [4, 5]
    assert [r["loss"] for r in resumed if "loss" in r] == pytest.approx(per_step_losses(tmp_path / "full")[3:],
                                                                         rel=1e-3)
    assert os.path.isfile(tmp_path / "full" / "hf" / "model.safetensors")
