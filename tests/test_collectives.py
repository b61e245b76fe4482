"""Every collective and point-to-point operation of the project goes through collectives/ (found by reading the
source: no other call site of torch.distributed's), which refuses a tensor off the accelerator's device, as NCCL
would. On this machine the host is the device, so the tests mark host tensors with HostTensor: a CPU tensor that
reports a device other than the accelerator's and keeps doing so through every op but a move (Tensor.to), as host
memory on a GPU machine does. The DPO + context-parallel count of a step's pairs runs with it in
tests/test_preference.py's four-process launch (host_tensor_units)."""
import ast
import pathlib

import pytest
import torch

import collectives
from tests.test_rooms import FLOOR

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT_DIRS = tuple(room for room in FLOOR if room != "collectives")  # every room; bench/ measures them
COLLECTIVES = {"all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "gather",
               "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list", "barrier",
               "monitored_barrier", "_all_gather_base", "_reduce_scatter_base"}
DISTRIBUTED_MODULES = ("torch.distributed", "deepspeed.comm")


class HostTensor(torch.Tensor):
    """Host memory where the accelerator is not the CPU: reports the meta device (anything but the accelerator's)
    through every op; a move to the device (Tensor.to) gives a plain tensor."""
    device = property(lambda self: torch.device("meta"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        return result.as_subclass(torch.Tensor) if func is torch.Tensor.to else result


def on_host(batch):
    """A collated micro-batch (nested tuples of tensors) as the loader hands it over on a GPU machine."""
    if isinstance(batch, tuple):
        return tuple(on_host(item) for item in batch)
    return batch.as_subclass(HostTensor)


def distributed_call_sites(path):
    """'file:line name' of every collective reached through torch.distributed or deepspeed.comm in a source file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases, sites = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name in DISTRIBUTED_MODULES}
        elif isinstance(node, ast.ImportFrom):
            if node.module in DISTRIBUTED_MODULES:
                sites += [f"{path}:{node.lineno} {a.name}" for a in node.names if a.name in COLLECTIVES]
            elif node.module in ("torch", "deepspeed"):
                aliases |= {a.asname or a.name for a in node.names if a.name in ("distributed", "comm")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            owner = ast.unparse(node.value)
            if owner in aliases or owner in DISTRIBUTED_MODULES:
                sites.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.attr}")
    return sites


def project_sources():
    files = [p for d in PROJECT_DIRS for p in (ROOT / d).rglob("*.py")]
    return files + sorted(ROOT.glob("*.py"))


def test_no_collective_bypasses_the_collectives_module():
    sources = project_sources()
    assert len(sources) > 50 and ROOT / "models" / "loss.py" in sources
    sites = [site for path in sources for site in distributed_call_sites(path)]
    assert not sites, f"collectives outside collectives/ (call them through it): {sites}"


def test_the_source_check_finds_a_direct_call(tmp_path):
    """The reader above is what guards the rule: it finds each way of writing a direct call."""
    source = tmp_path / "example.py"
    source.write_text("import torch\nimport torch.distributed as dist\nfrom torch import distributed\n"
                      "from deepspeed import comm\nfrom torch.distributed import isend\n"
                      "dist.all_reduce(x)\ndistributed.barrier()\ntorch.distributed.broadcast(x, 0)\n"
                      "comm.all_gather_single(a, b)\ndist.get_rank()\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        sites = distributed_call_sites(source)
    finally:
        ROOT = saved
    assert [site.split(" ")[1] for site in sites] == [
        "isend", "dist.all_reduce", "distributed.barrier", "torch.distributed.broadcast", "comm.all_gather_single"]


def test_a_host_tensor_is_refused_before_any_process_group_is_needed():
    host = on_host(torch.ones(3, dtype=torch.int64))
    assert type(host + 1) is HostTensor and host.sum().device == torch.device("meta")
    with pytest.raises(RuntimeError, match=r"tensor on meta, not on the accelerator's cpu: NCCL takes no host"):
        collectives.all_reduce(host.sum())
    moved = host.to(collectives.device())
    assert type(moved) is torch.Tensor and moved.device == collectives.device()
    collectives.check_on_device(moved)
