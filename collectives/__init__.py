"""The one door to torch.distributed's collectives and point-to-point operations: every call the project makes goes
through here (tests/test_collectives.py fails on any other call site), and each refuses a tensor that is not on the
accelerator's current device. NCCL takes no host tensor; gloo takes both, so without this check a host tensor would
pass every CPU test and stop the first NCCL run at its first step.

A leaf at the top level like deepspeed_internals/: models/, training/, checkpoints/ and data/ all import it. Object
collectives (pickled, placed by torch itself) and barriers hold no tensor of ours and pass straight through.
"""
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

ReduceOp = dist.ReduceOp


def device():
    """The accelerator's current device: where every tensor handed to a collective must live (build them there)."""
    return torch.device(get_accelerator().current_device_name())


def check_on_device(*tensors):
    """Raise, naming both devices, if a tensor is not on the accelerator's current device."""
    expected = device()
    for tensor in tensors:
        if tensor.device != expected:
            raise RuntimeError(f"a collective was handed a tensor on {tensor.device}, not on the accelerator's "
                               f"{expected}: NCCL takes no host tensor; create or move it there (collectives.device()) "
                               f"where it is made.")


def all_reduce(tensor, op=ReduceOp.SUM, group=None):
    check_on_device(tensor)
    dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor, src, group=None):
    check_on_device(tensor)
    dist.broadcast(tensor, src=src, group=group)


def reduce(tensor, dst, group=None):
    check_on_device(tensor)
    dist.reduce(tensor, dst=dst, group=group)


def all_gather_single(out, tensor, group=None):
    check_on_device(out, tensor)
    dist.all_gather_single(out, tensor, group=group)


def all_gather_numbers(numbers):
    """Every rank's list of numbers (each rank the same count), gathered as float64 on the device: [[...] per rank].
    One host read, of the gathered rows."""
    mine = torch.tensor(numbers, dtype=torch.float64, device=device())
    every_rank = torch.empty(dist.get_world_size() * mine.numel(), dtype=mine.dtype, device=mine.device)
    all_gather_single(every_rank, mine)
    return every_rank.view(-1, mine.numel()).tolist()


def reduce_scatter_single(out, tensor, group=None):
    check_on_device(out, tensor)
    dist.reduce_scatter_single(out, tensor, group=group)


def all_to_all_single(out, tensor, output_split_sizes=None, input_split_sizes=None, group=None):
    """Rows input_split_sizes[r] of tensor to rank r of the group, rows from each rank into out (uneven splits as
    Python ints: their sum is each tensor's first dimension)."""
    check_on_device(out, tensor)
    dist.all_to_all_single(out, tensor, output_split_sizes, input_split_sizes, group=group)


class _AllToAllRows(torch.autograd.Function):
    """all_to_all_single as an autograd op: the gradient goes back by the reverse exchange (splits swapped)."""

    @staticmethod
    def forward(ctx, tensor, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (input_split_sizes, output_split_sizes), group
        out = tensor.new_empty((sum(output_split_sizes), *tensor.shape[1:]))
        all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAllRows.apply(grad, *ctx.splits, ctx.group), None, None, None


def exchange_rows(tensor, output_split_sizes, input_split_sizes, group):
    """tensor's rows sent to the group's ranks (input_split_sizes[r] rows to rank r, in order) and theirs received
    (output_split_sizes[r] from rank r), differentiably: backward sends each row's gradient back where it came
    from."""
    return _AllToAllRows.apply(tensor, list(output_split_sizes), list(input_split_sizes), group)


class _KeptRows(torch.autograd.Function):
    """An exchange's output kept from an earlier forward (a checkpointed layer's recomputation), standing for the
    exchange of `tensor` without communicating; its backward is the exchange's, the reverse exchange."""

    @staticmethod
    def forward(ctx, tensor, kept, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (input_split_sizes, output_split_sizes), group
        return kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAllRows.apply(grad, *ctx.splits, ctx.group), None, None, None, None


def kept_exchange(tensor, kept, output_split_sizes, input_split_sizes, group):
    """What exchange_rows(tensor, ...) returned in an earlier forward (`kept`), returned again without communicating;
    backward sends each row's gradient back where it came from, as exchange_rows' does."""
    return _KeptRows.apply(tensor, kept, list(output_split_sizes), list(input_split_sizes), group)


def isend(tensor, peer):
    check_on_device(tensor)
    return dist.isend(tensor, peer)


def irecv(tensor, peer):
    check_on_device(tensor)
    return dist.irecv(tensor, peer)


def recv(tensor, peer):
    check_on_device(tensor)
    dist.recv(tensor, peer)


def wait(works):
    """Wait for posted point-to-point requests (isend, irecv): a peer's failure is raised here, in this package,
    where cluster/distributed.py's communication_failure recognises it as one."""
    for work in works:
        work.wait()


def barrier(group=None):
    dist.barrier(group=group)


def broadcast_object_list(objects, src=0):
    dist.broadcast_object_list(objects, src=src)


def all_gather_object(out, obj):
    dist.all_gather_object(out, obj)


def gather_object(obj, out, dst=0):
    dist.gather_object(obj, out, dst=dst)
