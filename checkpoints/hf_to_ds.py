"""Hugging Face weights to DeepSpeed per-layer files, streamed one layer at a time.

Every weight's name and shape is checked against the config before anything is written (safetensors headers and
memory-mapped .bin files give both without reading the data); then each layer file is written from tensors read
straight out of the shards, so memory holds one layer, not the model nor the pages of the shards read so far.
"""
import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import json
import os
import struct
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from safetensors import safe_open
from transformers import AutoConfig

from checkpoints.files import (LATEST, check_output_dir, copy_model_side_files, copy_tokenizer_files,
                               has_tokenizer_files, staged_directory)
from checkpoints.integrity import file_checksum, write_manifest
from checkpoints.layer_files import copy_range, load_weights_only, read_exactly, write_layer_file_from_ranges
from checkpoints.quantized_weights import (check_scales, dequantized, drop_quantization_config, fp8_block_size,
                                          scaled_weights, unscaled_error)
from models.hf_weights import find_weight_files
from models.layout import (CARRIED_FILE_NAME, HUB_LAYOUT_KEY, HUB_LAYOUTS, check_convertible,
                           expert_piece, fused_parts, hub_layout_of, hub_pieces, is_carried, layer_file_path,
                           layer_indices_with_files, layer_of_hf_name, num_experts, per_layer_shares, pipeline_name,
                           text_config_of)
from models.pipeline_layers import layers_on_meta

IMPORT_TAG = "global_step0"


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def safetensors_entries(path):
    """{name: (dtype string, shape, byte offset in the file, byte length)} from a safetensors header: an 8-byte
    little-endian header size, the JSON header, then the data its offsets point into. A file too short for what
    its header describes (a cut download or copy) is refused here, before anything is written."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            if 8 + header_size > size:
                raise ValueError(f"its header claims {header_size} bytes")
            header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        start = 8 + header_size
        entries = {name: (entry["dtype"], tuple(entry["shape"]), start + entry["data_offsets"][0],
                          entry["data_offsets"][1] - entry["data_offsets"][0]) for name, entry in header.items()}
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"'{path}' is not a valid safetensors file ({error}); download or copy it again.") from None
    end = max((offset + length for _, _, offset, length in entries.values()), default=start)
    if end > size:
        raise ValueError(f"'{path}' is truncated: its header places tensor data up to byte {end}, the file has "
                         f"{size} bytes; download or copy it again.")
    return entries


class WeightReader:
    """Name -> tensor across shards; a tensor's bytes are read only when it is asked for. safetensors tensors are
    read straight from the file into a new tensor, without mapping the shard, so memory holds what is asked for
    and not the pages of every shard touched so far; .bin shards are memory-mapped. quantization: (block, dtype) of
    a block-quantised fp8 checkpoint, whose weights are read dequantised to dtype (checkpoints/quantized_weights.py)
    and whose scales are no weights of their own."""

    def __init__(self, files, quantization=None):
        self.file_of = {}
        self._entries = {}
        self._bin_shards = {}
        for path in files:
            if path.endswith(".safetensors"):
                entries = safetensors_entries(path)
                self._entries.update(entries)
            else:
                entries = self._bin_shards[path] = load_weights_only(path)
            for name in entries:
                self.file_of[name] = path
        self.scale_of = scaled_weights(self.file_of) if quantization else {}
        self._scale_file_of = {scale: self.file_of.pop(scale) for scale in self.scale_of.values()}
        self.block, self.dtype = quantization or (None, None)
        unscaled = next((name for name, (dtype, *_) in self._entries.items()
                         if dtype.startswith("F8") and name not in self.scale_of), None)
        if unscaled:
            raise ValueError(unscaled_error(unscaled, self._entries[unscaled][0], self.file_of[unscaled], quantization))
        for name, scale in self.scale_of.items():
            check_scales(name, self.shape(name), self._entries[scale][1], self.block)

    def tensor_dtype(self, name):
        """The dtype tensor(name) returns: a dequantised weight's, else the stored one."""
        if name in self.scale_of:
            return self.dtype
        if name in self._entries:
            return SAFETENSORS_DTYPES[self._entries[name][0]]
        return self._bin_shards[self.file_of[name]][name].dtype

    def shape(self, name):
        if name in self._entries:
            return self._entries[name][1]
        return tuple(self._bin_shards[self.file_of[name]][name].shape)

    def byte_range(self, name, rows=None):
        """(dtype, shape, path, byte offset) of a safetensors tensor (rows: (first, count), a block of its rows)
        whose bytes can be copied as they are; else None (a block of columns too)."""
        entry = self._entries.get(name)
        if entry is None or entry[0] not in SAFETENSORS_DTYPES or name in self.scale_of or isinstance(rows, Columns):
            return None
        dtype, shape, offset, _ = entry
        dtype = SAFETENSORS_DTYPES[dtype]
        if rows is not None:  # a row block of a row-major tensor is one byte range
            first, count = rows
            row_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
            shape, offset = (count, *shape[1:]), offset + first * row_bytes
        return dtype, shape, self.file_of[name], offset

    def tensor(self, name, rows=None):
        if isinstance(rows, Columns):  # read as a slice: only those columns' bytes of each row
            if name in self._entries and name not in self.scale_of:
                with safe_open(self.file_of[name], framework="pt") as handle:
                    return handle.get_slice(name)[:, rows.first:rows.first + rows.count].contiguous()
            return self.tensor(name).narrow(1, rows.first, rows.count).contiguous()
        if rows is not None:
            first, count = rows
            return self.tensor(name)[first:first + count].clone()
        if name in self.scale_of:
            return dequantized(self.stored(name), self.stored(self.scale_of[name]), self.block, self.dtype)
        return self.stored(name)

    def stored(self, name):
        """A tensor as its file stores it."""
        path = self.file_of.get(name) or self._scale_file_of[name]
        if name not in self._entries:
            tensor = self._bin_shards[path][name]
            # A .bin tensor may be a view into a larger shared storage; torch.save would write all of it.
            return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor
        dtype, shape, offset, length = self._entries[name]
        if dtype not in SAFETENSORS_DTYPES:
            with safe_open(path, framework="pt") as handle:
                return handle.get_tensor(name)
        tensor = torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype])  # host memory: conversion runs on the CPU
        if length:
            with open(path, "rb") as f:
                read_exactly(f.fileno(), tensor.reshape(-1).view(torch.uint8).numpy(), offset)
        return tensor


class Columns(NamedTuple):
    """A block of a 2-D tensor's columns that a layer file holds (Gemma 4's per-layer table: each decoder layer's)."""
    first: int
    count: int


def expected_layer_shapes(config):
    """({layer index: {key: shape}}, the patterns of the hub names the model ignores on load): of the pipeline's
    layers, or for a family converted by its hub layout (models/layout.py HUB_LAYOUTS) of transformers' own text
    model, built on the meta device, whose names are the pipeline's HF names."""
    if config.model_type not in HUB_LAYOUTS:
        layers = layers_on_meta(config)
        return {i: {k: tuple(v.shape) for k, v in m.state_dict().items()} for i, m in layers.items()}, ()
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = defaultdict(dict)
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding's
        for index, key, dim, _, width in per_layer_shares(name, config) or ():
            expected[index][key] = tuple(width if d == dim else size for d, size in enumerate(tensor.shape))
        if per_layer_shares(name, config) is not None:
            continue
        located = layer_of_hf_name(name, config.num_hidden_layers, config.tie_word_embeddings)
        if located is None:
            raise ValueError(f"transformers' {type(model).__name__} holds {name}, which the layer index map "
                             f"(models/layout.py) places in no layer; it needs a place there before conversion.")
        expected[located[0]][located[1]] = tuple(tensor.shape)
    return dict(expected), tuple(model._keys_to_ignore_on_load_unexpected or ())


def plan_layers(reader, config, layout, expected, unused_patterns=()):
    """({layer index: {key: [(hub name, rows), ...]}}, [hub names of the tensors carried as they are]), after
    checking every name and shape against the config (config: the text model's; expected and unused_patterns:
    expected_layer_shapes'): the pieces whose rows the key's tensor stacks, in order (one, but an MoE layer's experts
    from the hub's per-expert tensors); rows: None, or (first, count), the block of a fused weight (Phi-3's) that
    the key holds."""
    num_layers, tied = config.num_hidden_layers, config.tie_word_embeddings
    plan, carried, unknown, mismatched = defaultdict(dict), [], [], []
    stacks = defaultdict(dict)  # {fused HF name: {place in its stack: hub name}}: the hub's per-expert tensors
    for name in sorted(reader.file_of):
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some old checkpoints saved, derived from the config
        if is_carried(name, config, layout, unused_patterns):
            carried.append(name)
            continue
        hf_name = layout.from_hub(name)  # the pipeline's name of the hub's
        piece = expert_piece(hf_name, config) if hf_name else None
        if piece is not None:
            fused, place, per_expert = piece
            located = layer_of_hf_name(fused, num_layers, tied)
            shape = expected.get(located[0], {}).get(located[1]) if located else None
            if shape is None or place >= shape[0] * per_expert:  # a dense layer's, or an expert past num_experts
                unknown.append(f"{name} ({os.path.basename(reader.file_of[name])})")
            elif reader.shape(name) != (shape[1] // per_expert, *shape[2:]):
                mismatched.append(f"{name}: {reader.shape(name)} in {os.path.basename(reader.file_of[name])}, "
                                  f"config expects {(shape[1] // per_expert, *shape[2:])}")
            else:
                stacks[fused][place] = name
            continue
        shares = per_layer_shares(hf_name, config) if hf_name else None
        if shares is not None:  # Gemma 4's per-layer embeddings: each decoder layer's share in its file
            whole = tuple(config.num_hidden_layers * size if d == shares[0][2] else size
                          for d, size in enumerate(expected[shares[0][0]][shares[0][1]]))
            if reader.shape(name) != whole:
                mismatched.append(f"{name}: {reader.shape(name)} in {os.path.basename(reader.file_of[name])}, "
                                  f"config expects {whole}")
                continue
            for index, key, dim, first, width in shares:
                plan[index][key] = [(name, None if dim is None else (first, width) if dim == 0 else
                                     Columns(first, width))]
            continue
        parts = fused_parts(hf_name, config) if hf_name else None
        located = hf_name and layer_of_hf_name(pipeline_name(hf_name, config) if parts is None else parts[0][0],
                                               num_layers, tied)
        if not located or located[1] not in expected[located[0]]:
            unknown.append(f"{name} ({os.path.basename(reader.file_of[name])})")
            continue
        index, key = located
        if tied and hf_name == "lm_head.weight":  # tied: the embedding already holds this weight
            continue
        blocks = {key: [(name, None)]} if parts is None else {
            layer_of_hf_name(part, num_layers, tied)[1]: [(name, (first, rows))] for part, first, rows in parts}
        shape = expected[index][key] if parts is None else (sum(rows for _, _, rows in parts),
                                                            *expected[index][key][1:])
        if reader.shape(name) != shape:
            mismatched.append(f"{name}: {reader.shape(name)} in {os.path.basename(reader.file_of[name])}, "
                              f"config expects {shape}")
            continue
        plan[index].update(blocks)
    absent = []
    for fused, pieces in stacks.items():
        index, key = layer_of_hf_name(fused, num_layers, tied)
        names = [hub_name for hub_name, _ in hub_pieces(fused, config, layout)]
        absent += [name for place, name in enumerate(names) if place not in pieces]
        if len(pieces) == len(names):
            plan[index][key] = [(pieces[place], None) for place in range(len(names))]
    if unknown:
        raise ValueError(f"weights not part of a {config.model_type} model with num_hidden_layers={num_layers}: "
                         f"{', '.join(unknown[:20])}{' ...' if len(unknown) > 20 else ''}; check config.json.")
    if mismatched:
        raise ValueError("weight shapes do not match config.json: " + "; ".join(mismatched[:20]))
    if absent:
        raise ValueError(f"expert weights missing: {', '.join(absent[:20])}{' ...' if len(absent) > 20 else ''} (an "
                         f"incomplete checkpoint, or num_experts={num_experts(config)} in config.json is wrong).")
    missing = [f"layer {i}: {sorted(set(expected[i]) - set(plan[i]))}"
               for i in layer_indices_with_files(num_layers, tied) if set(plan[i]) != set(expected[i])]
    if missing:
        raise ValueError(f"weights missing for {', '.join(missing[:20])} (num_hidden_layers={num_layers} in "
                         f"config.json).")
    return plan, carried


def write_module_only_states(tag_dir):
    """The small file DeepSpeed's load_checkpoint(load_module_only=True) opens before the per-layer files."""
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    torch.save({"module": None, "dp_world_size": 1, "mp_world_size": 1, "ds_version": importlib.metadata.version("deepspeed")},
               path)
    return path


def release_freed_memory():
    """Hand the layer just written back to the OS. glibc keeps freed blocks below its mmap threshold (up to 32 MB)
    in the heap, where a stream of layers fragments memory towards the model's size."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


@contextlib.contextmanager
def zip_checksums_off():
    """torch.save without the zip's CRC-32 of every record: computing it triples the time to write a layer file,
    and torch.load does not check it (zip tools would warn)."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def write_layer_file(reader, sources, path, shapes):
    """sources: {key: [(HF name, rows), ...]}, the pieces each key stacks; shapes: {key: its shape}. safetensors
    bytes are copied by the kernel; .bin tensors go through torch.save."""
    ranges = {key: [reader.byte_range(name, rows) for name, rows in pieces] for key, pieces in sources.items()}
    if all(all(pieces) and len({piece[0] for piece in pieces}) == 1 for pieces in ranges.values()):
        write_layer_file_from_ranges(path, {key: (pieces[0][0], shapes[key], [(p[2], p[3]) for p in pieces])
                                            for key, pieces in ranges.items()})
        return
    layer = {key: torch.cat([reader.tensor(name, rows) for name, rows in pieces]).view(shapes[key])
             if len(pieces) > 1 else reader.tensor(*pieces[0]) for key, pieces in sources.items()}
    torch.save(layer, path)
    del layer
    release_freed_memory()


STORED_DTYPE_NAMES = {**{dtype: name for name, dtype in SAFETENSORS_DTYPES.items()},
                      torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_carried_file(reader, names, path, metadata):
    """A safetensors file of the tensors `names` (models/layout.py CARRIED_FILE_NAME) as the reader reads them,
    streamed: a safetensors tensor's bytes are copied by the kernel, any other (a .bin shard's, a dequantised one)
    read and written one at a time, so memory never holds them all (Qwen3.5-397B's MTP layer is 13 GB). The
    largest elements first keep every tensor aligned to its element size, as safetensors' own writer does."""
    order = sorted(names, key=lambda name: (-reader.tensor_dtype(name).itemsize, name))
    header, offsets, end = {"__metadata__": metadata}, {}, 0
    for name in order:
        dtype, shape = reader.tensor_dtype(name), reader.shape(name)
        offsets[name], end = end, end + torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": STORED_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offsets[name], end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as target:
        target.write(struct.pack("<Q", len(text)) + text)
        start = target.tell()
        for name in order:
            stored = reader.byte_range(name)
            if stored is None:
                target.seek(start + offsets[name])
                target.write(memoryview(reader.tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy()))
            else:
                dtype, shape, source_path, source_offset = stored
                with open(source_path, "rb") as source:
                    copy_range(source.fileno(), source_offset, target.fileno(), start + offsets[name],
                               torch.Size(shape).numel() * dtype.itemsize)
        target.truncate(start + end)


def convert_hf_to_ds(model_dir, output_dir, overwrite=False, tokenizer_name_or_path=None):
    """tokenizer_name_or_path: a directory whose tokenizer files are copied beside the layer files instead of
    model_dir's (for checkpoints that keep their tokenizer elsewhere)."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory '{model_dir}' does not exist.")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"'{model_dir}' has no config.json: not a Hugging Face model directory.")
    if tokenizer_name_or_path and not has_tokenizer_files(tokenizer_name_or_path):
        raise FileNotFoundError(f"--tokenizer_name_or_path '{tokenizer_name_or_path}' holds no tokenizer files "
                                f"(tokenizer.json, tokenizer.model, tokenizer_config.json, ...); point it at the "
                                f"directory of the model's tokenizer, or leave it out to copy '{model_dir}''s.")
    config = AutoConfig.from_pretrained(model_dir)
    block = fp8_block_size(config)
    if block:  # read dequantised: the converted model is not quantised
        config.quantization_config = None
    check_convertible(config)
    check_output_dir(output_dir, overwrite)
    reader = WeightReader(find_weight_files(model_dir), (block, config.dtype or torch.bfloat16) if block else None)
    text_config = text_config_of(config)
    layout = hub_layout_of(config.model_type, reader.file_of)
    expected, unused_patterns = expected_layer_shapes(text_config)
    plan, carried = plan_layers(reader, text_config, layout, expected, unused_patterns)

    with staged_directory(output_dir) as staging:
        tag_dir = os.path.join(staging, IMPORT_TAG)
        os.makedirs(tag_dir)
        # Each file is hashed by a second thread while the next one is written, its pages still in the page cache
        # (copy_file_range never brings them into this process; reading and hashing release the GIL).
        with zip_checksums_off(), ThreadPoolExecutor(max_workers=1) as hasher:
            checksums = {}
            for index in sorted(plan):
                path = layer_file_path(tag_dir, index)
                write_layer_file(reader, plan[index], path, expected[index])
                checksums[os.path.basename(path)] = hasher.submit(file_checksum, path)
            if carried or config.model_type in HUB_LAYOUTS:  # the layout recorded for the export to write back
                path = os.path.join(tag_dir, CARRIED_FILE_NAME)
                record = {HUB_LAYOUT_KEY: layout.record()} if config.model_type in HUB_LAYOUTS else {}
                write_carried_file(reader, carried, path, {"format": "pt", **record})
                checksums[os.path.basename(path)] = hasher.submit(file_checksum, path)
            path = write_module_only_states(tag_dir)
            checksums[os.path.basename(path)] = hasher.submit(file_checksum, path)
            write_manifest(tag_dir, {name: future.result() for name, future in checksums.items()})
        copy_model_side_files(model_dir, staging, tokenizer=not tokenizer_name_or_path)
        if block:
            drop_quantization_config(os.path.join(staging, "config.json"))
        if tokenizer_name_or_path:
            copy_tokenizer_files(tokenizer_name_or_path, staging)
        write_manifest(staging, {name: file_checksum(os.path.join(staging, name)) for name in os.listdir(staging)
                                 if os.path.isfile(os.path.join(staging, name))})
        with open(os.path.join(staging, LATEST), "w") as f:
            f.write(IMPORT_TAG)
    return output_dir
