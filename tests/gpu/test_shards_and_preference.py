"""The GPU check of the pre-training and preference paths (bash scripts/gpu_check.sh): token shards written by
prepare_data.py and DPO, each trained on one GPU as a user launches it and held to the CPU suite's oracle in fp32,
so that equal means equal (transformers' loss on the samples read; TRL's DPOTrainer, run on the CPU); and DPO in
bf16, whose first step is ln 2 however it rounds, since the policy starts as its own reference."""
import math

import pytest
import torch

import tests.test_preference as test_preference
from data.indexed import open_blend
from data.shard_files import parse_sources, read_shard_header
from tests.gpu.test_one_gpu import run_script
from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses
from tests.test_indexed import transformers_token_mean
from tests.test_preference import assert_matches_trl, logged_steps, trainer_overrides

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# bf16 against fp32 over 6 steps, measured: 5.6e-4 on one H200, 5.2e-4 on CPU (bench/README.md, "GPU check");
# allowed 5x the largest.
BF16_DPO_TOLERANCE = 2.8e-3
preference_model, trl_one_replica = test_preference.preference_model, test_preference.trl_one_replica  # fixtures


def test_token_shards_train_as_transformers_scores_them(demo_model, tmp_path, record_property):
    """The demo corpus tokenized by prepare_data.py (2 workers) and trained on: step 1 (no update yet) is
    transformers' token mean over the 8 samples read, 64 inputs and the 65th token each."""
    prefix = tmp_path / "web"
    run_script("prepare_data.py", "--input", demo_model["train"], "--tokenizer_name_or_path", demo_model["hf"],
               "--output_prefix", prefix, "--workers", 2)
    out = tmp_path / "run"
    check_ok(launch_trainer(1, demo_overrides(demo_model, out, **{
        "num_stages": 1, "train_file": prefix, "eval_file": prefix, "data.format": "indexed", "max_steps": 2,
        "logging_steps": 1, "save_steps": 0, "eval_steps": 0, "export_hf": "false"}), accelerator="cuda"))
    sources = parse_sources(str(prefix), "train_file")
    blend = open_blend(sources, [read_shard_header(prefix)], seed=42, seq_length=64, isolate=False,
                       blend_dir=out / "data_index", vocab_size=384)
    expected = transformers_token_mean(demo_model["hf"], blend, range(8))
    difference = abs(per_step_losses(out)[0] - expected)
    assert difference <= 1e-5, (per_step_losses(out), expected)
    record_property("figure", f"step 1 loss {expected:.5f}: |difference| from transformers {difference:.1e} "
                              f"(allowed 1e-5)")


def test_dpo_matches_trl(preference_model, trl_one_replica, tmp_path, record_property):
    """tests/test_preference.py's one-stage DPO run (6 fp32 steps, reference log-probabilities computed first) on
    the GPU against TRL's on the CPU: step 1 within 1e-5, every step within 1e-4."""
    out = tmp_path / "run"
    check_ok(launch_trainer(1, trainer_overrides(preference_model, out), accelerator="cuda"))
    ours = logged_steps(out)
    assert_matches_trl(ours, trl_one_replica)
    difference = max(abs(mine["loss"] - trl["loss"]) for mine, trl in zip(ours, trl_one_replica))
    record_property("figure", f"6 steps, loss {ours[0]['loss']:.4f} -> {ours[-1]['loss']:.4f}: max |loss "
                              f"difference| from TRL {difference:.1e}")


def test_dpo_in_bf16_starts_at_ln2_and_follows_trl(preference_model, trl_one_replica, tmp_path, record_property):
    """The same run in bf16 (ZeRO-1, fp32 gradient sums): the reference pass and step 1's forward are the same bf16
    computation, so the first loss is ln 2 and the margin 0; every step's loss within BF16_DPO_TOLERANCE of TRL's
    fp32 run."""
    out = tmp_path / "run"
    check_ok(launch_trainer(1, trainer_overrides(preference_model, out, precision="bf16", zero_stage=1),
                            accelerator="cuda"))
    steps = logged_steps(out)
    assert abs(steps[0]["loss"] - math.log(2)) <= 1e-6 and steps[0]["rewards/margins"] == 0.0, steps[0]
    difference = max(abs(mine["loss"] - trl["loss"]) for mine, trl in zip(steps, trl_one_replica, strict=True))
    assert difference <= BF16_DPO_TOLERANCE, ([s["loss"] for s in steps], [t["loss"] for t in trl_one_replica])
    record_property("figure", f"step 1 loss {steps[0]['loss']:.7f} (ln 2 = {math.log(2):.7f}); max |loss "
                              f"difference| from TRL's fp32 {difference:.1e} (allowed {BF16_DPO_TOLERANCE:g})")
