"""bf16 training of the DeepSeek-V3 line keeps what transformers keeps in fp32 (_keep_in_fp32_modules_strict: the
router's weight and its correction bias) in fp32 through DeepSpeed's engine, which casts every parameter to the
training dtype: the trainer's stage holds each tensor in the dtype transformers' bf16 model holds it in, the router's
fp32 master weight is the weight itself before and after a step, and on the same bf16 hidden states each router's
logits, choices and weights are transformers' bf16 model's, to the last bit."""
import json

import pytest
import torch

from tests.distributed import spawn

HIDDEN_ROWS = 512  # bf16 hidden states the routers score (a bf16 router differs on every logit, and chose otherwise
# on one row of the tiny DeepSeek-V3's first sparse layer)


def routers_of(module):
    """{pipeline index: the SigmoidRouter} of a stage's sparse layers."""
    from models.pipeline_layers import DecoderLayerPipe
    return {module.layer_indices[local]: layer.mlp.gate for local, layer in enumerate(module.forward_funcs)
            if isinstance(layer, DecoderLayerPipe) and layer.sparse}


def router_outputs(module, hidden_size):
    """{pipeline index: (logits, weights, expert ids)} of each router on the same seeded bf16 hidden states."""
    hidden = torch.randn(HIDDEN_ROWS, hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        return {index: router(hidden) for index, router in routers_of(module).items()}


def masters_equal_weights(engine):
    """{parameter name: whether its fp32 master weight (ZeRO's partition) is the parameter's value}."""
    from deepspeed_internals.access import zero_fp32_partitions, zero_fragment
    partitions, equal = zero_fp32_partitions(engine.optimizer), {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:  # LoRA's frozen base: no master weight
            continue
        fragment = zero_fragment(param)
        master = partitions[fragment.partition].narrow(0, fragment.partition_start, fragment.numel)
        mine = param.detach().reshape(-1).narrow(0, fragment.param_start, fragment.numel)
        equal[name] = torch.equal(master.to(param.dtype), mine) and (param.dtype != torch.float32
                                                                     or torch.equal(master, mine))
    return equal


def bf16_run(rank, overrides, out_dir):
    """The trainer on one process with its train() wrapped: the routers' outputs and the masters right after the
    checkpoint is loaded, the step(s), then every tensor's dtype and the masters again."""
    from tests.helpers import compose_config
    from tests.parity_worker import hf_name_of_pipeline_param
    from training import loop
    train = loop.train

    def recorded_train(engine, spec, *args, **kwargs):
        config = spec.model_config
        torch.save(router_outputs(engine.module, config.hidden_size), f"{out_dir}/routers.pt")
        loaded = masters_equal_weights(engine)
        result = train(engine, spec, *args, **kwargs)
        tensors = [*engine.module.named_parameters(), *engine.module.named_buffers()]
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump({"dtypes": {hf_name_of_pipeline_param(name, config.num_hidden_layers): str(tensor.dtype)
                                  for name, tensor in tensors if "rotary" not in name and "lora_" not in name},
                       "masters_loaded": loaded, "masters_trained": masters_equal_weights(engine),
                       "optimizer": type(engine.optimizer).__name__}, f)
        return result
    loop.train = recorded_train
    loop.run(compose_config(overrides))


@pytest.mark.slow
@pytest.mark.parametrize("family,training", [("deepseek_v3", {"moe.bias_update_rate": 0.01}),
                                             ("glm4_moe", {"moe.bias_update_rate": 0.01}),
                                             ("deepseek_v3", {"lora.rank": 4})], ids=["deepseek_v3", "glm4_moe",
                                                                                    "deepseek_v3_lora"])
def test_bf16_keeps_the_router_in_fp32_as_transformers(demo_model, tiny_deepseek_checkpoints, tmp_path, family,
                                                       training):
    """With the router trained (and its bias updated), and frozen under LoRA."""
    from transformers import AutoModelForCausalLM
    from tests.launch import demo_overrides
    hf_dir, ds_dir = tiny_deepseek_checkpoints[family]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": list(range(3 + i, 40 + i))}) + "\n"
                                                for i in range(8)))
    overrides = demo_overrides(demo_model, tmp_path / "run", **{
        "model_name_or_path": ds_dir, "tokenizer_name_or_path": demo_model["ds"], "data.format": "pretokenized",
        "train_file": tmp_path / "ids.jsonl", "eval_file": "null", "seq_length": 32, "num_stages": 1,
        "precision": "bf16", "zero_stage": 1, "max_steps": 2, "gradient_accumulation_steps": 2, **training})
    spawn(bf16_run, 1, overrides, str(tmp_path))
    result = json.load(open(tmp_path / "result.json"))
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    expected = {name: str(tensor.dtype) for name, tensor in [*reference.named_parameters(),
                                                              *reference.named_buffers()] if "rotary" not in name}
    assert result["dtypes"] == expected
    assert {name for name, dtype in expected.items() if dtype == "torch.float32"} == {
        f"model.layers.{i}.mlp.gate.{key}" for i in (1, 2, 3) for key in ("weight", "e_score_correction_bias")}
    assert result["optimizer"] == "BF16_Optimizer"  # bf16 with fp32 gradient sums
    assert all(result["masters_loaded"].values()) and all(result["masters_trained"].values())
    mine = torch.load(tmp_path / "routers.pt")
    hidden = torch.randn(HIDDEN_ROWS, reference.config.hidden_size,
                         generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        for index, (logits, weights, expert_ids) in mine.items():
            expected_logits, expected_weights, expected_ids = reference.model.layers[index - 1].mlp.gate(hidden)
            assert torch.equal(logits, expected_logits), index
            assert torch.equal(expert_ids, expected_ids), index
            assert torch.equal(weights, expected_weights), index
