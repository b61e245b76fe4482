"""LoRA: adapters' gradients against peft on transformers under stages, tensor parallelism, zero-bubble and
checkpointing; training steps against a plain peft + torch AdamW loop; checkpoints without the base; export to a
peft adapter and a merged model; the memory plan; bad input."""
import glob
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.lora import LoraSettings
from tests import parity_worker
from tests.distributed import spawn
from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics
from tests.lora_reference import hf_eval_loss
from tests.test_parity import GAS, MICRO_BATCH, SEQ

LORA = {"rank": 4, "alpha": 8.0}


def run_lora_parity(tiny_checkpoints, tmp_path, cases, num_stages, world_size, tensor_parallel=1):
    cases = [dict(case, hf_dir=tiny_checkpoints[case["model"]][0], ds_dir=tiny_checkpoints[case["model"]][1])
             for case in cases]
    spawn(parity_worker.run, world_size, cases, num_stages, MICRO_BATCH, GAS, SEQ, str(tmp_path), tensor_parallel)
    return [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank*.json")))]


GRADIENT_CASES = {  # (stages, world size, tensor parallel): cases
    (2, 2, 1): [dict(name="llama3", model="llama3", lora=LORA),
                dict(name="tied+checkpointing", model="tied", lora=LORA, checkpoint_interval=1),
                dict(name="qwen2+zero_bubble", model="qwen2", lora=LORA, schedule="zero_bubble"),
                dict(name="attention_only", model="llama2", lora=dict(LORA, target_modules=("q_proj", "v_proj")))],
    (2, 4, 2): [dict(name="llama3+sp", model="llama3", lora=LORA, sequence_parallel=True),
                dict(name="qwen2", model="qwen2", lora=LORA, sequence_parallel=False),
                dict(name="tied+sp+zero_bubble", model="tied", lora=LORA, schedule="zero_bubble")],
}


@pytest.mark.parametrize("layout", list(GRADIENT_CASES), ids=["2stages", "2stages_x_tp2"])
def test_adapter_gradients_match_peft(tiny_checkpoints, tmp_path, layout):
    """One step's loss and every adapter's gradient equal peft's on transformers (B nonzero, so A's gradients are
    too); the base takes no gradient and does not change."""
    num_stages, world_size, tensor_parallel = layout
    ranks = run_lora_parity(tiny_checkpoints, tmp_path, GRADIENT_CASES[layout], num_stages, world_size,
                            tensor_parallel)
    for case in GRADIENT_CASES[layout]:
        name = case["name"]
        for rank in ranks:
            result = rank[name]
            ref = result["ref_losses"]
            assert result["mean_loss"] == pytest.approx(sum(ref) / len(ref), abs=1e-5), name
            bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
            assert not bad, f"{name}: adapter gradients differ from peft's: {bad}"
            assert result["frozen_unchanged_without_grad"], name
            assert result["replicated_grad_spread"] == 0.0, name
            assert all(".lora_" in n for n in result["grad_errors"]), name
        # Every adapter of the peft model was compared on some rank.
        assert set().union(*(r[name]["grad_errors"] for r in ranks)) == set(ranks[0][name]["ref_param_names"])
        if case.get("schedule") == "zero_bubble":  # the adapters' weight gradients were deferred to W
            deferred = set().union(*(r[name]["deferred_weights"] for r in ranks))
            assert deferred and all(".lora_" in n for n in deferred), name


# 6 fp32 steps of 8 sequences at a constant learning rate, clipped at 1.0; LoRA rank 4 on every projection.
TRAINING = dict(num_stages=1, gradient_accumulation_steps=4, max_steps=6, logging_steps=1, learning_rate=1e-3,
                lr_scheduler="constant", warmup_steps=0, zero_stage=0, **{"lora.rank": 4, "lora.alpha": 8})


@pytest.fixture(scope="module")
def peft_run(demo_model):
    """The plain peft + transformers + torch AdamW loop the trainer's LoRA runs must equal: per-step losses and
    the trained peft model."""
    from tests.lora_reference import peft_training_losses
    return peft_training_losses(demo_model["hf"], demo_model["train"], demo_model["ds"], LoraSettings(4, 8.0),
                                steps=6, seed=42, seq_length=64, micro_batch_size=2, micro_batches=4,
                                learning_rate=1e-3, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0,
                                cache_dir=str(demo_model["root"] / "peft_cache"))


@pytest.fixture(scope="module")
def lora_run(demo_model, tmp_path_factory):
    """1 process: 6 LoRA steps, checkpoints at 3 and 6, evaluated at the end and exported as a peft adapter."""
    out = tmp_path_factory.mktemp("lora") / "run"
    check_ok(launch_trainer(1, demo_overrides(demo_model, out, **TRAINING, save_steps=3, save_total_limit=2,
                                              export_hf="true")))
    return out


def test_lora_training_equals_peft_and_its_export_loads_in_peft(demo_model, peft_run, lora_run, tmp_path):
    ref_losses, ref_model = peft_run
    assert per_step_losses(lora_run) == pytest.approx(ref_losses, abs=1e-4)
    assert [r["lr"] for r in read_metrics(lora_run) if "loss" in r] == [1e-3] * 6
    # The exported adapter, loaded by peft onto the original Hugging Face model, has the pipeline's eval loss.
    from peft import PeftModel
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model["hf"]), lora_run / "hf")
    (pipeline_eval,) = [r["eval_loss"] for r in read_metrics(lora_run) if "eval_loss" in r]
    eval_loss = hf_eval_loss(exported, demo_model["eval"], demo_model["ds"], 64, str(demo_model["root"] / "peft_cache"))
    assert eval_loss == pytest.approx(pipeline_eval, abs=1e-5)
    trained = {n: p for n, p in exported.named_parameters() if "lora_" in n}
    assert len(trained) == 4 * 7 * 2
    for name, param in ref_model.named_parameters():
        if param.requires_grad:
            assert torch.allclose(trained[name], param, atol=1e-5), name

