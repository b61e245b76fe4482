"""Reading a per-layer file (torch.save format) straight into a built layer's parameters, and writing one from
byte ranges of other files.

torch.load(mmap=True) maps the file and locates every tensor without reading its bytes; each tensor is then read
with pread directly into the parameter it belongs to. Nothing is staged on the CPU: loading a stage costs the stage
itself, not the stage plus a layer (load_state_dict from a loaded or mapped file keeps the whole layer resident until
the next one). A parameter on an accelerator gets its bytes through one host buffer, the size of the file's largest
tensor, then a copy to the device.
"""
import errno
import glob
import os
import pickle
import re

import torch

from checkpoints.mtp_tensors import MTP_PREFIX, carried_mtp_state
from errors import ConfigError
from models.architecture import LINEAR_ATTENTION, architecture_of
from models.layout import expert_shard_of
from models.linear_attention import KEPT_AS_STORED
from models.pipeline_layers import decoder_on_meta
from models.tensor_parallel import joined_shards, shard_of

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6 is a zip archive


class UnsafeFileError(ValueError):
    """A torch.save file refused: it could run code on loading, or it cannot be read at all."""


CONVERT_ADVICE = ("re-save it with a current torch (torch.save, zip format) from a source you trust, or convert it "
                  "to safetensors; the converter never unpickles files that could run code.")


def load_weights_only(path, allowed=(), advice=CONVERT_ADVICE, mmap=True, map_location="cpu"):
    """A torch.save file (a pytorch_model*.bin shard, a layer file, a training state file), unpickled with
    weights_only=True: only tensors, plain containers and the `allowed` classes (torch's safe globals), never code.
    Anything else is refused with what to do; there is no fallback to an unsafe load."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            raise UnsafeFileError(f"'{path}' is not in torch's zip format (a legacy pickle from torch < 1.6, or not "
                                  f"a torch file), which cannot be loaded safely (memory-mapped with "
                                  f"torch.load(weights_only=True)); {advice}")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as error:
        called = re.search(r"GLOBAL (\S+)", str(error))
        reason = f"it names {called.group(1)}, which is not a tensor type" if called else "not only tensors"
        raise UnsafeFileError(f"'{path}' cannot be loaded safely with torch.load(weights_only=True): its pickle "
                              f"refers to code ({reason}); {advice}") from None
    except RuntimeError as error:
        first_sentence = str(error).splitlines()[0].split(". ")[0]
        raise UnsafeFileError(f"'{path}' is not a readable torch.save file ({first_sentence}): truncated or "
                              f"corrupt; download or copy it again.") from None


def load_layer_slice(layer, paths, rank, size, strict=True):
    """Load this tensor-parallel rank's part of a layer: its slice of the one whole-layer file, its own file when
    the layer was saved by `size` ranks (DeepSpeed names them layer_XX-model_YY-model_states.pt; the replicated
    tensors, the same on every rank, are in rank 0's), or, from a checkpoint saved with another tensor-parallel
    size, its slice assembled from the saved slices. A training checkpoint saved under expert parallelism holds
    each slice of a layer's experts in a file of its own (models/pipeline.py saved_parts): the rows of this rank's
    experts are read from the files holding them, whatever expert-parallel size wrote them. A layer with frozen
    parameters (LoRA) loads the part its files hold: the frozen base (a converted model) or the trainable
    parameters (a checkpoint saved without the frozen ones)."""
    if not paths:
        raise FileNotFoundError("no layer file for this layer in the checkpoint; was it written by this model?")
    paths, shard_paths = layer_files_and_expert_shards(paths)
    first = mapped(paths[0])
    layer, first = with_multi_token_prediction(layer, first, paths[0], rank, size)
    shards = [mapped(path) for path in shard_paths]
    expert_keys = set(shards[0]) if shards else set()
    layer = part_held(layer, set(first) | expert_keys)
    keys, saved_keys = set(layer.state_dict(keep_vars=True)), set(first) | expert_keys
    if keys != saved_keys:
        if strict:
            raise RuntimeError(f"layer file keys differ from the layer's: missing {sorted(keys - saved_keys)}, "
                               f"unexpected {sorted(saved_keys - keys)} ({paths[0]})")
        keys = keys & saved_keys
        layer = LayerPart(layer, keys)
    if shards:
        load_expert_shards(LayerPart(layer, keys & expert_keys), shard_paths, shards)
        layer = LayerPart(layer, keys - expert_keys)
    if len(paths) == 1:
        load_layer_file(layer, paths[0], rank, size)
    elif len(paths) == size:
        own = set(mapped(paths[rank])) if rank else set(first)
        load_layer_file(LayerPart(layer, keys & own), paths[rank])
        if keys - own:  # the replicated tensors, which tensor-parallel rank 0 writes once for its group
            load_layer_file(LayerPart(layer, keys - own), paths[0])
    else:
        targets = layer.state_dict(keep_vars=True)
        saved = [own_experts({key: tensor for key, tensor in mapped(p).items() if key in targets}, targets)
                 for p in paths]
        layer.load_state_dict(tensors_for_rank(saved, targets, rank, size, paths[0]))


def with_multi_token_prediction(layer, saved, path, rank=0, size=1):
    """(the part of `layer` its file loads, the file's {key: tensor} that part reads) for a final-norm layer and the
    MTP layer it may hold (models/pipeline_layers.py FinalNormPipe): a file without the MTP layer (a converted model,
    where it is carried) loads the norm, the MTP layer coming from the tag's carried file; a file with it (a
    checkpoint of a run that trained it) into a layer without one (this run does not) loads the norm only. Any
    other layer: as it is."""
    mtp = getattr(layer, "mtp", None)
    holds_mtp = any(key.startswith(MTP_PREFIX) for key in saved)
    if mtp is None and not holds_mtp:
        return layer, saved
    norm_keys = {key for key in layer.state_dict(keep_vars=True) if not key.startswith(MTP_PREFIX)}
    if mtp is not None and not holds_mtp:
        load_carried_mtp(mtp, os.path.dirname(path), rank, size)
    elif mtp is not None:
        return layer, saved
    return LayerPart(layer, norm_keys), {key: tensor for key, tensor in saved.items() if key in norm_keys}


def load_carried_mtp(mtp, tag_dir, rank=0, size=1):
    """The MTP layer `mtp` of a run's final-norm layer, loaded from the converted tag's carried file (strict: every
    tensor of the layer, nothing else): this tensor-parallel rank's slices, this expert-parallel rank's experts."""
    state = carried_mtp_state(tag_dir, mtp.model_config)
    targets = mtp.state_dict(keep_vars=True)
    if set(state) != set(targets):
        raise RuntimeError(f"the carried multi-token-prediction tensors in {tag_dir} differ from the MTP layer's: "
                           f"missing {sorted(set(targets) - set(state))[:5]}, "
                           f"unexpected {sorted(set(state) - set(targets))[:5]}")
    mtp.load_state_dict(tensors_for_rank([own_experts(state, targets)], targets, rank, size, tag_dir), strict=True)


def mapped(path):
    """A torch.save file's {key: tensor}, memory-mapped: nothing read until a tensor is."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def fp32_stored_keys(tag_dir, config):
    """The keys of the decoder layers' parameters that a run keeps as stored (models/linear_attention.py
    KEPT_AS_STORED: Qwen3.5's A_log and gated-norm weight) that tag_dir's layer files store in fp32, read from the
    first linear-attention layer's file (every such layer stores them alike); empty for a model without one."""
    mixers = architecture_of(config).mixer_layers
    if LINEAR_ATTENTION not in mixers:
        return frozenset()
    layer = mixers.index(LINEAR_ATTENTION)
    kept = [key for key, param in decoder_on_meta(config, layer_index=layer).named_parameters()
            if getattr(param, KEPT_AS_STORED, False)]
    paths = sorted(glob.glob(os.path.join(tag_dir, f"layer_{layer + 1:02d}-*model_states.pt")))  # its file(s)
    stored = mapped(paths[0]) if paths else {}
    return frozenset(key for key in kept if key in stored and stored[key].dtype == torch.float32)


def layer_files_and_expert_shards(paths):
    """(the layer's own files: one whole, or one per tensor-parallel rank; its expert shard files in shard order,
    none when its experts are in its own files) of the files DeepSpeed's glob finds for a layer. A set of shard
    files that is not complete is refused in one line."""
    shards = {path: expert_shard_of(path) for path in paths if expert_shard_of(path)}
    own = sorted(path for path in paths if path not in shards)
    if not shards:
        return own, []
    counts = {count for _, count in shards.values()}
    found = sorted(shard for shard, _ in shards.values())
    if len(counts) != 1 or found != list(range(next(iter(counts)))) or not own:
        names = sorted(os.path.basename(path) for path in paths)
        raise ConfigError(f"the files of a layer in {os.path.dirname(next(iter(shards)))} are not one layer file "
                          f"and one complete set of expert shards: {names}; copy the checkpoint again.")
    return own, sorted(shards, key=lambda path: shards[path][0])


def expert_shard_pieces(experts, shard_rows, shards):
    """[(shard, its first row, the target's first row, rows)]: where the rows of an ExpertSlice `experts` lie in
    `shards` files of shard_rows experts each (shard s holds experts s·shard_rows ...)."""
    low, high = experts.first, experts.first + experts.count
    pieces = []
    for shard in range(shards):
        begin, end = max(low, shard * shard_rows), min(high, (shard + 1) * shard_rows)
        if begin < end:
            pieces.append((shard, begin - shard * shard_rows, begin - low, end - begin))
    return pieces


def check_expert_shard(tensor, target, shards, key, where):
    if tensor.shape[0] * shards != target.expert_slice.total or tensor.shape[1:] != target.shape[1:]:
        raise ConfigError(f"{key} in {where} has shape {tuple(tensor.shape)}, not one of {shards} shards of this "
                          f"run's {target.expert_slice.total} experts of shape {tuple(target.shape[1:])}; the "
                          f"checkpoint is of another model.")


def load_expert_shards(layer, paths, shards):
    """Read the rows of each expert tensor of `layer` (an ExpertSlice of its experts) from the expert shard files
    holding them (paths, their mapped states `shards`), straight into the parameter."""
    targets = layer.state_dict(keep_vars=True)
    pieces = {path: [] for path in paths}
    for key, target in targets.items():
        check_expert_shard(shards[0][key], target, len(shards), key, paths[0])
        for shard, source_row, target_row, rows in expert_shard_pieces(target.expert_slice, shards[0][key].shape[0],
                                                                       len(shards)):
            pieces[paths[shard]].append((key, shards[shard][key].narrow(0, source_row, rows),
                                         target.detach().narrow(0, target_row, rows)))
    for path, shard in zip(paths, shards):
        read_into(path, shard, pieces[path])


def expert_rows_of_shards(shards, key, target, where):
    """The rows of expert tensor `key` that `target` (a parameter holding an ExpertSlice) holds, from the shard
    files' {key: tensor} (in shard order): a view of one file's tensor where one holds them all."""
    check_expert_shard(shards[0][key], target, len(shards), key, where)
    parts = [shards[shard][key].narrow(0, source_row, rows) for shard, source_row, _, rows in
             expert_shard_pieces(target.expert_slice, shards[0][key].shape[0], len(shards))]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class LayerPart:
    """Some of a layer's parameters, loaded as load_state_dict loads a whole layer (strict: exactly these keys)."""

    def __init__(self, layer, keys):
        self.layer, self.keys = layer, set(keys)

    def state_dict(self, keep_vars=False):
        return {k: v for k, v in self.layer.state_dict(keep_vars=keep_vars).items() if k in self.keys}

    def load_state_dict(self, state, strict=True):
        if strict and set(state) != self.keys:
            raise RuntimeError(f"layer file keys differ from the layer's: missing {sorted(self.keys - set(state))}, "
                               f"unexpected {sorted(set(state) - self.keys)}")
        self.layer.load_state_dict(state, strict=False)


def part_held(layer, saved_keys):
    """The part of a layer with frozen parameters that a file of saved_keys holds (its frozen or its trainable
    parameters), else the layer (whose strict load then names what differs)."""
    params = layer.state_dict(keep_vars=True)
    trainable = {key for key, param in params.items() if param.requires_grad}
    if len(trainable) == len(params):
        return layer
    for keys in (trainable, set(params) - trainable):
        if set(saved_keys) == keys:
            return LayerPart(layer, keys)
    return layer


def own_experts(state, targets):
    """state ({key: tensor}) with each expert tensor cut to the experts its target holds (models/moe.py
    ExpertSlice, under expert parallelism): views, so a memory-mapped file reads only this rank's experts."""
    return {key: targets[key].expert_slice.of(tensor) if hasattr(targets.get(key), "expert_slice") else tensor
            for key, tensor in state.items()}


def tensors_for_rank(saved, targets, rank, size, where):
    """This tensor-parallel rank's tensors of a layer saved as len(saved) {key: tensor} slices (one whole, one per
    rank, or another count). targets: {key: this rank's tensor}, whose tensor_parallel_dim (models/tensor_parallel.py)
    says how a whole tensor splits. Between other counts, a split tensor is recognised by its saved shape differing
    from the wanted one (only along the split dimension); only the saved slices that overlap this rank's range are
    read. where: the file named in errors."""
    if len(saved) == 1:
        return {key: own_slice(tensor, targets.get(key), rank, size) for key, tensor in saved[0].items()}
    if len(saved) == size:  # rank 0's file holds the replicated tensors (older checkpoints: every rank's)
        return {**saved[0], **saved[rank]}
    state = {}
    for key, first in saved[0].items():
        target = targets.get(key)
        if target is None or target.shape == first.shape:  # replicated (norms), or unknown: strict loading says so
            state[key] = first
            continue
        blocks = getattr(target, "tensor_parallel_blocks", None)
        if blocks is not None:  # cut per block (the linear attention's q, k, v): the whole tensor, then this share
            dim = getattr(target, "tensor_parallel_dim", None) or 0  # its rows, split or (size 1) whole
            state[key] = shard_of(joined_shards([s[key] for s in saved], dim, blocks), dim, rank, size, blocks)
            continue
        differing = [d for d, (a, b) in enumerate(zip(first.shape, target.shape)) if a != b]
        if first.dim() != target.dim() or len(differing) != 1 or \
                first.shape[differing[0]] * len(saved) != target.shape[differing[0]] * size:
            raise ConfigError(f"{key} in {where}: {len(saved)} saved slices of shape {tuple(first.shape)} do not "
                              f"make {size} slices of shape {tuple(target.shape)}; the checkpoint is of another model.")
        dim = differing[0]
        piece, want = first.shape[dim], target.shape[dim]
        low, high = rank * want, (rank + 1) * want
        parts = []
        for i, slices in enumerate(saved):
            begin, end = max(low, i * piece), min(high, (i + 1) * piece)
            if begin < end:
                parts.append(slices[key].narrow(dim, begin - i * piece, end - begin))
        state[key] = torch.cat(parts, dim)
    return state


def load_layer_file(layer, path, rank=0, size=1):
    """Read the layer's tensors from a layer file holding them (and maybe more: a part of a layer, LayerPart, reads
    its own) into its parameters; a parameter split across `size` tensor-parallel ranks
    (tensor_parallel_dim set by models/tensor_parallel.py) gets this rank's slice of the whole tensor, an expert
    tensor under expert parallelism its rank's experts."""
    state = mapped(path)
    targets = layer.state_dict(keep_vars=True)
    sliced = {key: own_slice(tensor, targets[key], rank, size)
              for key, tensor in own_experts({key: state[key] for key in targets}, targets).items()}
    if any(source.shape != targets[key].shape for key, source in sliced.items()):
        layer.load_state_dict(sliced, strict=False)  # raises load_state_dict's error, naming each size mismatch
    read_into(path, state, [(key, source, targets[key].detach()) for key, source in sliced.items()])


def read_into(path, state, pieces):
    """Each (key, source, target) of pieces: source, a view of state[key] (path's tensors, memory-mapped), read into
    target by pread where both are contiguous and alike, else copied through the mapping."""
    offsets = file_offsets(path, state)
    staging = None
    with open(path, "rb") as f:
        for key, source, target in pieces:
            # a view of the file's tensor is read straight from its bytes; a tensor made from it (a shard cut per
            # block, models/tensor_parallel.py shard_of) is copied
            if offsets is not None and (target.dtype, target.shape) == (source.dtype, source.shape) and \
                    target.is_contiguous() and source.is_contiguous() and target.numel() and \
                    source.untyped_storage().data_ptr() == state[key].untyped_storage().data_ptr():
                offset = offsets[key] + (source.storage_offset() - state[key].storage_offset()) * source.element_size()
                if target.device.type == "cpu":
                    read_exactly(f.fileno(), target.view(torch.uint8).reshape(-1).numpy(), offset)
                else:
                    staging = host_staging_buffer(staging, target.nbytes)
                    read_exactly(f.fileno(), staging[:target.nbytes].numpy(), offset)
                    target.view(torch.uint8).reshape(-1).copy_(staging[:target.nbytes])
            else:
                with torch.no_grad():
                    target.copy_(source)


def host_staging_buffer(buffer, nbytes):
    """A host buffer of at least nbytes for reads bound for an accelerator (pread cannot write into device memory),
    pinned where CUDA is, so the copy to the device is a straight DMA; grown, never shrunk, within one file."""
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def own_slice(tensor, target, rank, size):
    """This rank's slice of a whole saved tensor, as its target parameter (None: unknown) is split
    (models/tensor_parallel.py mark_sharded)."""
    dim = getattr(target, "tensor_parallel_dim", None)
    if dim is None or size == 1:
        return tensor
    if tensor.shape[dim] % size:
        raise ValueError(f"a tensor of shape {tuple(tensor.shape)} does not split in {size} along dim {dim}.")
    return shard_of(tensor, dim, rank, size, getattr(target, "tensor_parallel_blocks", None))


def file_offsets(path, state):
    """{key: byte offset of the tensor's data in the file}, or None if the mapping is not the one expected.

    Each storage of an mmap load is a slice of one mapping of the whole file, so its address minus the record's
    offset in the zip is the same for all; that base gives every tensor's offset, and is checked against every
    record before anything is trusted."""
    reader = torch._C.PyTorchFileReader(path)
    record_offsets = {reader.get_record_offset(name) for name in reader.get_all_records()
                      if os.path.basename(os.path.dirname(name)) == "data"}
    storages = {tensor.untyped_storage().data_ptr() for tensor in state.values()}
    if not record_offsets or len(storages) != len(record_offsets):
        return None
    base = min(storages) - min(record_offsets)
    if {address - base for address in storages} != record_offsets:
        return None
    return {key: tensor.untyped_storage().data_ptr() - base + tensor.storage_offset() * tensor.element_size()
            for key, tensor in state.items()}


def read_exactly(fd, buffer, offset):
    view = memoryview(buffer)
    while view.nbytes:
        count = os.preadv(fd, [view], offset)
        if count == 0:
            raise EOFError(f"layer file ends before a tensor's data (offset {offset}).")
        view, offset = view[count:], offset + count


def write_layer_file_from_ranges(path, sources):
    """A torch.save file of {key: tensor} whose bytes are copied by the kernel from other files.

    sources: {key: (dtype, shape, [(source path, byte offset), ...])}: the tensor's bytes are those of the pieces,
    equal parts of it, one after the other (one piece; an MoE layer's experts, one per expert's projection). torch.save
    under skip_data writes the file's skeleton (pickle, zip records, holes where the data goes); copy_file_range then
    fills each hole straight from the source files, so the bytes never pass through this process: faster than
    reading and writing them, and no memory."""
    with torch.serialization.skip_data():
        torch.save({key: torch.empty(shape, dtype=dtype) for key, (dtype, shape, _) in sources.items()}, path)
    offsets = file_offsets(path, torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    if offsets is None:
        raise RuntimeError(f"unexpected layout of the torch.save file '{path}'.")
    with open(path, "r+b") as target:
        for key, (dtype, shape, pieces) in sources.items():
            length = torch.Size(shape).numel() * dtype.itemsize // len(pieces)
            for number, (source_path, source_offset) in enumerate(pieces):
                with open(source_path, "rb") as source:
                    copy_range(source.fileno(), source_offset, target.fileno(), offsets[key] + number * length,
                               length)


def copy_range(source_fd, source_offset, target_fd, target_offset, length):
    """copy_file_range, or sendfile where the kernel will not copy between the two files' filesystems (a model on
    one disk or NFS, its conversion on another: EXDEV on many kernels)."""
    copy = os.copy_file_range
    while length:
        try:
            count = copy(source_fd, target_fd, length, source_offset, target_offset)
        except OSError as error:
            if error.errno not in NO_KERNEL_COPY or copy is send_range:
                raise
            copy = send_range
            continue
        if count == 0:
            raise EOFError(f"source file ends before its tensor's data (offset {source_offset}).")
        source_offset, target_offset, length = source_offset + count, target_offset + count, length - count


NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def send_range(source_fd, target_fd, length, source_offset, target_offset):
    os.lseek(target_fd, target_offset, os.SEEK_SET)
    return os.sendfile(target_fd, source_fd, source_offset, length)
