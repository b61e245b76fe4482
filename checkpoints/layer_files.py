"""Reading a per-layer file (torch.save format) straight into a built layer's parameters, and writing one from
byte ranges of other files.

torch.load(mmap=True) maps the file and locates every tensor without reading its bytes; each tensor is then read
with pread directly into the parameter it belongs to. Nothing is staged on the CPU: loading a stage costs the stage
itself, not the stage plus a layer (load_state_dict from a loaded or mapped file keeps the whole layer resident until
the next one). A parameter on an accelerator gets its bytes through one host buffer, the size of the file's largest
tensor, then a copy to the device.
"""
import errno
import os
import pickle
import re

import torch

from errors import ConfigError

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
    the layer was saved by `size` ranks (DeepSpeed names them layer_XX-model_YY-model_states.pt), or, from a
    checkpoint saved with another tensor-parallel size, its slice assembled from the saved slices. A layer with
    frozen parameters (LoRA) loads the part its files hold: the frozen base (a converted model) or the trainable
    parameters (a checkpoint saved without the frozen ones)."""
    if not paths:
        raise FileNotFoundError("no layer file for this layer in the checkpoint; was it written by this model?")
    layer = part_held(layer, torch.load(paths[0], map_location="cpu", mmap=True, weights_only=True).keys())
    if len(paths) == 1:
        load_layer_file(layer, paths[0], strict, rank, size)
    elif len(paths) == size:
        load_layer_file(layer, sorted(paths)[rank], strict)
    else:
        targets = layer.state_dict(keep_vars=True)
        saved = [own_experts(torch.load(p, map_location="cpu", mmap=True, weights_only=True), targets)
                 for p in sorted(paths)]
        layer.load_state_dict(tensors_for_rank(saved, targets, rank, size, paths[0]), strict=strict)


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
        return {key: own_slice(tensor, getattr(targets.get(key), "tensor_parallel_dim", None), rank, size)
                for key, tensor in saved[0].items()}
    if len(saved) == size:
        return saved[rank]
    state = {}
    for key, first in saved[0].items():
        target = targets.get(key)
        if target is None or target.shape == first.shape:  # replicated (norms), or unknown: strict loading says so
            state[key] = first
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


def load_layer_file(layer, path, strict=True, rank=0, size=1):
    """Read a layer file into the layer's parameters; a parameter split across `size` tensor-parallel ranks
    (tensor_parallel_dim set by models/tensor_parallel.py) gets this rank's slice of the whole tensor, an expert
    tensor under expert parallelism its rank's experts."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    targets = layer.state_dict(keep_vars=True)
    sliced = {key: own_slice(tensor, getattr(targets.get(key), "tensor_parallel_dim", None), rank, size)
              for key, tensor in own_experts(state, targets).items()}
    offsets = file_offsets(path, state)
    if offsets is None or set(state) != set(targets):
        layer.load_state_dict(sliced, strict=strict)  # copies through the mapping, or raises load_state_dict's error
        return
    staging = None
    with open(path, "rb") as f:
        for key, source in sliced.items():
            target = targets[key].detach()
            if (target.dtype, target.shape) == (source.dtype, source.shape) and target.is_contiguous() \
                    and source.is_contiguous() and target.numel():
                offset = offsets[key] + (source.storage_offset() - state[key].storage_offset()) * source.element_size()
                if target.device.type == "cpu":
                    read_exactly(f.fileno(), target.view(torch.uint8).reshape(-1).numpy(), offset)
                else:
                    staging = host_staging_buffer(staging, target.nbytes)
                    read_exactly(f.fileno(), staging[:target.nbytes].numpy(), offset)
                    target.view(torch.uint8).reshape(-1).copy_(staging[:target.nbytes])
            else:
                target.copy_(source)


def host_staging_buffer(buffer, nbytes):
    """A host buffer of at least nbytes for reads bound for an accelerator (pread cannot write into device memory),
    pinned where CUDA is, so the copy to the device is a straight DMA; grown, never shrunk, within one file."""
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def own_slice(tensor, dim, rank, size):
    if dim is None or size == 1:
        return tensor
    if tensor.shape[dim] % size:
        raise ValueError(f"a tensor of shape {tuple(tensor.shape)} does not split in {size} along dim {dim}.")
    return tensor.chunk(size, dim)[rank]


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
