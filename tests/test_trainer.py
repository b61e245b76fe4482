"""trainer_pipe.py end to end through the deepspeed launcher: metrics, checkpoints, export, training parity
across topologies, and clear failures on bad input."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.launch import launch_trainer

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "samples_per_sec", "elapsed_s"}


def demo_overrides(demo_model, output_dir, **extra):
    values = dict(model_name_or_path=demo_model["ds"], train_file=demo_model["train"], eval_file=demo_model["eval"],
                  output_dir=str(output_dir), seq_length=64, micro_batch_size=2, gradient_accumulation_steps=4)
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_end_to_end_two_stages_through_a_hostfile(demo_model, tmp_path):
    out = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    result = launch_trainer(2, demo_overrides(demo_model, out, max_steps=6, logging_steps=2, eval_steps=3,
                                              save_steps=3, save_total_limit=1, export_hf="true"), hostfile=hostfile)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [3, 6]
    assert all(set(r) == METRIC_KEYS for r in train)
    assert all(r["grad_norm"] > 0 and r["tokens_per_sec"] > 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    assert evals[-1]["eval_ppl"] == pytest.approx(torch.tensor(evals[-1]["eval_loss"]).exp().item(), rel=1e-6)
    # Only the last complete checkpoint is kept, and 'latest' names it.
    assert (out / "latest").read_text() == "global_step6"
    assert not (out / "global_step3").exists()
    tag = out / "global_step6"
    for name in ("COMPLETE", "config.json", "tokenizer.json", "run_config.yaml", "layer_00-model_states.pt",
                 "layer_06-model_states.pt", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
        assert (tag / name).is_file(), name
    assert (out / "loss.png").stat().st_size > 0
    assert any(name.startswith("events.out.tfevents") for _, _, files in os.walk(out / "tensorboard") for name in files)
    # The exported model is the trained one, loadable by transformers.
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    head = torch.load(tag / "layer_06-model_states.pt")["weight"]
    assert torch.equal(exported.lm_head.weight, head)
    assert not torch.equal(head, AutoModelForCausalLM.from_pretrained(demo_model["hf"]).lm_head.weight)


def per_step_losses(output_dir):
    return [r["loss"] for r in read_metrics(output_dir) if "loss" in r]


def test_training_parity_across_topologies(demo_model, tmp_path):
    """8 fp32 steps with the same global batch (8 sequences): 1 process, 2 stages, 2 stages x 2 data-parallel."""
    common = dict(max_steps=8, logging_steps=1, eval_file="null", learning_rate=1e-3, warmup_steps=2)
    runs = {"1x1": (1, 1, 4), "2x1": (2, 2, 4), "2x2": (4, 2, 2)}
    losses = {}
    for name, (procs, stages, gas) in runs.items():
        out = tmp_path / name
        result = launch_trainer(procs, demo_overrides(demo_model, out, num_stages=stages,
                                                      gradient_accumulation_steps=gas, **common))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[name] = per_step_losses(out)
    assert len(losses["1x1"]) == 8
    assert losses["1x1"][-1] < losses["1x1"][0]
    for name in ("2x1", "2x2"):
        assert losses[name] == pytest.approx(losses["1x1"], abs=1e-4), name


@pytest.mark.parametrize("overrides,message", [
    (["num_stages=3"], "num_stages=3 does not divide the world size 2"),
    (["train_file=/nonexistent/train.jsonl"], "train_file '/nonexistent/train.jsonl' does not exist"),
    (["seq_length=4096"], "seq_length=4096 exceeds the model's max_position_embeddings=512"),
], ids=["stages", "train_file", "seq_length"])
def test_bad_config_fails_on_every_rank(demo_model, tmp_path, overrides, message):
    result = launch_trainer(2, demo_overrides(demo_model, tmp_path / "run") + overrides, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count(message) == 2, output[-3000:]  # each rank says why, before any heavy work
    assert not (tmp_path / "run").exists()


def test_empty_dataset_fails_without_hanging(demo_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = launch_trainer(2, demo_overrides(demo_model, tmp_path / "run", train_file=str(empty)), timeout=120)
    assert result.returncode != 0
    assert "no training examples after tokenization" in result.stdout + result.stderr


def test_unconverted_model_says_how_to_convert(demo_model, tmp_path):
    result = launch_trainer(1, demo_overrides(demo_model, tmp_path / "run", model_name_or_path=demo_model["hf"]),
                            timeout=120)
    assert result.returncode != 0
    assert (f"model_name_or_path '{demo_model['hf']}' is not a converted DeepSpeed checkpoint"
            in result.stdout + result.stderr)
    assert "python convert2ckpt.py --model_name_or_path HF_DIR" in result.stdout + result.stderr


def test_more_stages_than_layers(tmp_path):
    import subprocess
    import sys
    from tests.conftest import ROOT
    from checkpoints.hf_to_ds import convert_hf_to_ds
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_llama.py"), "--output_dir",
                    str(tmp_path), "--train_lines", "200", "--eval_lines", "10", "--vocab_size", "384",
                    "--hidden_size", "32", "--num_hidden_layers", "1"], check=True, capture_output=True)
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    result = launch_trainer(2, [f"model_name_or_path={tmp_path / 'ds'}", f"train_file={tmp_path / 'train.txt'}",
                                f"output_dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode != 0
    assert "num_stages=2 is more than the model's 1 decoder layers" in result.stdout + result.stderr


def test_fresh_run_refuses_to_mix_with_existing_checkpoints(demo_model, tmp_path):
    out = tmp_path / "run"
    (out / "global_step4").mkdir(parents=True)
    (out / "global_step4" / "COMPLETE").write_text("global_step4")
    result = launch_trainer(1, demo_overrides(demo_model, out, num_stages=1), timeout=120)
    assert result.returncode != 0
    assert (f"output_dir '{out}' already holds checkpoints (global_step4); set resume=auto to continue from "
            f"global_step4" in result.stdout + result.stderr)
    assert sorted(os.listdir(out)) == ["global_step4"]
