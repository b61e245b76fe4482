"""HF -> DeepSpeed -> HF conversion: bit-identical round trips, loadable output, and clear refusals of bad input."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config

from checkpoints.ds_to_hf import convert_ds_to_hf
from checkpoints.hf_to_ds import convert_hf_to_ds
from tests.conftest import ROOT
from tests.launch import run_python
from tests.tiny_models import TINY_CONFIGS, make_model, make_tiny_model


def load_hf_weights(model_dir):
    state = {}
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if name.endswith(".safetensors"):
            state.update(load_file(path))
        elif name.endswith(".bin"):
            state.update(torch.load(path, weights_only=True))
    return state


def assert_bit_identical(expected, actual):
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def save_as_bin(model, model_dir, shards):
    """Old-style pytorch_model*.bin checkpoint, with an index when sharded."""
    os.makedirs(model_dir)
    model.config.save_pretrained(model_dir)
    state = {k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    names = sorted(state)
    if shards == 1:
        torch.save(state, os.path.join(model_dir, "pytorch_model.bin"))
        return state
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: state[n] for n in part}, os.path.join(model_dir, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(model_dir, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return state


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_round_trip_from_sharded_safetensors_is_bit_identical(tiny_checkpoints, tmp_path, name):
    hf_dir, ds_dir = tiny_checkpoints[name]
    out = str(tmp_path / "hf")
    convert_ds_to_hf(ds_dir, out, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert_bit_identical(load_hf_weights(hf_dir), load_hf_weights(out))
    original = AutoModelForCausalLM.from_pretrained(hf_dir)
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(12).view(1, 12) % original.config.vocab_size
    assert torch.equal(original(ids).logits, exported(ids).logits)


@pytest.mark.parametrize("shards", [1, 2])
def test_round_trip_from_bin_is_bit_identical(tmp_path, shards):
    model = make_tiny_model("llama3", str(tmp_path / "unused")).to(torch.bfloat16)
    state = save_as_bin(model, str(tmp_path / "hf_bin"), shards)
    convert_hf_to_ds(str(tmp_path / "hf_bin"), str(tmp_path / "ds"))
    convert_ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "hf"))
    assert_bit_identical(state, load_hf_weights(str(tmp_path / "hf")))


def test_layer_files_follow_the_index_map(tiny_checkpoints):
    _, ds_dir = tiny_checkpoints["llama2"]
    with open(os.path.join(ds_dir, "latest")) as f:
        tag_dir = os.path.join(ds_dir, f.read().strip())
    files = sorted(os.listdir(tag_dir))
    assert files == ["checksums.json"] + [f"layer_{i:02d}-model_states.pt" for i in range(7)] + \
        ["mp_rank_00_model_states.pt"]
    hf = load_hf_weights(tiny_checkpoints["llama2"][0])
    assert torch.equal(torch.load(os.path.join(tag_dir, "layer_00-model_states.pt"))["weight"],
                       hf["model.embed_tokens.weight"])
    assert torch.equal(torch.load(os.path.join(tag_dir, "layer_02-model_states.pt"))["self_attn.q_proj.weight"],
                       hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(torch.load(os.path.join(tag_dir, "layer_06-model_states.pt"))["weight"], hf["lm_head.weight"])
    for side_file in ("config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(ds_dir, side_file))


def convert_cli(*args):
    return run_python([os.path.join(ROOT, "convert2ckpt.py"), *args])


def assert_nothing_written(parent, out):
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(parent) if ".partial-" in n]


@pytest.mark.slow
def test_missing_directory_is_a_clear_error(tmp_path):
    result = convert_cli("--model_name_or_path", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "out"))
    assert result.returncode != 0
    assert f"model directory '{tmp_path / 'nope'}' does not exist" in result.stderr
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


@pytest.mark.slow
def test_unsupported_model_type_lists_supported(tmp_path):
    GPT2Config(n_layer=2, n_embd=32, n_head=4).save_pretrained(tmp_path / "gpt2")
    result = convert_cli("--model_name_or_path", str(tmp_path / "gpt2"), "--output_dir", str(tmp_path / "out"))
    assert result.returncode != 0
    assert result.stderr == ("convert2ckpt: error: model_type 'gpt2' is not supported; supported: llama, mistral, "
                             "qwen2, qwen3, olmo2, granite, smollm3, phi3, mixtral, qwen3_moe, qwen2_moe, olmoe, "
                             "gpt_oss, deepseek_v3, glm4_moe, qwen3_5, qwen3_5_moe, qwen3_5_text, qwen3_5_moe_text, "
                             "qwen3_next, gemma3, gemma3_text, gemma4, gemma4_text, olmo3.\n")
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


@pytest.mark.parametrize("model_type,nearest", [("olmo3", "olmoe"), ("granitemoe", "granite"), ("phimoe", "phi3"),
                                               ("qwen3_5_vl", "qwen3_5"), ("gemma2", None)])
def test_unsupported_family_names_the_nearest_supported_one(model_type, nearest):
    """The families whose names say they are close (their MoE or next versions) are named; others only the list."""
    from types import SimpleNamespace

    from models.architecture import check_model_config
    with pytest.raises(ValueError) as error:
        check_model_config(SimpleNamespace(model_type=model_type))
    assert str(error.value).startswith(f"model_type '{model_type}' is not supported; supported: llama, mistral, "
                                       "qwen2, qwen3, olmo2, granite, smollm3, phi3, mixtral, qwen3_moe, qwen2_moe, "
                                       "olmoe, gpt_oss, deepseek_v3, glm4_moe, qwen3_5_text, qwen3_5_moe_text, "
                                       "qwen3_next, qwen3_5, qwen3_5_moe (the LLaMA layout, its mixtures of experts "
                                       "and the Gated DeltaNet hybrids)")
    assert str(error.value).endswith(f"; the nearest is '{nearest}', whose layers differ from it." if nearest
                                     else "(the LLaMA layout, its mixtures of experts and the Gated DeltaNet hybrids).")


def test_dropout_is_refused_for_training_only_naming_the_field(tmp_path):
    """An attention_dropout of 0.1 (as Granite configs may set), which transformers applies while training and the
    pipeline does not: conversion (exact) and evaluation go on, a training run is refused at start-up in one line;
    so is Phi-3's resid_pdrop."""
    from hydra import compose, initialize_config_dir

    from errors import ConfigError
    from training.run_spec import run_spec
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(3, 40))}) + "\n" for _ in range(8)))
    for family, field, value, where in (("granite", "attention_dropout", 0.1, "on the attention weights"),
                                        ("phi3", "resid_pdrop", 0.05, "on each sublayer's output")):
        config = TINY_CONFIGS[family]()
        setattr(config, field, value)
        make_model(config, tmp_path / family / "hf")
        convert_hf_to_ds(str(tmp_path / family / "hf"), str(tmp_path / family / "ds"))

        def spec(*overrides):
            with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
                cfg = compose(config_name="tiny", overrides=[
                    f"model_name_or_path={tmp_path / family / 'ds'}", f"train_file={data}", f"eval_file={data}",
                    f"output_dir={tmp_path / family / 'run'}", "data.format=pretokenized", "seq_length=32",
                    f"data.cache_dir={tmp_path / 'cache'}", *overrides])
            return run_spec(cfg, 2)
        with pytest.raises(ConfigError, match=rf"^{field}={value} in the {family} config asks for dropout {where} "
                                              r"while training, which this pipeline does not implement; set it to 0 "
                                              r"in the Hugging Face config.json and convert again \(eval_only runs "
                                              r"as it is\)\.$"):
            spec()
        assert spec("eval_only=true").model_config.to_dict()[field] == value


@pytest.mark.parametrize("model_type,field,value,message", [
    ("kimi_linear", None, None, r"^model_type 'kimi_linear' is not supported; supported: llama, .*, glm4_moe, "
                                r"qwen3_5, .*, olmo3\.$"),
    ("qwen3", "attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50\.0 in the qwen3 config asks for an attention "
                                              r"logit soft-cap, which this pipeline does not implement\."),
    ("llama", "layer_norm_eps", 1e-5, r"layer_norm_eps=1e-05 in the llama config asks for a LayerNorm \(only "
                                      r"RMSNorm is implemented\)"),
    ("llama", "rope_parameters", {"rope_type": "ntk-by-parts", "rope_theta": 1e4},
     r"rope_parameters rope_type 'ntk-by-parts' is not implemented; implemented: default, linear, dynamic"),
], ids=["unsupported_family", "soft_cap", "layer_norm", "rope_type"])
def test_math_not_implemented_is_refused_naming_the_field_before_any_weight_is_read(tmp_path, model_type, field,
                                                                                    value, message):
    """The config of a checkpoint asks for math the pipeline does not do: one line naming it, before any weight is
    read (the weights here are not even there) and nothing written."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = dict(TINY_CONFIGS["qwen3" if model_type.startswith("qwen3") else "llama2"]().to_dict(),
                  model_type=model_type)
    if field:
        config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        convert_hf_to_ds(str(hf_dir), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


def test_phi3_fused_weights_are_split_in_the_layer_files(tiny_checkpoints):
    """The pipeline holds Phi-3's qkv_proj and gate_up_proj as LLaMA's projections: their row blocks, in order."""
    hf_dir, ds_dir = tiny_checkpoints["phi3"]
    hf = load_hf_weights(hf_dir)
    layer = torch.load(os.path.join(ds_dir, "global_step0", "layer_02-model_states.pt"))
    assert "self_attn.qkv_proj.weight" not in layer and "mlp.gate_up_proj.weight" not in layer
    q, k, v = hf["model.layers.1.self_attn.qkv_proj.weight"].split([32, 16, 16])
    gate, up = hf["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    for key, block in {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v, "mlp.gate_proj": gate,
                       "mlp.up_proj": up}.items():
        assert torch.equal(layer[f"{key}.weight"], block), key


@pytest.mark.parametrize("num_hidden_layers,message", [
    (3, "weights not part of a llama model with num_hidden_layers=3: model.layers.3."),
    (5, "weights missing for layer 5"),
])
def test_wrong_layer_count_names_the_weights(tmp_path, num_hidden_layers, message):
    hf_dir = str(tmp_path / "hf")
    make_tiny_model("llama2", hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_hidden_layers
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        convert_hf_to_ds(hf_dir, str(tmp_path / "out"))
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


def test_shape_mismatch_names_the_key_and_file(tmp_path):
    hf_dir = str(tmp_path / "hf")
    make_tiny_model("llama2", hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 48
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: \(32, 64\) in "
                                         r"model\.safetensors, config expects \(32, 48\)"):
        convert_hf_to_ds(hf_dir, str(tmp_path / "out"))
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


@pytest.mark.slow
def test_existing_output_is_kept_unless_overwrite(tiny_checkpoints, tmp_path):
    hf_dir, _ = tiny_checkpoints["tied"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = convert_cli("--model_name_or_path", hf_dir, "--output_dir", str(out))
    assert result.returncode != 0 and "pass --overwrite" in result.stderr
    assert (out / "precious.txt").read_text() == "keep me"
    result = convert_cli("--model_name_or_path", hf_dir, "--output_dir", str(out), "--overwrite")
    assert result.returncode == 0, result.stderr
    assert not (out / "precious.txt").exists() and (out / "latest").read_text() == "global_step0"


@pytest.mark.slow
def test_to_hf_without_latest_lists_tags(tmp_path):
    (tmp_path / "ckpt" / "global_step5").mkdir(parents=True)
    result = convert_cli("--to_hf", "--ckpt_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "hf"))
    assert result.returncode != 0
    assert "has no 'latest' file; pass --tag with one of: ['global_step5']" in result.stderr
