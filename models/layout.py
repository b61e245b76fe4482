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


def fused_parts(name, config):
    """((the part's HF name, first row, rows), ...) of a fused Hugging Face weight; None for any other name."""
    match = _DECODER.match(name)
    parts = fused_projections(config).get(match.group(2)) if match else None
    if parts is None:
        return None
    starts = [sum(rows for _, rows in parts[:i]) for i in range(len(parts))]
    return tuple((f"model.layers.{match.group(1)}.{key}", start, rows) for (key, rows), start in zip(parts, starts))


def split_fused(state, config):
    """{HF name: tensor} with each fused weight replaced by its parts (views), as the pipeline names them."""
    split = {}
    for name, tensor in state.items():
        parts = fused_parts(name, config)
        split.update({name: tensor} if parts is None else
                     {part: tensor[start:start + rows] for part, start, rows in parts})
    return split


def fused_names(config):
    """{fused HF name: [its parts' HF names, in order]} of every decoder layer."""
    fused = {}
    for layer in range(config.num_hidden_layers):
        for key, parts in fused_projections(config).items():
            fused[f"model.layers.{layer}.{key}"] = [f"model.layers.{layer}.{part}" for part, _ in parts]
    return fused

