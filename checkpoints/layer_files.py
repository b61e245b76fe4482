"""Reading a per-layer file (torch.save format) straight into a built layer's parameters.

torch.load(mmap=True) maps the file and locates every tensor without reading its bytes; each tensor is then read
with pread directly into the parameter it belongs to. Nothing is staged: loading a stage costs the stage itself,
not the stage plus a layer (load_state_dict from a loaded or mapped file keeps the whole layer resident until the
next one).
"""
import os

import torch


def load_layer_file(layer, path, strict=True):
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    targets = layer.state_dict(keep_vars=True)
    offsets = file_offsets(path, state)
    if offsets is None or set(state) != set(targets):
        layer.load_state_dict(state, strict=strict)  # copies through the mapping, or raises load_state_dict's error
        return
    with open(path, "rb") as f:
        for key, source in state.items():
            target = targets[key].detach()
            if (target.dtype, target.shape) == (source.dtype, source.shape) and target.is_contiguous() \
                    and source.is_contiguous() and target.numel():
                read_exactly(f.fileno(), target.view(torch.uint8).reshape(-1).numpy(), offsets[key])
            else:
                target.copy_(source)


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
