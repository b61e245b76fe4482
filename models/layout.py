"""The layer index map: which pipeline layer owns which Hugging Face weight. Both conversion directions and
post-init loading go through here, so the map exists once.

| index    | layer            | HF weight names                                       |
| 0        | embedding        | model.embed_tokens.weight                             |
| 1 .. L   | decoder layer i-1| model.layers.{i-1}.*  (prefix stripped)               |
| L+1      | final norm       | model.norm.weight                                     |
| L+2      | LM head          | lm_head.weight (no file when tied: layer 0 holds it)  |

Phi-3's fused qkv_proj and gate_up_proj are held as their parts, q/k/v_proj and gate/up_proj (row blocks:
models/architecture.py's fused_projections), split on conversion and fused again on export.

A mixture-of-experts layer holds its experts fused, as transformers 5 does (models/moe.py); the hub's checkpoints,
and transformers' save_pretrained, hold one tensor per expert and projection (Mixtral's under its old module name,
block_sparse_moe): stacked on conversion (either layout is read), split again on export (GPT-OSS's stay fused).
"""
import os
import re

import torch

from models.architecture import architecture_of, fused_projections

_DECODER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def num_pipeline_layers(num_hidden_layers):
    return num_hidden_layers + 3


def layer_of_hf_name(name, num_hidden_layers, tie_word_embeddings):
    """(layer index, key inside that layer's state dict) for a Hugging Face weight name; None if unknown."""
    if name == "model.embed_tokens.weight":
        return 0, "weight"
    if name == "model.norm.weight":
        return num_hidden_layers + 1, "weight"
    if name == "lm_head.weight":
        return (0 if tie_word_embeddings else num_hidden_layers + 2), "weight"
    match = _DECODER.match(name)
    if match and int(match.group(1)) < num_hidden_layers:
        return int(match.group(1)) + 1, match.group(2)
    return None


def hf_name_of_layer_key(index, key, num_hidden_layers):
    if index == 0:
        return f"model.embed_tokens.{key}"
    if index <= num_hidden_layers:
        return f"model.layers.{index - 1}.{key}"
    if index == num_hidden_layers + 1:
        return f"model.norm.{key}"
    return f"lm_head.{key}"


def layer_file_name(index):
    # DeepSpeed's loader globs layer_{idx:02d}-*model_states.pt, so at least two digits.
    return f"layer_{index:02d}-model_states.pt"


def layer_file_path(tag_dir, index):
    return os.path.join(tag_dir, layer_file_name(index))


def expert_shard_file_name(index, shard, shards, kind="model"):
    """A training checkpoint's file of a layer's experts shard/shards (experts [shard E/shards, (shard + 1)
    E/shards) of each expert tensor, its weights or, kind "optim", its optimizer state), which the expert-parallel
    rank holding them writes: layer_05-experts_01-of-04-model_states.pt. DeepSpeed's glob of a layer's files finds
    these too; expert_shard_of tells them from its tensor-parallel slices."""
    return f"layer_{index:02d}-experts_{shard:02d}-of-{shards:02d}-{kind}_states.pt"


_EXPERT_SHARD = re.compile(r"^layer_\d+-experts_(\d+)-of-(\d+)-(?:model|optim)_states\.pt$")


def expert_shard_of(path):
    """(shard, shards) of an expert shard file's path, or None for any other file."""
    match = _EXPERT_SHARD.match(os.path.basename(path))
    return (int(match.group(1)), int(match.group(2))) if match else None


def layer_indices_with_files(num_hidden_layers, tie_word_embeddings):
    last = num_hidden_layers + 1 if tie_word_embeddings else num_hidden_layers + 2
    return range(0, last + 1)


# A fused projection's tensors: the weight and a LoRA adapter's B stack their parts' rows; its adapter's A is one,
# which the parts share (models/lora.py).
ROW_STACKED, SHARED = ("lora_B.weight", "weight"), "lora_A.weight"  # longest suffix first


def fused_parts(name, config):
    """((the part's HF name, first row, rows), ...) of a fused Hugging Face tensor (rows None: the whole tensor, a
    shared adapter A, held by the first part); None for any other name."""
    match = _DECODER.match(name)
    suffix = next((s for s in (SHARED, *ROW_STACKED) if match and match.group(2).endswith(f".{s}")), None)
    parts = fused_projections(config).get(match.group(2).removesuffix(f".{suffix}")) if suffix else None
    if parts is None:
        return None
    prefix = f"model.layers.{match.group(1)}."
    if suffix == SHARED:
        return ((f"{prefix}{parts[0][0]}.{suffix}", 0, None),)
    starts = [sum(rows for _, rows in parts[:i]) for i in range(len(parts))]
    return tuple((f"{prefix}{part}.{suffix}", start, rows) for (part, rows), start in zip(parts, starts))


def split_fused(state, config):
    """{HF name: tensor} with each fused tensor replaced by its parts (views), as the pipeline names them."""
    split = {}
    for name, tensor in state.items():
        parts = fused_parts(name, config)
        split.update({name: tensor} if parts is None else
                     {part: tensor if rows is None else tensor[start:start + rows] for part, start, rows in parts})
    return split


def fuse(values, config, join=lambda parts, stacked: torch.cat(parts) if stacked else parts[0]):
    """{HF name: value} with each fused weight's or adapter's parts joined back: join(the parts' values, whether
    they stack), by default their tensors' rows stacked, or the shared A."""
    fused = dict(values)
    for name, (parts, stacked) in fused_groups(config, values).items():
        fused[name] = join([fused.pop(part) for part in parts], stacked)
    return fused


def fused_groups(config, names):
    """{fused HF name: (its parts' HF names among `names`, whether they stack)} of the fused weights and adapters:
    the parts' rows stacked in order, or (a shared A) the first part's tensor, the others being the same one."""
    groups = {}
    for layer in range(config.num_hidden_layers):
        for module, parts in fused_projections(config).items():
            for suffix in (*ROW_STACKED, SHARED):
                part_names = [f"model.layers.{layer}.{part}.{suffix}" for part, _ in parts]
                present = [name for name in part_names if name in names]
                if present:
                    groups[f"model.layers.{layer}.{module}.{suffix}"] = (present, suffix != SHARED)
    return groups


# The hub's per-expert layout of each MoE family: (the layer's MoE module, {fused key: its per-expert tensors, in
# the order each expert's block stacks them}).
HUB_EXPERTS = {"mixtral": ("block_sparse_moe.", {"experts.gate_up_proj": ("w1.weight", "w3.weight"),
                                                  "experts.down_proj": ("w2.weight",)})}
HUB_EXPERTS.update(dict.fromkeys(("qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe"), ("mlp.", {
    "experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "experts.down_proj": ("down_proj.weight",)})))
_HUB_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(.+)$")


def expert_piece(name, config):
    """(the pipeline's HF name of the fused tensor, the piece's place in its stack, pieces per expert) of a hub
    per-expert tensor (model.layers.1.mlp.experts.3.up_proj.weight: layer 1's mlp.experts.gate_up_proj, piece 7,
    2); None for any other name."""
    match = _HUB_EXPERT.match(name)
    module, fused = HUB_EXPERTS.get(config.model_type, (None, {}))
    if match is None or f"{match.group(2)}." != module:
        return None
    layer, expert, part = int(match.group(1)), int(match.group(3)), match.group(4)
    for key, parts in fused.items():
        if part in parts:
            return f"model.layers.{layer}.mlp.{key}", expert * len(parts) + parts.index(part), len(parts)
    return None


def pipeline_name(name, config):
    """The pipeline's HF name of a hub name: Mixtral's old block_sparse_moe module is transformers 5's mlp."""
    module = HUB_EXPERTS.get(config.model_type, ("mlp.",))[0]
    return name.replace(f".{module}", ".mlp.", 1) if module != "mlp." and _DECODER.match(name) else name


def hub_pieces(name, config):
    """[(hub name, (expert, part, parts) or None)] of a pipeline HF name, as transformers' save_pretrained writes a
    model: a sparse layer's fused experts as each expert's projections (expert e's part p of `parts` row blocks of
    tensor[e]), Mixtral's module renamed; None: the whole tensor."""
    module, fused = HUB_EXPERTS.get(config.model_type, ("mlp.", {}))
    match = _DECODER.match(name)
    if match is None or not match.group(2).startswith("mlp."):
        return [(name, None)]
    layer, key = int(match.group(1)), match.group(2).removeprefix("mlp.")
    prefix = f"model.layers.{layer}.{module}"
    if key not in fused or not architecture_of(config).sparse_layers[layer]:
        return [(f"{prefix}{key}", None)]
    parts = fused[key]
    return [(f"{prefix}experts.{expert}.{part}", (expert, index, len(parts)))
            for expert in range(architecture_of(config).moe.num_experts) for index, part in enumerate(parts)]


def hub_piece(tensor, piece):
    """The view of a fused tensor that a hub_pieces entry names."""
    if piece is None:
        return tensor
    expert, index, parts = piece
    return tensor[expert].chunk(parts)[index]


# The multi-token-prediction layers a DeepSeek-V3 or GLM-4.5 checkpoint ships after its decoder layers
# (num_nextn_predict_layers of them, model.layers.{L}.* on): transformers' CausalLM forward never runs them (they
# serve speculative decoding), nor does the pipeline; conversion keeps their tensors as they are, in this file of
# the converted tag, and export writes them back.
MTP_FILE_NAME = "mtp_layers.safetensors"


def is_multi_token_prediction(name, config):
    """Whether a Hugging Face weight belongs to a multi-token-prediction layer."""
    match = _DECODER.match(name)
    extra = getattr(config, "num_nextn_predict_layers", 0) or 0
    return bool(match) and config.num_hidden_layers <= int(match.group(1)) < config.num_hidden_layers + extra
