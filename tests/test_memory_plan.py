"""The plan_only memory planner from a run config (fast: nothing of model size is built)."""
import os

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import ROOT
from tests.tiny_models import make_tiny_model
from training.config import ConfigError
from training.plan import load_plan_model_config, memory_plan, plan_world_size, print_memory_plan

GIB = 2 ** 30


def run_config(name, *overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        return compose(config_name=name, overrides=["plan_only=true", *overrides])


def test_llama_65b_on_two_nodes_of_eight_80gb_devices(capsys):
    cfg = run_config("llama_65b")
    rows = print_memory_plan(cfg, load_plan_model_config(cfg), world_size=16)
    printed = capsys.readouterr().out
    assert len(rows) == 8 and "8 stages x 2 data-parallel" in printed
    assert sum(row["parameters"] for row in rows) == pytest.approx(65.3e9, rel=0.01)
    for row in rows:
        backward = row["gradients_bytes"] + row["activation_checkpointed_bytes"]
        assert row["memory_bytes"] == (row["weights_bytes"] + row["optimizer_bytes"] + row["buffer_bytes"]
                                       + max(backward, row["step_bytes"]))
        assert row["activation_full_bytes"] > row["activation_checkpointed_bytes"]
        # bf16 weights and gradients; fp32 master and Adam moments sharded over the 2 data-parallel ranks.
        assert row["weights_bytes"] == row["gradients_bytes"] == 2 * row["parameters"]
        assert row["optimizer_bytes"] == 6 * row["parameters"]
    # Checkpointing keeps one hidden state per layer instead of every intermediate.
    assert rows[0]["activation_full_bytes"] > 10 * rows[0]["activation_checkpointed_bytes"]
    # 8 billion parameters a stage at 10 bytes each do not fit 80 GiB; the verdict says so.
    assert not any(row["fits"] for row in rows) and "does NOT fit in 80 GiB" in printed


def test_more_stages_or_memory_make_it_fit():
    cfg = run_config("llama_65b", "num_stages=16")
    _, rows = memory_plan(cfg, load_plan_model_config(cfg), world_size=32)
    assert all(row["fits"] for row in rows)
    assert max(row["memory_bytes"] for row in rows) < 80 * GIB


def test_first_stage_holds_the_most_micro_batches_without_checkpointing():
    cfg = run_config("llama_7b", "activation_checkpoint_interval=0")
    _, rows = memory_plan(cfg, load_plan_model_config(cfg), world_size=4)
    assert [row["in_flight"] for row in rows] == [4, 3, 2, 1]
    middle = rows[1:-1]
    assert middle[0]["activation_full_bytes"] > middle[1]["activation_full_bytes"]
    assert all(row["activation_bytes"] == row["activation_full_bytes"] for row in rows)


def test_model_config_from_a_model_directory(tmp_path):
    make_tiny_model("llama3", str(tmp_path / "hf"))
    cfg = run_config("tiny", f"model_name_or_path={tmp_path / 'hf'}")
    config = load_plan_model_config(cfg)
    assert config.num_key_value_heads == 2
    _, rows = memory_plan(cfg, config, world_size=2)
    assert [row["layers"] for row in rows] == [(0, 3), (3, 7)]


def test_no_model_config_is_a_clear_error(tmp_path):
    cfg = run_config("tiny", f"model_name_or_path={tmp_path}")
    with pytest.raises(ConfigError, match="plan_only needs a model config"):
        load_plan_model_config(cfg)


def test_stages_must_divide_the_world_size():
    cfg = run_config("llama_65b")
    with pytest.raises(ConfigError, match="does not divide"):
        memory_plan(cfg, load_plan_model_config(cfg), world_size=12)


def test_world_size_to_plan_for(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plan_world_size(run_config("llama_65b")) == 16  # the config's 2 nodes x 8 devices
    assert plan_world_size(run_config("llama_65b", "plan_world_size=null")) == 8  # one replica of the stages
    monkeypatch.setenv("WORLD_SIZE", "32")
    assert plan_world_size(run_config("llama_65b", "plan_world_size=null")) == 32
