"""Conversion of the 2026 families as the hub ships them (tests/hub_checkpoints.py): HF -> DeepSpeed -> HF
bit-identical with every tensor's stored dtype, the text model's layers in the layer files under their HF names, the
vision and audio towers and the MTP tensors carried as they are (into training checkpoints too), the export loading
in transformers as the original does; and the refusal of a model_type still not supported."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, KimiLinearConfig, OlmoHybridConfig

from checkpoints.ds_to_hf import convert_ds_to_hf
from checkpoints.hf_to_ds import convert_hf_to_ds
from checkpoints.layer_files import load_weights_only
from models.layout import CARRIED_FILE_NAME, HUB_LAYOUT_KEY, PER_LAYER_TENSORS, HubLayout, layer_file_name
from tests.hub_checkpoints import HUB_CASES, build_hub_checkpoint, hf_weights

# {case: (hub prefix of the text model, what the conversion carries as it is, how the experts are stored)}
LAYOUTS = {
    "qwen3_5": ("model.language_model.", ("model.visual.", "mtp."), True),
    "qwen3_6": ("model.language_model.", ("model.visual.", "mtp."), True),
    "qwen3_5_moe": ("model.language_model.", ("model.visual.", "mtp."), False),
    "qwen3_5_moe_saved": ("model.language_model.", ("model.visual.",), True),
    "qwen3_5_text": ("model.", ("mtp.",), True),
    "qwen3_5_moe_text": ("model.", (), True),
    "qwen3_next": ("model.", ("mtp.",), True),
    "gemma3": ("language_model.model.", ("vision_tower.", "multi_modal_projector."), True),
    "gemma3_modules": ("model.language_model.", ("model.vision_tower.", "model.multi_modal_projector."), True),
    "gemma3_text": ("model.", (), True),
    "gemma4": ("model.language_model.", ("model.vision_tower.", "model.audio_tower.", "model.embed_"), True),
    "gemma4_hub": ("model.language_model.", ("model.vision_tower.", "model.audio_tower.", "model.embed_",
                                             *(f"model.language_model.layers.{i}.self_attn.{p}" for i in (2, 3)
                                               for p in ("k_proj", "v_proj", "k_norm"))), True),
    "gemma4_text_moe": ("model.", (), False),  # its experts fused, as transformers stores them
    "olmo3": ("model.", (), True),
}


def test_every_case_is_checked():
    assert set(LAYOUTS) == set(HUB_CASES)


@pytest.mark.parametrize("prefix", ["model.", "model.language_model."], ids=["text", "multimodal"])
def test_gemma4_experts_are_read_fused_as_stored(prefix):
    """Gemma 4's experts sit beside its dense MLP (layers.{i}.experts.*, not mlp.experts.*): a checkpoint holding
    them fused reads as fused, each expert tensor one piece, whole, and its recorded layout says so."""
    from models.layout import HUB_LAYOUTS, hub_layout_of, hub_pieces
    from tests.tiny_models import LAYER_TYPE_CONFIGS
    config = LAYER_TYPE_CONFIGS["gemma4_26b_a4b"]()
    with torch.device("meta"):
        names = [name for name in AutoModelForCausalLM.from_config(config).state_dict()]
    model_type = "gemma4_text" if prefix == "model." else "gemma4"
    layout = hub_layout_of(model_type, [name.replace("model.", prefix, 1) for name in names])
    assert layout == dataclasses.replace(HUB_LAYOUTS[model_type][0], experts_apart=False)
    experts = [name for name in names if ".experts." in name]
    assert len(experts) == 2 * config.num_hidden_layers
    assert all(hub_pieces(name, config, layout) == [(name.replace("model.", prefix, 1), None)] for name in experts)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case: (the model, its stored tensors, hf_dir, ds_dir, exported dir)}, built, converted and exported once."""
    root, cases = tmp_path_factory.mktemp("hub"), {}

    def build(name):
        if name not in cases:
            hf, ds, out = (str(root / name / part) for part in ("hf", "ds", "out"))
            model, stored = build_hub_checkpoint(name, hf)
            convert_hf_to_ds(hf, ds)
            convert_ds_to_hf(ds, out, max_shard_size="20KB")
            cases[name] = model, stored, hf, ds, out
        return cases[name]
    return build


@pytest.mark.parametrize("name", HUB_CASES)
def test_round_trip_is_bit_identical_with_every_dtype_as_stored(converted, name):
    model, stored, hf_dir, _, out = converted(name)
    assert len(os.listdir(hf_dir)) > 4 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    exported = hf_weights(out)
    assert sorted(exported) == sorted(stored)
    for key, tensor in stored.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    fp32 = {key for key, tensor in stored.items() if tensor.dtype == torch.float32}
    if HUB_CASES[name].fp32:  # Qwen3.5: A_log and the gated norm of each linear-attention layer, nothing else
        assert fp32 == {key for key in stored if key.endswith(HUB_CASES[name].fp32)} and len(fp32) == 6
    elif name.startswith("qwen"):  # Qwen3.6: bf16 throughout
        assert fp32 == set()
    with open(os.path.join(hf_dir, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)  # the multimodal config, as it was


@pytest.mark.parametrize("name", HUB_CASES)
def test_export_loads_in_transformers_as_the_original(converted, name):
    """The model's own class reads the export as it reads the original (the same tensors, the same keys it calls
    missing or unexpected: Qwen3.5's MTP layer, Gemma 4's unused KV-shared projections), and AutoModelForCausalLM
    computes the same logits from it."""
    model, _, hf_dir, _, out = converted(name)
    (original, original_info), (exported, exported_info) = (
        type(model).from_pretrained(path, dtype=torch.float32, output_loading_info=True) for path in (hf_dir, out))
    assert {k: sorted(v) for k, v in exported_info.items()} == {k: sorted(v) for k, v in original_info.items()}
    original_state, exported_state = original.state_dict(), exported.state_dict()
    assert all(torch.equal(exported_state[key], tensor) for key, tensor in original_state.items())
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    causal = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in (hf_dir, out)]
    with torch.no_grad():
        assert torch.equal(causal[0](ids).logits, causal[1](ids).logits)


@pytest.mark.parametrize("name", HUB_CASES)
def test_layer_files_hold_the_text_model_under_hf_names_and_the_rest_is_carried(converted, name):
    """Layer 1 + i holds exactly decoder layer i's tensors under their HF names with the prefix stripped (the
    experts fused, as the module holds them), in their stored dtypes, with its share of Gemma 4's per-layer
    embeddings; the embedding layer holds its weight alone; every tensor outside the text model, and the text
    model's that transformers does not hold, are in the carried file under their stored names, with the layout the export writes back."""
    model, stored, _, ds_dir, _ = converted(name)
    prefix, carried_prefixes, experts_apart = LAYOUTS[name]
    module_prefix = HUB_CASES[name].module_prefix
    state = model.state_dict()
    text = model.config.get_text_config()
    tag = os.path.join(ds_dir, "global_step0")
    width = getattr(text, "hidden_size_per_layer_input", 0) or 0
    for layer in range(text.num_hidden_layers):
        held = load_weights_only(os.path.join(tag, layer_file_name(layer + 1)))
        own = {key.removeprefix(f"{module_prefix}layers.{layer}."): tensor for key, tensor in state.items()
               if key.startswith(f"{module_prefix}layers.{layer}.")}
        # Gemma 4's per-layer embeddings: the layer's own columns / rows of them, and the norm they share
        own.update({f"per_layer_inputs.{key}": tensor if dim is None else tensor.narrow(dim, layer * width, width)
                    for key, dim in PER_LAYER_TENSORS.items()
                    if (tensor := state.get(f"{module_prefix}{key}")) is not None})
        assert sorted(held) == sorted(own), layer
        for key, tensor in own.items():
            assert held[key].dtype == tensor.dtype and torch.equal(held[key], tensor), (layer, key)
    embedding = load_weights_only(os.path.join(tag, layer_file_name(0)))
    assert sorted(embedding) == ["weight"]
    assert torch.equal(embedding["weight"], state[f"{module_prefix}embed_tokens.weight"])
    head = os.path.join(tag, layer_file_name(text.num_hidden_layers + 2))
    assert os.path.isfile(head) != model.config.tie_word_embeddings
    with safe_open(os.path.join(tag, CARRIED_FILE_NAME), framework="pt") as carried:
        assert sorted(carried.keys()) == sorted(key for key in stored if key.startswith(carried_prefixes))
        assert all(torch.equal(carried.get_tensor(key), stored[key]) for key in carried.keys())
        layout = HubLayout.from_record(carried.metadata()[HUB_LAYOUT_KEY])
    assert (layout.text_prefix, layout.experts_apart) == (prefix, experts_apart)
    if name.startswith("qwen3_next"):  # fused as stored: the model part takes them so
        assert {"linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"} <= set(
            load_weights_only(os.path.join(tag, layer_file_name(1))))


def test_a_training_checkpoint_carries_the_towers_and_the_layout(converted, tmp_path):
    """checkpoints/saving.py carries the base's carried file into a training checkpoint, whose export then writes
    the multimodal checkpoint back, towers, MTP layer and fp32 tensors included."""
    from omegaconf import OmegaConf

    from checkpoints.saving import write_side_files_and_complete
    _, stored, _, ds_dir, _ = converted("qwen3_5")
    tag_dir = tmp_path / "run" / "global_step2"
    tag_dir.mkdir(parents=True)
    base = os.path.join(ds_dir, "global_step0")
    for file in os.listdir(base):
        if file.startswith("layer_"):  # what the run's engine would have written
            os.link(os.path.join(base, file), tag_dir / file)
    (tag_dir / "IN_PROGRESS").write_text("save")
    cfg = OmegaConf.create({"tokenizer_name_or_path": None, "model_name_or_path": ds_dir})
    write_side_files_and_complete(cfg, ds_dir, str(tag_dir), {"step": 2}, [{}])
    assert os.path.samefile(tag_dir / CARRIED_FILE_NAME, os.path.join(base, CARRIED_FILE_NAME))
    convert_ds_to_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    exported = hf_weights(tmp_path / "out")
    assert sorted(exported) == sorted(stored)
    assert all(exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor)
               for key, tensor in stored.items())


def test_a_bin_checkpoint_round_trips_with_its_towers(converted, tmp_path):
    """A pytorch_model.bin of the multimodal Qwen3.5 (its tensors read, not copied by the kernel: the carried file
    written one tensor at a time)."""
    _, stored, hf_dir, _, _ = converted("qwen3_5")
    (tmp_path / "hf").mkdir()
    for file in ("config.json", "generation_config.json"):
        (tmp_path / "hf" / file).write_bytes(open(os.path.join(hf_dir, file), "rb").read())
    torch.save(stored, tmp_path / "hf" / "pytorch_model.bin")
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    convert_ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "out"))
    exported = hf_weights(tmp_path / "out")
    assert sorted(exported) == sorted(stored)
    assert all(exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor)
               for key, tensor in stored.items())


def test_a_tensor_outside_the_layout_is_refused_naming_it(converted, tmp_path):
    from tests.hub_checkpoints import rewrite_shards
    _, stored, hf_dir, _, _ = converted("qwen3_5")
    bad = tmp_path / "hf"
    bad.mkdir()
    for file in ("config.json", "generation_config.json"):
        (bad / file).write_bytes(open(os.path.join(hf_dir, file), "rb").read())
    rewrite_shards(str(bad), {**stored, "model.language_model.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"^weights not part of a qwen3_5_text model with num_hidden_layers=4: "
                                         r"model\.language_model\.extra\.weight \(model-\d+-of-\d+\.safetensors\)"):
        convert_hf_to_ds(str(bad), str(tmp_path / "ds"))
    assert not (tmp_path / "ds").exists()


UNSUPPORTED = {"kimi_linear": lambda: KimiLinearConfig(num_hidden_layers=4),
               "olmo_hybrid": lambda: OlmoHybridConfig(num_hidden_layers=4,
                                                       layer_types=["linear_attention", "full_attention"] * 2)}


@pytest.mark.parametrize("model_type", UNSUPPORTED)
def test_a_model_type_not_supported_is_refused_in_one_line_before_any_work(tmp_path, model_type):
    config = UNSUPPORTED[model_type]()
    config.save_pretrained(tmp_path / "hf")  # no weights: refused before any would be read
    with pytest.raises(ValueError) as error:
        convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    assert str(error.value) == (
        f"model_type '{config.model_type}' is not supported; supported: llama, mistral, qwen2, qwen3, olmo2, "
        "granite, smollm3, phi3, mixtral, qwen3_moe, qwen2_moe, olmoe, gpt_oss, deepseek_v3, glm4_moe, qwen3_5, "
        "qwen3_5_moe, qwen3_5_text, qwen3_5_moe_text, qwen3_next, gemma3, gemma3_text, gemma4, gemma4_text, olmo3.")
    assert not (tmp_path / "ds").exists()
