"""The LR schedule handed to DeepSpeed: the learning rate each optimizer step actually uses; shipped defaults."""
import os

import pytest
import torch
from deepspeed.runtime import lr_schedules
from omegaconf import OmegaConf

from tests.conftest import ROOT
from training.config import deepspeed_config, lr_scheduler_config


def step_lrs(schedule, steps):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = getattr(lr_schedules, schedule["type"])(optimizer, **schedule["params"])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_no_warmup_starts_at_the_peak(kind):
    cfg = OmegaConf.create(dict(warmup_steps=0, lr_scheduler=kind, min_lr_ratio=0.1, learning_rate=1e-3))
    lrs = step_lrs(lr_scheduler_config(cfg, total_steps=10), 10)
    assert lrs[0] == pytest.approx(1e-3)
    if kind == "cosine":
        assert lrs[-1] == pytest.approx(1e-4)


def test_warmup_rises_then_cosine_decays_to_the_floor():
    cfg = OmegaConf.create(dict(warmup_steps=4, lr_scheduler="cosine", min_lr_ratio=0.1, learning_rate=1e-3))
    lrs = step_lrs(lr_scheduler_config(cfg, total_steps=12), 13)
    assert lrs[0] == 0.0 and lrs[2] < lrs[3] < lrs[4] < lrs[5] and max(lrs) <= 1e-3
    assert lrs[5:] == sorted(lrs[5:], reverse=True) and lrs[12] == pytest.approx(1e-4)


@pytest.mark.parametrize("name", sorted(n[:-len(".yaml")] for n in os.listdir(os.path.join(ROOT, "conf"))
                                        if n.endswith(".yaml")))
def test_shipped_configs_leave_unmeasured_compile_off_and_verify_checksums(name):
    """compile=true gains nothing measurable on the CPU and never ran on a GPU here (issue 13, README)."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = compose(config_name=name)
    assert cfg.compile is False
    assert cfg.verify_checksums is True and cfg.tokenizer_name_or_path is None


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_deepspeed_keys_added_to_the_precision_nodes_are_kept(precision):
    """precision switches bf16 on or off; other keys of the bf16 node (DeepSpeed's) pass through to DeepSpeed."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = compose(config_name="tiny", overrides=[f"precision={precision}",
                                                     "+deepspeed.bf16.immediate_grad_update=true"])
    ds, _ = deepspeed_config(cfg, total_steps=10)
    assert ds["bf16"] == {"immediate_grad_update": True, "enabled": precision == "bf16"}
    assert ds["fp16"] == {"initial_scale_power": 16, "enabled": False}
