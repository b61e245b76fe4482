"""Counting host syncs on any device: the aten ops that read a tensor's values on the host (on CUDA each waits for the
GPU to finish everything queued before it), recorded by a TorchDispatchMode. Used by tests/test_host_syncs.py and
bench/host_syncs.py; on CUDA, torch.cuda.set_sync_debug_mode is the device's own count of the same."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# item(), bool(), int(), float() of a tensor; outputs whose size depends on values
SYNCING_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten.unique_consecutive.default, aten._unique2.default}
BOOLEAN_INDEXED_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostSyncs(TorchDispatchMode):
    """Within the block, `ops` lists the name of every op that syncs the host with the device: those above,
    indexing by a boolean mask (its nonzero runs inside the op), and Tensor.tolist() (which dispatches no op on a
    CPU tensor: seen by wrapping it while the block runs)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __enter__(self):
        tolist = self._tolist = torch.Tensor.tolist

        def recorded_tolist(tensor):
            self.ops.append("Tensor.tolist")
            return tolist(tensor)
        torch.Tensor.tolist = recorded_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS or (func in BOOLEAN_INDEXED_OPS and any(
                index is not None and index.dtype == torch.bool for index in args[1])):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
