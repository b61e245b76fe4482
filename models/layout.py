"""The layer index map: which pipeline layer owns which Hugging Face weight. Both conversion directions and
post-init loading go through here, so the map exists once.

| index    | layer            | HF weight names                                       |
| 0        | embedding        | model.embed_tokens.weight                             |
| 1 .. L   | decoder layer i-1| model.layers.{i-1}.*  (prefix stripped)               |
| L+1      | final norm       | model.norm.weight                                     |
| L+2      | LM head          | lm_head.weight (no file when tied: layer 0 holds it)  |

Phi-3's fused qkv_proj and gate_up_proj are held as their parts, q/k/v_proj and gate/up_proj (row blocks:
models/architecture.py's fused_projections), split on conversion and fused again on export.
"""
import os
import re

import torch

from models.architecture import fused_projections

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
