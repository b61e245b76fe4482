"""Optimizer offload (offload_optimizer=cpu: ZeRO-1's fp32 partition and Adam moments in host memory, DeepSpeed's
CPU Adam): same losses as the device optimizer under pipeline, data and tensor parallelism; bf16 saves, resumes
and exports; bad values are refused before any process starts."""
import json
import os
import re
import shutil

import pytest
import torch

from tests.launch import (REFERENCE, SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, per_step_losses,
                          read_metrics, run_in_process, tensors_of)

# bf16 losses of a resume on another layout against the run that never stopped: measured 9.3e-5 at most
# (docs/checkpoints.md), allowed 5x that.
BF16_RESUME_TOLERANCE = 5e-4


@pytest.mark.slow
def test_fp32_offload_matches_the_device_optimizer_and_resumes_a_kill_exactly(demo_model, reference_run, tmp_path):
    """2 stages x 2 data-parallel: offload against the reference run (ZeRO-1 on the device), 8 steps. Its step-4
    checkpoint resumed in another directory, where rank 3 is SIGKILLed at step 7 (latest: step 6) and the run
    resumed again: the losses and the final weights and offloaded optimizer state are the straight run's, bit for
    bit."""
    straight, out = tmp_path / "cpu", tmp_path / "killed"
    run = dict(REFERENCE, eval_file="null", export_hf="false", zero_stage=1, offload_optimizer="cpu")
    # it saves only the checkpoints compared: step 4 (resumed) and step 8 (the resumed run's last)
    check_ok(launch_trainer(4, demo_overrides(demo_model, straight, **dict(run, save_steps=4))))
    assert per_step_losses(straight) == pytest.approx(per_step_losses(reference_run), abs=1e-4)
    shutil.copytree(straight / "global_step4", out / "global_step4")  # a run that stopped after its step-4 save
    (out / "latest").write_text("global_step4")
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in (straight / "metrics.jsonl").read_text()
                                               .splitlines() if json.loads(line)["step"] <= 4))
    overrides = demo_overrides(demo_model, out, **run, resume="auto")
    killed = launch_trainer(4, overrides, script=os.path.join("tests", "fault_injection.py"),
                            env={"FAULT": "sigkill:3:7"})
    assert killed.returncode != 0 and "FAULT sigkill AT 7" in killed.stdout, killed.stderr[-3000:]
    assert (out / "latest").read_text() == "global_step6"
    assert f"resumed from {out}/global_step6" in check_ok(launch_trainer(4, overrides)).stdout
    assert per_step_losses(out) == per_step_losses(straight)
    names = sorted(path.name for path in (straight / "global_step8").iterdir() if path.name.startswith("layer_"))
    assert any(name.endswith("optim_states.pt") for name in names)
    for name in names:
        expected, got = (tensors_of(torch.load(run_dir / "global_step8" / name, weights_only=True))
                         for run_dir in (straight, out))
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name


def cpu_adam_resumes_bit_for_bit(steps_before, replay):
    """DeepSpeed's CPU Adam: 3 steps after `steps_before` on a fresh optimizer given the state (moments, step) of one
    that took them, against that one going on: equal weights?"""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from deepspeed_internals.access import replay_cpu_adam_steps
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, generator=generator) for _ in range(steps_before + 3)]
    straight_weight = torch.nn.Parameter(torch.randn(64, generator=generator))
    straight = DeepSpeedCPUAdam([straight_weight], lr=1e-2, betas=(0.9, 0.95))
    for grad in grads[:steps_before]:
        straight_weight.grad = grad
        straight.step()
    resumed_weight = torch.nn.Parameter(straight_weight.detach().clone())
    resumed = DeepSpeedCPUAdam([resumed_weight], lr=1e-2, betas=(0.9, 0.95))
    resumed.state[resumed_weight] = {key: value.clone() if torch.is_tensor(value) else value
                                     for key, value in straight.state[straight_weight].items()}
    if replay:
        replay_cpu_adam_steps(resumed, steps_before)
    for grad in grads[steps_before:]:
        straight_weight.grad, resumed_weight.grad = grad, grad.clone()
        straight.step()
        resumed.step()
    return torch.equal(straight_weight, resumed_weight)


@pytest.mark.slow  # DeepSpeed's CPU Adam is JIT-built on its first use
def test_cpu_adam_resumes_bit_for_bit_once_its_step_bookkeeping_is_replayed():
    """Its C++ state takes beta^t as a product, step by step, and a resumed step count as pow: after 5-7 steps they
    differ in the last bits (and the weights with them) unless the resume replays the products; past the step where
    beta^t is below 2**-30 (406 for 0.95) the replay stops, and the weights stay equal."""
    assert not all(cpu_adam_resumes_bit_for_bit(steps, replay=False) for steps in (5, 6, 7))
    assert all(cpu_adam_resumes_bit_for_bit(steps, replay=True) for steps in (5, 6, 7, 500))


@pytest.mark.slow
def test_fp32_offload_matches_the_device_optimizer_under_tensor_parallelism(demo_model, single_process_run, tmp_path):
    """1 stage x tensor parallel 2, ZeRO-1 offloaded, against 1 process with the device optimizer, 8 steps."""
    run = dict(SINGLE_PROCESS, eval_file="null", export_hf="false", zero_stage=1, offload_optimizer="cpu",
               tensor_parallel_size=2)
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
        **run, "num_stages": 1, "offload_optimizer": "none", "gradient_accumulation_steps": 2, "export_hf": "false",
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
