"""A Hugging Face directory's weights, by pipeline layer: which files hold them, and each layer's state dict read
through the name map conversion uses (models/layout.py), for the single-device model (models/causal_lm.py).
Conversion (checkpoints/hf_to_ds.py) streams the same files into layer files without holding a layer twice."""
import json
import os
from collections import defaultdict

import torch
from safetensors import safe_open

from models.layout import (HUB_LAYOUTS, expert_piece, fused_parts, hub_layout_of, is_carried, is_multi_token_prediction,
                           layer_of_hf_name, pipeline_name, text_config_of)


def find_weight_files(model_dir):
    """Weight files of a Hugging Face directory, in the order its index (if any) lists them."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = os.path.join(model_dir, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
            if missing:
                raise FileNotFoundError(f"{index_path} lists shards that do not exist: {missing}")
            return [os.path.join(model_dir, s) for s in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(model_dir, single)):
            return [os.path.join(model_dir, single)]
    raise FileNotFoundError(f"no weights in '{model_dir}': expected model.safetensors, "
                            f"model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json.")


def hf_tensors(files):
    """{HF name: tensor} of weight files: safetensors memory-mapped, .bin shards with torch.load(weights_only=True),
    which unpickles tensors and plain containers only, never code."""
    tensors = {}
    for path in files:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
        else:
            tensors.update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return tensors


def text_model_tensors(tensors, config):
    """{the pipeline's HF name: tensor} of the text model among a checkpoint's {hub name: tensor} (config: the
    checkpoint's own): for a family converted by its hub layout (models/layout.py HUB_LAYOUTS) renamed from the
    layout the checkpoint has, what conversion carries (towers, MTP layers) left out; the others' as they are."""
    if config.model_type not in HUB_LAYOUTS:
        return tensors
    layout, text = hub_layout_of(config.model_type, tensors), text_config_of(config)
    return {layout.from_hub(name): tensor for name, tensor in tensors.items()
            if not is_carried(name, text, layout) and layout.from_hub(name) is not None}


def layer_states(tensors, config):
    """{pipeline layer index: its state dict} of Hugging Face tensors: a fused weight split into its parts
    (Phi-3's), the hub's per-expert tensors stacked into the fused ones, a tied LM head left to the embedding, the
    multi-token-prediction layers (which no forward runs) and rotary buffers left out. A name no layer holds is
    refused, naming it."""
    num_layers, tied = config.num_hidden_layers, config.tie_word_embeddings
    states, stacks, unknown = defaultdict(dict), defaultdict(dict), []
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq") or is_multi_token_prediction(name, config):
            continue
        if tied and name == "lm_head.weight":
            continue
        piece = expert_piece(name, config)
        if piece is not None:
            fused, place, per_expert = piece
            stacks[(fused, per_expert)][place] = tensor
            continue
        parts = fused_parts(name, config) or ((name, 0, None),)
        for part, first, rows in parts:
            located = layer_of_hf_name(pipeline_name(part, config), num_layers, tied)
            if located is None:
                unknown.append(name)
                break
            states[located[0]][located[1]] = tensor if rows is None else tensor[first:first + rows]
    for (fused, per_expert), pieces in stacks.items():
        index, key = layer_of_hf_name(fused, num_layers, tied)
        ordered = [pieces[place] for place in sorted(pieces)]
        states[index][key] = torch.cat(ordered).view(len(ordered) // per_expert, -1, *ordered[0].shape[1:])
    if unknown:
        raise ValueError(f"weights not part of a {config.model_type} model with num_hidden_layers={num_layers}: "
                         f"{', '.join(sorted(unknown)[:20])}; check config.json.")
    return dict(states)

