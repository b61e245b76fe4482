"""LoRA: adapters' gradients against peft on transformers under stages, tensor parallelism, zero-bubble and
checkpointing; training steps against a plain peft + torch AdamW loop; checkpoints without the base; export to a
peft adapter and a merged model; the memory plan; bad input."""
import glob
import json

import pytest

from tests import parity_worker
from tests.distributed import spawn
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
