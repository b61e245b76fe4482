"""DeepSpeed per-layer files (a converted directory or a training checkpoint) back to a Hugging Face directory:
sharded safetensors, index, config and tokenizer. Layer files are memory-mapped, so memory holds one shard."""
import glob
import json
import os

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import AutoConfig

from checkpoints.files import check_output_dir, copy_model_side_files, read_latest, staged_directory
from models.layout import hf_name_of_layer_key, layer_file_path, layer_indices_with_files
from models.llama import check_model_config


def resolve_tag_dir(ckpt_dir, tag=None):
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory '{ckpt_dir}' does not exist.")
    tag = tag or read_latest(ckpt_dir)
    if tag is None:
        raise FileNotFoundError(f"'{ckpt_dir}' has no 'latest' file; pass --tag with one of: "
                                f"{sorted(d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d)))}")
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint tag directory '{tag_dir}' does not exist.")
    return tag_dir


def model_files_dir(ckpt_dir, tag_dir):
    """Where config and tokenizer live: beside the layer files (training checkpoints) or at the top (conversion)."""
    for candidate in (tag_dir, ckpt_dir):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise FileNotFoundError(f"no config.json in '{tag_dir}' or '{ckpt_dir}'.")


def read_hf_state_dict(tag_dir, config):
    """HF name -> memory-mapped tensor, for every layer file of the model."""
    state = {}
    for index in layer_indices_with_files(config.num_hidden_layers, config.tie_word_embeddings):
        path = layer_file_path(tag_dir, index)
        if not os.path.isfile(path):
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tag_dir, "layer_*")))
            raise FileNotFoundError(f"missing {path} (num_hidden_layers={config.num_hidden_layers} in config.json); "
                                    f"layer files present: {found}")
        layer = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        for key, tensor in layer.items():
            state[hf_name_of_layer_key(index, key, config.num_hidden_layers)] = tensor
    return state


def convert_ds_to_hf(ckpt_dir, output_dir, tag=None, max_shard_size="5GB", overwrite=False):
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    side_dir = model_files_dir(ckpt_dir, tag_dir)
    config = AutoConfig.from_pretrained(side_dir)
    check_model_config(config)
    check_output_dir(output_dir, overwrite)
    state = read_hf_state_dict(tag_dir, config)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)

    with staged_directory(output_dir) as staging:
        copy_model_side_files(side_dir, staging)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: state[n].contiguous() for n in names}, os.path.join(staging, filename),
                      metadata={"format": "pt"})
        if split.is_sharded:
            with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
    return output_dir
