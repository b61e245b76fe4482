"""Tiny checkpoints of the 2026 families as the hub ships them, built from their transformers configs (random
weights): the multimodal ones with a one-block vision tower (and Gemma 4's audio tower), sharded safetensors in the
hub's dtypes (bf16; Qwen3.5's A_log and gated-norm weights in fp32), Qwen3.5's and Qwen3-Next's MTP tensors (which
transformers neither builds nor loads) in a shard of their own, and the hub's variants of a family's layout (fused
or per-expert experts, the llava or transformers' module names, Gemma 4's redundant KV-shared projections)."""
import dataclasses
import json
import os

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                          Olmo3Config, Olmo3ForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM,
                          Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
# Gated DeltaNet: 2 key heads and 4 value heads of 8; three linear-attention layers to one full-attention layer
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
GEMMA3_TEXT = dict(SMALL, sliding_window=8, sliding_window_pattern=2)
GEMMA3_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                     patch_size=4)
# Gemma 4 E2B-like: per-layer embeddings, the last two layers reusing the K/V of the first two (sliding, full)
GEMMA4_TEXT = dict(SMALL, global_head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                   vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, num_kv_shared_layers=2)
# Gemma 4 26B-A4B-like: the MoE block beside the dense MLP, V the raw K on full layers, one global KV head
GEMMA4_MOE_TEXT = dict(SMALL, global_head_dim=32, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                       moe_intermediate_size=16, attention_k_eq_v=True, num_global_key_value_heads=1)
GEMMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
GEMMA4_AUDIO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                    output_proj_dims=16, conv_kernel_size=3)
FP32_AS_STORED = ("linear_attn.A_log", "linear_attn.norm.weight")  # Qwen3.5's fp32 tensors (Qwen3.6: bf16)


@dataclasses.dataclass(frozen=True)
class HubCase:
    """A checkpoint to build: the transformers model (class, config), where its module holds the text model, what
    the hub stores beyond or instead of save_pretrained's tensors (stored(model, {name: tensor}) -> {name: tensor}),
    and which tensors it keeps in fp32."""
    model_class: type
    config: object
    module_prefix: str = "model."  # the text model's in the module (transformers' state dict)
    fp32: tuple = ()
    stored: object = None  # None: as save_pretrained writes the model


def mtp(prefix="mtp.", experts=0, dtype=torch.bfloat16):
    """Stand-ins for Qwen3.5's MTP layer (its fc over [embedding | hidden], its norms, one decoder layer; per-expert
    MoE experts as Qwen3.5-MoE ships them), random."""
    gen = torch.Generator().manual_seed(5)
    shapes = {"fc.weight": (32, 64), "pre_fc_norm_embedding.weight": (32,), "pre_fc_norm_hidden.weight": (32,),
              "norm.weight": (32,), "layers.0.input_layernorm.weight": (32,),
              "layers.0.self_attn.q_proj.weight": (128, 32), "layers.0.mlp.down_proj.weight": (32, 64)}
    shapes.update({f"layers.0.mlp.experts.{e}.{p}.weight": (16, 32) for e in range(experts)
                   for p in ("gate_proj", "up_proj")})
    return {f"{prefix}{key}": torch.randn(shape, generator=gen).to(dtype) for key, shape in shapes.items()}


def with_mtp(model, stored):
    return {**stored, **mtp()}


def module_names(model, stored=None):
    """The model's tensors under its module names (transformers 5's fused experts; Gemma 3's model.language_model.*,
    model.vision_tower.*), the tied head left out."""
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if model.config.tie_word_embeddings else set()
    return {name: tensor for name, tensor in model.state_dict().items() if name not in tied}


def qwen3_5_moe_hub(model, stored):
    """Qwen3.5-MoE on the hub: the decoder layers' experts fused (the module's names), the MTP layer's per expert."""
    return {**module_names(model), **mtp(experts=2)}


def gemma4_with_shared_kv(model, stored):
    """Gemma 4 E2B / E4B as Google ships them: the KV-shared layers still hold k/v projections and a k norm, which
    their forward never uses (save_pretrained leaves them out)."""
    gen = torch.Generator().manual_seed(7)
    extra = {f"model.language_model.layers.{layer}.self_attn.{key}": torch.randn(shape, generator=gen)
             for layer, head_dim in ((2, 16), (3, 32))
             for key, shape in (("k_proj.weight", (2 * head_dim, 32)), ("v_proj.weight", (2 * head_dim, 32)),
                                ("k_norm.weight", (head_dim,)))}
    return {**stored, **{name: tensor.to(torch.bfloat16) for name, tensor in extra.items()}}


def qwen3_5_text(model_type="dense"):
    moe = model_type == "moe"
    return (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**SMALL, **LINEAR, **(QWEN_MOE if moe else {}))


HUB_CASES = {
    # Qwen3.5 27B-like: the multimodal checkpoint, A_log and the gated norm in fp32, the MTP layer
    "qwen3_5": HubCase(Qwen3_5ForConditionalGeneration, lambda: Qwen3_5Config(
        text_config=qwen3_5_text().to_dict(), vision_config=QWEN_VISION), "model.language_model.", FP32_AS_STORED,
        with_mtp),
    # Qwen3.6: the same layout, every tensor in bf16
    "qwen3_6": HubCase(Qwen3_5ForConditionalGeneration, lambda: Qwen3_5Config(
        text_config=qwen3_5_text().to_dict(), vision_config=QWEN_VISION), "model.language_model.", (), with_mtp),
    # Qwen3.5-35B-A3B-like: fused experts, the MTP layer's per expert
    "qwen3_5_moe": HubCase(Qwen3_5MoeForConditionalGeneration, lambda: Qwen3_5MoeConfig(
        text_config=qwen3_5_text("moe").to_dict(), vision_config=QWEN_VISION), "model.language_model.",
        FP32_AS_STORED, qwen3_5_moe_hub),
    # the same model as transformers' save_pretrained writes it: one tensor per expert and projection
    "qwen3_5_moe_saved": HubCase(Qwen3_5MoeForConditionalGeneration, lambda: Qwen3_5MoeConfig(
        text_config=qwen3_5_text("moe").to_dict(), vision_config=QWEN_VISION), "model.language_model.",
        FP32_AS_STORED),
    "qwen3_5_text": HubCase(Qwen3_5ForCausalLM, qwen3_5_text, fp32=FP32_AS_STORED, stored=with_mtp),
    "qwen3_5_moe_text": HubCase(Qwen3_5MoeForCausalLM, lambda: qwen3_5_text("moe"), fp32=FP32_AS_STORED),
    # Qwen3-Next-80B-A3B-like: fused in_proj_qkvz / in_proj_ba, per-expert experts, the MTP layer
    "qwen3_next": HubCase(Qwen3NextForCausalLM, lambda: Qwen3NextConfig(**SMALL, **LINEAR, **QWEN_MOE),
                          stored=with_mtp),
    # Gemma 3 4B-like as the hub (and save_pretrained) store it: the llava layout (language_model.model.*)
    "gemma3": HubCase(Gemma3ForConditionalGeneration, lambda: Gemma3Config(
        text_config=GEMMA3_TEXT, vision_config=GEMMA3_VISION, mm_tokens_per_image=4), "model.language_model."),
    "gemma3_modules": HubCase(Gemma3ForConditionalGeneration, lambda: Gemma3Config(
        text_config=GEMMA3_TEXT, vision_config=GEMMA3_VISION, mm_tokens_per_image=4), "model.language_model.",
        stored=module_names),
    "gemma3_text": HubCase(Gemma3ForCausalLM, lambda: Gemma3TextConfig(**GEMMA3_TEXT)),
    # Gemma 4 E2B-like as save_pretrained writes it, and as Google ships it
    "gemma4": HubCase(Gemma4ForConditionalGeneration, lambda: Gemma4Config(
        text_config=GEMMA4_TEXT, vision_config=GEMMA4_VISION, audio_config=GEMMA4_AUDIO), "model.language_model."),
    "gemma4_hub": HubCase(Gemma4ForConditionalGeneration, lambda: Gemma4Config(
        text_config=GEMMA4_TEXT, vision_config=GEMMA4_VISION, audio_config=GEMMA4_AUDIO), "model.language_model.",
        stored=gemma4_with_shared_kv),
    "gemma4_text_moe": HubCase(Gemma4ForCausalLM, lambda: Gemma4TextConfig(**GEMMA4_MOE_TEXT)),
    "olmo3": HubCase(Olmo3ForCausalLM, lambda: Olmo3Config(**{**SMALL, "head_dim": 8}, sliding_window=8)),
}


def build_hub_checkpoint(name, path, seed=0):
    """Save case `name` to path as the hub stores it and return (the model, {stored name: tensor})."""
    case = HUB_CASES[name]
    torch.manual_seed(seed)
    model = case.model_class(case.config()).to(torch.bfloat16).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.normal_(std=0.1)  # init's zeros and ones would hide a swapped tensor
            if param_name.endswith(case.fp32):
                param.data = param.data.float()
    model.save_pretrained(path, max_shard_size="20KB")
    stored = hf_weights(path)
    if case.stored is not None:
        stored = case.stored(model, stored)
        rewrite_shards(path, stored)
    return model, stored


def hf_weights(model_dir):
    return {name: tensor for file in sorted(os.listdir(model_dir)) if file.endswith(".safetensors")
            for name, tensor in load_file(os.path.join(model_dir, file)).items()}


def rewrite_shards(path, tensors, max_shard_size="20KB"):
    """path's weights replaced by `tensors`, sharded with their index as save_pretrained writes them."""
    for file in os.listdir(path):
        if file.endswith(".safetensors") or file == "model.safetensors.index.json":
            os.remove(os.path.join(path, file))
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, os.path.join(path, filename), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f)
