"""scripts/gpu_check.sh on machines without a usable GPU: one whose GPU torch cannot use fails in one line before any
check runs (a stand-in nvidia-smi on PATH lists a GPU to this CPU build of torch); one without a GPU skips every
check and passes. And what the mixture-of-experts checks run (tests/gpu/moe_checks.py), here in fp32, where the
trainer's evaluation is transformers' loss."""
import glob
import os
import subprocess

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(torch.version.cuda is not None or bool(glob.glob("/dev/nvidia[0-9]*")),
                                reason="needs a CPU build of torch on a machine without a GPU")


def gpu_check(tmp_path, nvidia_smi):
    """bash scripts/gpu_check.sh with `nvidia_smi` (a shell script's body) as the nvidia-smi on PATH."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp_path))
    return subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_gpu_that_torch_cannot_use_fails_the_check(tmp_path):
    result = gpu_check(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-8a1f0c3e)"')
    assert result.returncode == 1
    assert result.stdout == ""  # no check ran
    assert result.stderr.splitlines() == [
        f"gpu_check: FAIL: nvidia-smi lists 1 GPU(s), but torch {torch.__version__} (a CPU build) cannot use it: "
        f"Torch not compiled with CUDA enabled; install the CUDA build of torch for this driver (README, 'Install on "
        f"a GPU cluster')"]


@pytest.mark.slow
def test_without_a_gpu_every_check_is_skipped(tmp_path):
    result = gpu_check(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA '
                                 'driver."; exit 9')
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no CUDA device found (torch.cuda.is_available() is false): every check skipped" in result.stdout
    assert " passed" not in result.stdout and " failed" not in result.stdout and " error" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_moe_checks_eval_equals_transformers_in_fp32_on_the_cpu(demo_model, tmp_path, family):
    """tests/gpu/test_moe_gpu.py's evaluation check, as it runs there, on this CPU in fp32: within 1e-5; the experts
    through torch's grouped GEMM."""
    from tests.gpu import moe_checks
    model = moe_checks.converted(family, tmp_path / "model", torch.float32)
    rows = moe_checks.write_eval_rows(tmp_path / "eval.jsonl", moe_checks.family_config(family).vocab_size)
    ours = moe_checks.trainer_eval_loss(demo_model, model, tmp_path, "fp32", "cpu")
    assert ours == pytest.approx(moe_checks.transformers_eval_loss(model["hf"], rows, "cpu", torch.float32), abs=1e-5)
    assert moe_checks.expert_path(family, "cpu", torch.float32) == "grouped_mm"
    assert moe_checks.expert_path(family, "cpu", torch.float16) == "one GEMM per expert"
