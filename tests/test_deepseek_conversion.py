"""Conversion of the DeepSeek-V3 line: multi-head latent attention's weights HF -> DeepSpeed -> HF bit-identical,
the multi-token-prediction layers a checkpoint ships carried as they are, DeepSeek's block-quantised fp8 weights
dequantised exactly as transformers dequantises them, and the refusals of what the converter cannot read."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from checkpoints.ds_to_hf import convert_ds_to_hf
from checkpoints.hf_to_ds import convert_hf_to_ds
from checkpoints.layer_files import load_weights_only
from checkpoints.quantized_weights import dequantized
from models.layout import CARRIED_FILE_NAME, layer_file_name
from tests.helpers import edit_json
from tests.tiny_models import DEEPSEEK_CONFIGS, make_model

BLOCK = 8  # the tiny models' fp8 blocks (DeepSeek's are 128 x 128)


def tiny_config(name, mtp_layers):
    config = DEEPSEEK_CONFIGS[name]()
    config.num_nextn_predict_layers = mtp_layers
    return config


def mtp_tensors(config):
    """Stand-ins for the multi-token-prediction layer a checkpoint ships after its decoder layers (DeepSeek-V3's
    model.layers.61: its own norms, projection and a whole decoder layer), random."""
    gen, layer = torch.Generator().manual_seed(3), config.num_hidden_layers
    shapes = {"enorm.weight": (32,), "hnorm.weight": (32,), "eh_proj.weight": (32, 64),
              "shared_head.norm.weight": (32,), "mlp.down_proj.weight": (32, 64)}
    return {f"model.layers.{layer}.{key}": torch.randn(shape, generator=gen) for key, shape in shapes.items()}


def with_mtp_shard(hf_dir, tensors):
    """hf_dir's model.safetensors and a second shard holding `tensors`, with the index naming both."""
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    save_file(tensors, os.path.join(hf_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(weights, "model.safetensors"), **dict.fromkeys(tensors, "model-mtp.safetensors")}
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return {**weights, **tensors}


def hf_weights(model_dir):
    return {name: tensor for file in os.listdir(model_dir) if file.endswith(".safetensors")
            for name, tensor in load_file(os.path.join(model_dir, file)).items()}


@pytest.mark.parametrize("mtp_layers", [1, 0])
@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_round_trip_is_bit_identical_with_the_mtp_layers(tmp_path, name, mtp_layers):
    config = tiny_config(name, mtp_layers)
    model = make_model(config, tmp_path / "hf")
    extra = mtp_tensors(config) if config.num_nextn_predict_layers else {}
    original = with_mtp_shard(str(tmp_path / "hf"), extra)
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    mtp_file = tmp_path / "ds" / "global_step0" / CARRIED_FILE_NAME
    assert mtp_file.exists() == bool(extra)
    convert_ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "out"), max_shard_size="20KB")
    exported = hf_weights(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


def quantized(weight):
    """DeepSeek's fp8 blocks of a weight: (float8 e4m3 weight, fp32 scale per BLOCK x BLOCK block)."""
    rows, columns = weight.shape
    blocks = weight.reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    return (blocks / scale[:, None, :, None]).reshape(rows, columns).to(torch.float8_e4m3fn), scale


def quantize_checkpoint(hf_dir, extra):
    """hf_dir's decoder projections (and the MTP layer's) block-quantised as DeepSeek publishes them, with the
    quantization_config saying so."""
    weights = {**load_file(os.path.join(hf_dir, "model.safetensors")), **extra}
    stored = {}
    for name, tensor in weights.items():
        if ".layers." in name and name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight"):
            stored[name], stored[f"{name}_scale_inv"] = quantized(tensor)
        else:
            stored[name] = tensor
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    save_file(stored, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return stored


def test_fp8_blocks_are_dequantised_as_transformers_does(tmp_path):
    config = tiny_config("deepseek_v3", 1)
    make_model(config, tmp_path / "hf")
    stored = quantize_checkpoint(str(tmp_path / "hf"), mtp_tensors(config))
    assert sum(t.dtype == torch.float8_e4m3fn for t in stored.values()) > 10
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    tag = tmp_path / "ds" / "global_step0"
    for layer in range(config.num_hidden_layers):
        for key, tensor in load_weights_only(str(tag / layer_file_name(layer + 1))).items():
            assert torch.equal(tensor, reference[f"model.layers.{layer}.{key}"]), key
    mtp = load_file(tag / CARRIED_FILE_NAME)  # dequantised too, scales gone
    eh_proj = f"model.layers.{config.num_hidden_layers}.eh_proj.weight"
    assert sorted(mtp) == sorted(mtp_tensors(config))
    assert torch.equal(mtp[eh_proj], dequantized(stored[eh_proj], stored[f"{eh_proj}_scale_inv"], (BLOCK,) * 2,
                                                 torch.float32))
    with open(tmp_path / "ds" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    convert_ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "out"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in reference.items())


def test_edge_blocks_take_their_own_scale():
    """A 5 x 7 weight in 2 x 3 blocks: 3 x 3 scales, the last row and column of blocks cut short."""
    weight = torch.arange(35, dtype=torch.float32).reshape(5, 7).to(torch.float8_e4m3fn)
    scale = torch.arange(1, 10, dtype=torch.float32).reshape(3, 3)
    expected = torch.empty(5, 7)
    for row in range(5):
        for column in range(7):
            expected[row, column] = weight[row, column].float() * scale[row // 2, column // 3]
    assert torch.equal(dequantized(weight, scale, (2, 3), torch.float32), expected)


def copy_quantized(tmp_path):
    config = tiny_config("deepseek_v3_q_proj", 0)
    make_model(config, tmp_path / "hf")
    quantize_checkpoint(str(tmp_path / "hf"), {})
    return tmp_path / "hf"


def test_other_quantisation_is_refused_before_any_weight_is_read(tmp_path):
    hf_dir = copy_quantized(tmp_path)
    edit_json(hf_dir / "config.json", lambda c: c["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(ValueError, match=r"^quantization_config=\{.*'gptq'.*\} in the deepseek_v3 config asks for "
                                         r"quantized weights"):
        convert_hf_to_ds(str(hf_dir), str(tmp_path / "ds"))
    assert not (tmp_path / "ds").exists()


def test_fp8_weight_without_its_scale_is_refused_naming_it(tmp_path):
    hf_dir = copy_quantized(tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    weights = load_file(hf_dir / "model.safetensors")
    del weights[f"{name}_scale_inv"]
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^{name} \(model.safetensors\) is F8_E4M3 without a {name}_scale_inv"):
        convert_hf_to_ds(str(hf_dir), str(tmp_path / "ds"))
    shutil.rmtree(hf_dir)
    hf_dir = copy_quantized(tmp_path)  # the same file unquantised in config.json: its fp8 tensors are refused too
    edit_json(hf_dir / "config.json", lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"is F8_E4M3 without a .*_scale_inv beside it or a quantization_config"):
        convert_hf_to_ds(str(hf_dir), str(tmp_path / "ds"))


def test_scales_of_the_wrong_grid_are_refused_naming_them(tmp_path):
    hf_dir = copy_quantized(tmp_path)
    edit_json(hf_dir / "config.json", lambda c: c["quantization_config"].update(weight_block_size=[16, 16]))
    with pytest.raises(ValueError, match=r"_scale_inv has shape \(\d+, \d+\), but .* in blocks of \[16, 16\]"):
        convert_hf_to_ds(str(hf_dir), str(tmp_path / "ds"))


@pytest.mark.parametrize("linked", [True, False], ids=["hard_link", "copy"])
def test_a_training_checkpoint_carries_the_mtp_layers_of_its_base(tmp_path, monkeypatch, linked):
    """checkpoints/saving.py: the converted base's carried tensors (its MTP layers) into a training checkpoint's tag
    directory, a hard link, or a copy where the filesystem takes none; the checksum in its manifest is the base's
    (the same bytes), which verification then checks against the file."""
    import errno
    from omegaconf import OmegaConf

    from checkpoints.integrity import read_manifest, verify_files
    from checkpoints.saving import write_side_files_and_complete
    config = tiny_config("deepseek_v3", 1)
    make_model(config, tmp_path / "hf")
    with_mtp_shard(str(tmp_path / "hf"), mtp_tensors(config))
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    base = tmp_path / "ds" / "global_step0" / CARRIED_FILE_NAME
    if not linked:
        def no_link(src, dst):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        monkeypatch.setattr(os, "link", no_link)
    tag_dir = tmp_path / "run" / "global_step2"
    tag_dir.mkdir(parents=True)
    (tag_dir / "IN_PROGRESS").write_text("save")
    cfg = OmegaConf.create({"tokenizer_name_or_path": None, "model_name_or_path": str(tmp_path / "ds")})
    write_side_files_and_complete(cfg, str(tmp_path / "ds"), str(tag_dir), {"step": 2}, [{}])
    carried = tag_dir / CARRIED_FILE_NAME
    assert carried.read_bytes() == base.read_bytes()
    assert os.path.samefile(carried, base) == linked
    assert read_manifest(str(tag_dir))[CARRIED_FILE_NAME] == read_manifest(str(base.parent))[CARRIED_FILE_NAME]
    assert verify_files(str(tag_dir), [CARRIED_FILE_NAME]) == []  # the base's checksum is the carried file's
