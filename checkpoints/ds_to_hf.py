"""DeepSpeed per-layer files (a converted directory or a training checkpoint) back to a Hugging Face directory:
sharded safetensors, index, config and tokenizer. Layer files are memory-mapped, so memory holds one shard; a
tensor-parallel checkpoint's per-rank slices are merged back into whole weights. A LoRA checkpoint leaves as a peft
adapter directory, or merged into the base it was trained on."""
import copy
import functools
import glob
import json
import os
import sys

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from checkpoints.files import (check_output_dir, copy_model_side_files, copy_tokenizer_files, read_latest,
                               staged_directory)
from checkpoints.integrity import (manifest_digest, no_manifest_note, read_by_export, verify_directory,
                                   verify_model_side_files)
from checkpoints.hf_to_ds import SAFETENSORS_DTYPES, safetensors_entries
from checkpoints.layer_files import layer_files_and_expert_shards, load_weights_only
from checkpoints.mtp_tensors import MTP_PREFIX, shared_copies
from models.architecture import architecture_of
from models.layout import (CARRIED_FILE_NAME, HUB_LAYOUT_KEY, PLAIN_LAYOUT, HubLayout, check_convertible, fuse,
                           hf_name_of_layer_key, hub_piece, hub_pieces, joined_per_layer_tensor, layer_indices_with_files,
                           per_expert_pieces, PER_LAYER_PREFIX, PER_LAYER_TENSORS, text_config_of)
from models.lora import EXPERT_ADAPTER, NO_LORA, LoraSettings, add_adapters, peft_adapters
from models.multi_token_prediction import MTP_LAYOUTS, mtp_layers_of, mtp_layout_of
from models.pipeline_layers import layers_on_meta
from models.tensor_parallel import TensorParallel, joined_shards

PEFT_PREFIX = "base_model.model."  # peft's name of the wrapped model in an adapter's weights


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


def layer_files(tag_dir, index, config):
    """The files of one layer: one whole-layer file, or one per tensor-parallel rank (layer_XX-model_YY-...), and
    the expert shards of a checkpoint saved under expert parallelism."""
    paths = sorted(glob.glob(os.path.join(tag_dir, f"layer_{index:02d}-*model_states.pt")))
    if not paths:
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tag_dir, "layer_*")))
        raise FileNotFoundError(f"no layer file for layer {index} in {tag_dir} (num_hidden_layers="
                                f"{config.num_hidden_layers} in config.json); layer files present: {found}")
    return paths


def split_dims_of(config, size, lora):
    """{pipeline index: {key: the dimension tensor parallelism over `size` ranks splits it along, or None}}: a
    buffer (DeepSeek-V3's correction bias) is whole on every rank. A tensor cut per block along it (the linear
    attention's q, k, v channels) names the blocks in split_blocks_of."""
    return {i: {k: getattr(p, "tensor_parallel_dim", None) for k, p in [*m.named_parameters(), *m.named_buffers()]}
            for i, m in layers_with_adapters(config, size, lora).items()}


def split_blocks_of(config, size, lora):
    """{pipeline index: {key: the whole sizes of the blocks along its split dimension that split apart}} of the
    tensors tensor parallelism over `size` ranks cuts per block (models/tensor_parallel.py shard_of; in_proj_qkv's
    adapter's B as its projection)."""
    return {i: {k: p.tensor_parallel_blocks for k, p in m.named_parameters() if hasattr(p, "tensor_parallel_blocks")}
            for i, m in layers_with_adapters(config, size, lora).items()}


def layers_with_adapters(config, size, lora):
    """{pipeline index: layer on the meta device} split over `size` tensor-parallel ranks, with lora's adapters."""
    layers = layers_on_meta(with_multi_token_prediction(config), TensorParallel(size))
    if lora.enabled:  # one decoder layer of each kind stands for all of that kind
        for decoder in {id(m): m for i, m in layers.items() if 1 <= i <= config.num_hidden_layers}.values():
            add_adapters(decoder, lora, config, size)
    return layers


def with_multi_token_prediction(config):
    """The config with its MTP layer trained, where it has one the pipeline trains (its final norm's layer then
    holds it, so that a checkpoint's trained MTP layer's split dimensions are known); as it is otherwise."""
    if config.model_type not in MTP_LAYOUTS or mtp_layers_of(config) != 1:
        return config
    trained = copy.deepcopy(config)
    trained.mtp_loss_scale = 1.0
    return trained


def read_hf_tensors(tag_dir, config, lora=NO_LORA, layout=PLAIN_LAYOUT):
    """{hub name: a function returning the tensor} and {hub name: a meta tensor of its shape} (to plan the output
    shards without reading anything), the names those of `layout`'s checkpoint. Layer files are memory-mapped; the
    slices of a tensor-parallel checkpoint are concatenated along each weight's split dimension only when its
    output shard is written. lora: the adapters a LoRA checkpoint's layer files hold (and nothing else), under the
    pipeline's names."""
    tensors, shapes = {}, {}
    split_dims = {}
    for index in layer_indices_with_files(config.num_hidden_layers, config.tie_word_embeddings):
        paths, shard_paths = layer_files_and_expert_shards(layer_files(tag_dir, index, config))
        slices = [load_weights_only(p) for p in paths]
        shards = [load_weights_only(p) for p in shard_paths]
        for key, first in (shards[0].items() if shards else ()):
            name = pipeline_name_of_layer_key(index, key, config)
            tensors[name] = ExpertShards([shard[key] for shard in shards])
            shapes[name] = torch.empty((first.shape[0] * len(shards), *first.shape[1:]), dtype=first.dtype,
                                       device="meta")
        if len(slices) > 1 and len(slices) not in split_dims:
            split_dims[len(slices)] = split_dims_of(config, len(slices), lora), split_blocks_of(config, len(slices),
                                                                                            lora)
        for key, first in slices[0].items():
            name = pipeline_name_of_layer_key(index, key, config)
            dims, blocks = split_dims[len(slices)] if len(slices) > 1 else ({}, {})
            dim = dims[index][key] if len(slices) > 1 else None
            if dim is None:
                tensors[name] = functools.partial(torch.Tensor.contiguous, first)
                shape = first.shape
            else:
                tensors[name] = functools.partial(joined_shards, [s[key] for s in slices], dim,
                                                  blocks[index].get(key))
                shape = first.shape[:dim] + (first.shape[dim] * len(slices),) + first.shape[dim + 1:]
            shapes[name] = torch.empty(shape, dtype=first.dtype, device="meta")
    tensors, shapes = joined_per_layer_tensors(tensors, shapes, config)
    # Phi-3's weights and adapters, fused again
    tensors = fuse(tensors, config, lambda parts, stacked: functools.partial(concatenated, parts) if stacked else parts[0])
    if lora.enabled:
        return tensors, fuse(shapes, config)
    return under_hub_names(tensors, fuse(shapes, config), config, layout)


def joined_per_layer_tensors(tensors, shapes, config):
    """tensors and shapes with Gemma 4's per-layer embeddings, which each decoder layer's file holds its share of
    (models/layout.py PER_LAYER_TENSORS), joined back into the model-level tensors."""
    for short, dim in PER_LAYER_TENSORS.items():
        names = [f"model.layers.{layer}.{PER_LAYER_PREFIX}{short}" for layer in range(config.num_hidden_layers)]
        if names[0] not in tensors:
            continue
        parts = [tensors.pop(name) for name in names]
        part_shapes = [shapes.pop(name) for name in names]
        tensors[f"model.{short}"] = functools.partial(joined_from, parts, short)
        shapes[f"model.{short}"] = part_shapes[0] if dim is None else torch.cat(part_shapes, dim)
    return tensors, shapes


def joined_from(tensor_functions, short):
    if PER_LAYER_TENSORS[short] is None:  # a tied copy in every layer: the first's
        return tensor_functions[0]()
    return joined_per_layer_tensor(short, [tensor() for tensor in tensor_functions])
def pipeline_name_of_layer_key(index, key, config):
    """The pipeline's HF name of a layer file's key; a trained MTP layer's (the final norm's `mtp.` keys) under
    the name its checkpoint gives it (DeepSeek-V3's model.layers.{L}.*, which hub_pieces splits like a decoder
    layer's)."""
    if index == config.num_hidden_layers + 1 and key.startswith(MTP_PREFIX):
        return mtp_layout_of(config).hub_name(key.removeprefix(MTP_PREFIX))
    return hf_name_of_layer_key(index, key, config.num_hidden_layers)


def with_carried(tensors, shapes, carried, carried_shapes, config):
    """The export's tensors: the layer files' and the carried ones, a trained MTP layer's in place of the carried
    one (and the copies of the shared embedding and head its checkpoint stores, the trained ones)."""
    if any(name in carried for name in tensors):  # only a trained MTP layer's names are in both
        for copy, source in shared_copies(config).items():
            if copy in carried:  # a copy of its own: safetensors refuses two names over one storage
                carried[copy], carried_shapes[copy] = functools.partial(cloned, tensors[source]), shapes[source]
        tensors, shapes = as_carried_experts(tensors, shapes, carried, config)
    return {**carried, **tensors}, {**carried_shapes, **shapes}


def as_carried_experts(tensors, shapes, carried, config):
    """tensors and shapes with a trained MTP layer's fused experts under the names its carried file stores them by:
    one tensor per expert and projection where it holds them so (Qwen3.5-MoE's mtp.layers.0.mlp.experts.{e}.*,
    whose decoder layers' experts the hub stores fused), as they are where it holds them fused."""
    split_tensors, split_shapes = {}, {}
    for name, shape in shapes.items():
        pieces = per_expert_pieces(name, config) if name not in carried else None
        if not pieces or pieces[0][0] not in carried:
            split_tensors[name], split_shapes[name] = tensors[name], shape
            continue
        for hub_name, piece in pieces:
            split_tensors[hub_name] = functools.partial(piece_of, tensors[name], piece)
            split_shapes[hub_name] = hub_piece(shape, piece)
    return split_tensors, split_shapes


def cloned(tensor_function):
    return tensor_function().clone()


def concatenated(tensor_functions):
    return torch.cat([tensor() for tensor in tensor_functions])


def under_hub_names(tensors, shapes, config, layout):
    """tensors and shapes under the names of `layout`'s checkpoint (models/layout.py hub_pieces): the text model
    under its prefix, an MoE layer's experts one tensor per expert and projection as transformers' save_pretrained
    writes them (each read from its fused tensor as it is written) unless the checkpoint held them fused."""
    hub_tensors, hub_shapes = {}, {}
    for name, shape in shapes.items():
        for hub_name, piece in hub_pieces(name, config, layout):
            hub_tensors[hub_name] = tensors[name] if piece is None else functools.partial(piece_of, tensors[name], piece)
            hub_shapes[hub_name] = hub_piece(shape, piece)
    return hub_tensors, hub_shapes


def piece_of(tensor_function, piece):
    # a fused tensor kept in expert shards gives one expert's rows from its own shard (hub_piece indexes it)
    source = tensor_function if isinstance(tensor_function, ExpertShards) else tensor_function()
    return hub_piece(source, piece).contiguous()


class ExpertShards:
    """A fused expert tensor that a training checkpoint keeps in expert shards (models/layout.py
    expert_shard_file_name), memory-mapped: whole when called, one expert's rows when indexed by it."""

    def __init__(self, shards):
        self.shards = shards

    def __call__(self):
        return torch.cat(self.shards)

    def __getitem__(self, expert):
        rows = self.shards[0].shape[0]
        return self.shards[expert // rows][expert % rows]


def convert_ds_to_hf(ckpt_dir, output_dir, tag=None, max_shard_size="5GB", overwrite=False, verify_checksums=True,
                     merge_lora=False):
    """verify_checksums: check the files export reads against their checksums.json before reading them. A LoRA
    checkpoint exports as a peft adapter directory, or with merge_lora as the model with its adapters merged into
    the base it was trained on."""
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    side_dir = model_files_dir(ckpt_dir, tag_dir)
    record = lora_record(tag_dir)
    if merge_lora and record is None:
        raise ValueError(f"--merge_lora: checkpoint {tag_dir} holds no LoRA adapters (it is a whole model); export "
                         f"it without --merge_lora.")
    if verify_checksums:
        verify_model_side_files(side_dir)
    config = AutoConfig.from_pretrained(side_dir)  # a multimodal checkpoint's: exported as it was
    check_convertible(config)
    text_config = text_config_of(config)
    check_output_dir(output_dir, overwrite)
    if verify_checksums and not verify_directory(tag_dir, read_by_export):
        print(no_manifest_note(tag_dir), file=sys.stderr, flush=True)
    if record is None:
        layout = recorded_layout(tag_dir)
        tensors, shapes = read_hf_tensors(tag_dir, text_config, layout=layout)
    else:
        lora = LoraSettings(**{**record["lora"], "target_modules": tuple(record["lora"]["target_modules"])})
        adapters, adapter_shapes = read_hf_tensors(tag_dir, text_config, lora)
        if not merge_lora:
            return write_peft_adapter(adapters, lora, text_config, record["base_model"]["path"], side_dir,
                                      output_dir)
        tag_dir = base_tag_dir(record, tag_dir, verify_checksums)
        layout = recorded_layout(tag_dir)
        tensors, shapes = read_hf_tensors(tag_dir, text_config, layout=layout)
        tensors = merged(tensors, adapters, lora.scaling, text_config, layout)
    extra_tensors, extra_shapes = carried_tensors(tag_dir, text_config)
    tensors, shapes = with_carried(tensors, shapes, extra_tensors, extra_shapes, text_config)
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size)

    with staged_directory(output_dir) as staging:
        copy_model_side_files(side_dir, staging)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: tensors[n]() for n in names}, os.path.join(staging, filename),
                      metadata={"format": "pt"})
        if split.is_sharded:
            with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
    return output_dir


def carried_tensors(tag_dir, config):
    """{HF name: a function returning the tensor} and {HF name: a meta tensor} of the tensors conversion carried
    beside the layer files (models/layout.py CARRIED_FILE_NAME: towers, multi-token-prediction layers), as they were;
    a training checkpoint carries its base's (checkpoints/saving.py). One without DeepSeek-V3's MTP layers while the
    config names some (its base had none, or it was saved before checkpoints carried them): its export says so."""
    path = os.path.join(tag_dir, CARRIED_FILE_NAME)
    if not os.path.isfile(path):
        if getattr(config, "num_nextn_predict_layers", 0):
            print(f"note: {tag_dir} holds none of the model's {config.num_nextn_predict_layers} multi-token-prediction "
                  f"layer(s) (num_nextn_predict_layers): the export has none.", file=sys.stderr, flush=True)
        return {}, {}
    shapes = {name: torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype], device="meta")
              for name, (dtype, shape, _, _) in safetensors_entries(path).items()}
    return {name: functools.partial(stored_tensor, path, name) for name in shapes}, shapes


def recorded_layout(tag_dir):
    """The HubLayout conversion read the checkpoint with, recorded in its carried file; a plain text-only layout
    where none is (the pipeline's own families)."""
    path = os.path.join(tag_dir, CARRIED_FILE_NAME)
    if not os.path.isfile(path):
        return PLAIN_LAYOUT
    with safe_open(path, framework="pt") as handle:
        record = (handle.metadata() or {}).get(HUB_LAYOUT_KEY)
    return HubLayout.from_record(record) if record else PLAIN_LAYOUT


def stored_tensor(path, name):
    with safe_open(path, framework="pt") as handle:
        return handle.get_tensor(name)


def lora_record(tag_dir):
    """A LoRA checkpoint's record of its adapters and base (training/run_spec.py: RunSpec.lora_record), else None."""
    path = os.path.join(tag_dir, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        state = json.load(f)
    return {"lora": state["lora"], "base_model": state["base_model"]} if "lora" in state else None


def base_tag_dir(record, tag_dir, verify_checksums):
    """The converted base a LoRA checkpoint was trained on, checked to be the same (its manifest's checksum) and,
    with verify_checksums, intact."""
    base = record["base_model"]
    base_tag = os.path.join(base["path"], base["tag"])
    if manifest_digest(base_tag) != base["manifest_xxh3_128"]:
        raise ValueError(f"--merge_lora: checkpoint {tag_dir} was trained on the base {base_tag} (checksum "
                         f"{base['manifest_xxh3_128']}), which is no longer there or has changed (checksum "
                         f"{manifest_digest(base_tag) if os.path.isdir(base_tag) else 'none: missing'}); restore it "
                         f"there, or export the adapter alone (without --merge_lora).")
    if verify_checksums:
        verify_directory(base_tag, read_by_export)
    return base_tag


def merged(base_tensors, adapters, scaling, config, layout):
    """{HF name: a function returning the tensor} of the base with W + scaling * B @ A for every adapted weight
    (computed in fp32, stored in the base's dtype); an expert adapter's update per expert, on each of the tensors
    save_pretrained writes its fused tensor as (models/layout.py hub_pieces)."""
    tensors = dict(base_tensors)
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            weight_name = layout.to_hub(f"{module}.weight")
            a, b, weight = adapters[name], adapters[f"{module}.lora_B.weight"], base_tensors[weight_name]
            tensors[weight_name] = functools.partial(merged_weight, weight, a, b, scaling)
        elif EXPERT_ADAPTER.match(name) and ".lora_A." in name:
            fused = name.replace(".lora_A.", ".")
            a, b = adapters[name], adapters[name.replace(".lora_A.", ".lora_B.")]
            transposed = architecture_of(config).moe.transposed
            for hub_name, piece in hub_pieces(fused, config, layout):
                tensors[hub_name] = functools.partial(merged_piece, base_tensors[hub_name], a, b, scaling, piece,
                                                      transposed)
    return tensors


def merged_weight(weight, a, b, scaling):
    base = weight()
    return (base.float() + scaling * (b().float() @ a().float())).to(base.dtype)


def merged_piece(weight, a, b, scaling, piece, transposed):
    """A hub tensor of fused experts (piece None: all of them, GPT-OSS's stored [E, in, out]; else one expert's
    part) with their adapters' update B_e A_e."""
    base = weight()
    if piece is None:
        update = torch.bmm(b().float(), a().float())
        update = update.transpose(-2, -1) if transposed else update
    else:
        expert, index, parts = piece
        update = (b()[expert].float() @ a()[expert].float()).chunk(parts)[index]
    return (base.float() + scaling * update).to(base.dtype)


def write_peft_adapter(adapters, lora, config, base_path, side_dir, output_dir):
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors, the tokenizer) that
    peft.PeftModel.from_pretrained loads onto the Hugging Face base."""
    with staged_directory(output_dir) as staging:
        save_file({PEFT_PREFIX + name: tensor.contiguous() for name, tensor in
                   peft_adapters({name: tensor() for name, tensor in adapters.items()}).items()},
                  os.path.join(staging, "adapter_model.safetensors"), metadata={"format": "pt"})
        lora.peft_config(config, base_model_name_or_path=base_path).save_pretrained(staging)
        copy_tokenizer_files(side_dir, staging)
    return output_dir
