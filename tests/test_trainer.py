"""trainer_pipe.py end to end (through the deepspeed launcher with a hostfile; elsewhere its ranks started as the
launcher starts them): metrics, checkpoints, export, training parity across topologies, and clear failures on bad
input."""
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from checkpoints.hf_to_ds import convert_hf_to_ds
from errors import ConfigError
from models.partition import training_flops_per_token
from tests.launch import (SINGLE_PROCESS, check_ok, demo_overrides, launch_ranks_separately, launch_trainer,
                          per_step_losses, read_metrics, run_in_process)
from resilience import exit_codes

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu", "samples_per_sec",
               "elapsed_s", "slowest_rank", "slowest_rank_compute_s", "median_rank_compute_s"}
STRAGGLER_KEYS = {"straggler_ranks", "straggler_stages"}  # present in an interval that had one


@pytest.mark.slow
def test_end_to_end_two_stages_through_a_hostfile(demo_model, tmp_path):
    out = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    check_ok(launch_trainer(2, demo_overrides(demo_model, out, max_steps=6, logging_steps=2, eval_steps=3,
                                              save_steps=3, save_total_limit=1, export_hf="true",
                                              peak_tflops=0.5, profile="true"),
                            hostfile=hostfile))
    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [3, 6]
    assert all(set(r) - STRAGGLER_KEYS == METRIC_KEYS for r in train)
    assert all(r["grad_norm"] > 0 and r["tokens_per_sec"] > 0 for r in train)
    # Model FLOPs per token x tokens/s over 2 devices, and utilisation of the configured 0.5 TFLOP/s peak.
    flops_per_token = training_flops_per_token(AutoConfig.from_pretrained(demo_model["hf"]), 64)
    for r in train:
        assert r["tflops_per_device"] == pytest.approx(flops_per_token * r["tokens_per_sec"] / 2 / 1e12, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5, rel=1e-9)
    assert train[-1]["loss"] < train[0]["loss"]
    assert evals[-1]["eval_ppl"] == pytest.approx(torch.tensor(evals[-1]["eval_loss"]).exp().item(), rel=1e-6)
    # Only the last complete checkpoint is kept, and 'latest' names it.
    assert (out / "latest").read_text() == "global_step6"
    assert not (out / "global_step3").exists()
    tag = out / "global_step6"
    for name in ("COMPLETE", "config.json", "tokenizer.json", "run_config.yaml", "trainer_state.json",
                 "layer_00-model_states.pt", "layer_06-model_states.pt", "mp_rank_00_model_states.pt",
                 "mp_rank_01_model_states.pt"):
        assert (tag / name).is_file(), name
    assert (out / "loss.png").stat().st_size > 0
    # profile=true: each stage's time per instruction of its schedule and per part of the loop, steps 2-6.
    profiles = [json.loads((out / "profile" / f"rank{r:05d}.json").read_text()) for r in range(2)]
    assert [p["stage"] for p in profiles] == [0, 1] and all(len(p["step_seconds"]) == 5 for p in profiles)
    assert {"ForwardPass", "BackwardPass", "SendActivation", "RecvGrad", "OptimizerStep"} <= set(profiles[0]["instructions"])
    assert {"RecvActivation", "SendGrad"} <= set(profiles[1]["instructions"])
    for p in profiles:
        assert set(p["loop"]) == set(p["loop_cpu"]) == {"micro-batches and token count", "train_batch", "logging",
                                                        "evaluation", "preemption check", "checkpoint"}
        assert sum(p["instructions"].values()) < p["loop"]["train_batch"]
        assert sum(p["loop"].values()) == pytest.approx(sum(p["step_seconds"]), rel=1e-6)
        # CPU seconds of the training thread: the same instructions, never more than their wall-clock time
        assert set(p["instructions_cpu"]) == set(p["instructions"]) and len(p["step_cpu_seconds"]) == 5
        assert all(p["instructions_cpu"][k] <= p["instructions"][k] + 1e-3 for k in p["instructions"])
        assert sum(p["loop_cpu"].values()) == pytest.approx(sum(p["step_cpu_seconds"]), rel=1e-6)
        assert 0 < sum(p["step_cpu_seconds"]) <= sum(p["step_seconds"])
    assert any(name.startswith("events.out.tfevents") for _, _, files in os.walk(out / "tensorboard") for name in files)
    # The exported model is the trained one, loadable by transformers.
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    head = torch.load(tag / "layer_06-model_states.pt")["weight"]
    assert torch.equal(exported.lm_head.weight, head)
    assert not torch.equal(head, AutoModelForCausalLM.from_pretrained(demo_model["hf"]).lm_head.weight)


@pytest.mark.slow
def test_training_parity_across_topologies(demo_model, reference_run, single_process_run, tmp_path):
    """8 fp32 steps with the same global batch (8 sequences): 2 stages, and 2 stages x 2 data-parallel (the reference
    run), against 1 process."""
    check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "2x1", **dict(
        SINGLE_PROCESS, num_stages=2, eval_file="null"))))
    losses = {"1x1": per_step_losses(single_process_run), "2x2": per_step_losses(reference_run),
              "2x1": per_step_losses(tmp_path / "2x1")}
    assert len(losses["1x1"]) == 8
    assert losses["1x1"][-1] < losses["1x1"][0]
    for name in ("2x1", "2x2"):
        assert losses[name] == pytest.approx(losses["1x1"], abs=1e-4), name


@pytest.mark.slow
def test_bad_config_fails_on_every_rank(demo_model, tmp_path):
    message = "num_stages=3 does not divide the world size 2"
    results = launch_ranks_separately(2, demo_overrides(demo_model, tmp_path / "run", num_stages=3))
    for rank, result in enumerate(results):  # each rank says why and exits, none waits at a collective
        assert result.returncode == exit_codes.CONFIG_ERROR, (rank, result.stderr[-3000:])
        assert f"trainer_pipe: error: {message}" in result.stderr, (rank, result.stderr[-3000:])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,world_size,message", [
    ({"num_stages": 4}, 2, "num_stages=4 does not divide the world size 2"),
    ({"train_file": "/nonexistent/train.jsonl"}, 2, "train_file '/nonexistent/train.jsonl' does not exist"),
    ({"train_file": "null"}, 2, "train_file is not set"),
    ({"seq_length": 4096}, 2, "seq_length=4096 exceeds the model's max_position_embeddings=512"),
    ({"precision": "bf16", "zero_stage": 0}, 2, "precision=bf16 with zero_stage=0: below fp32 a checkpoint takes"),
    ({"preemption_grace_seconds": 0}, 2, "preemption_grace_seconds=0 must be positive"),
    ({"peak_tflops": -1}, 2, "peak_tflops=-1 must be a device's positive peak TFLOP/s, or null"),
    ({"device_memory_gb": 0}, 2, "device_memory_gb=0 must be the positive GiB each device has"),
    ({"data_build_timeout_minutes": 0}, 2, "data_build_timeout_minutes=0 must be positive: the minutes the other"),
], ids=["stages", "train_file", "no_train_file", "seq_length", "bf16_zero0", "grace", "peak", "device_memory",
        "data_build_timeout"])
def test_bad_config_is_refused_before_any_work(demo_model, tmp_path, overrides, world_size, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), world_size)
    assert not (tmp_path / "run").exists()


def test_unconverted_model_says_how_to_convert(demo_model, tmp_path):
    with pytest.raises(ValueError) as error:
        run_in_process(demo_overrides(demo_model, tmp_path / "run", model_name_or_path=demo_model["hf"]), 2)
    assert f"model_name_or_path '{demo_model['hf']}' is not a converted DeepSpeed checkpoint" in str(error.value)
    assert "python convert2ckpt.py --model_name_or_path HF_DIR" in str(error.value)


def test_more_stages_than_layers(demo_model, tmp_path):
    config = LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    with pytest.raises(ValueError, match="num_stages=2 is more than the model's 1 decoder layers"):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", model_name_or_path=tmp_path / "ds"), 2)


def test_output_dir_equal_to_the_converted_model_is_refused_and_the_model_kept(demo_model, tmp_path):
    """The converter writes global_step0 without COMPLETE: a start that cleaned incomplete checkpoints would delete
    the model it starts from. It is refused before anything runs; not a byte of the model changes."""
    import shutil

    from tests.test_checkpointing import disk_state
    model = tmp_path / "model"
    shutil.copytree(demo_model["ds"], model)
    before = disk_state(model)
    with pytest.raises(ConfigError) as refusal:
        run_in_process(demo_overrides(demo_model, model, model_name_or_path=model), 2)
    assert str(refusal.value) == (f"output_dir '{model}' is model_name_or_path, the converted model this run starts "
                                  f"from: its checkpoints would replace the model's 'latest' and mix with its "
                                  f"global_step0; choose another output_dir.")
    assert disk_state(model) == before


def test_fresh_run_refuses_to_mix_with_existing_checkpoints(demo_model, tmp_path):
    out = tmp_path / "run"
    (out / "global_step4").mkdir(parents=True)
    (out / "global_step4" / "COMPLETE").write_text("global_step4")
    with pytest.raises(ConfigError, match=f"output_dir '{out}' already holds checkpoints \\(global_step4\\); "
                                              f"set resume=auto to continue from global_step4"):
        run_in_process(demo_overrides(demo_model, out), 2)
    assert sorted(os.listdir(out)) == ["global_step4"]


@pytest.mark.slow
def test_empty_dataset_fails_without_hanging(demo_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = launch_trainer(2, demo_overrides(demo_model, tmp_path / "run", train_file=str(empty)), timeout=120)
    assert result.returncode != 0
    assert "no training examples after tokenization" in result.stdout + result.stderr
