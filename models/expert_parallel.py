"""Expert parallelism (`expert_parallel_size`): the experts of every sparse layer split over that many data-parallel
ranks of a stage, each holding a contiguous slice of them (models/moe.py's dispatcher seam), and every token sent to
the ranks of its k experts and back by all-to-all.

Groups, on DeepSpeed's data axis of each stage and tensor-parallel rank (cluster/distributed.py's topology): each
block of `size` consecutive data-parallel ranks is an expert-parallel group (rank r of it holds experts
[r E / size, (r + 1) E / size)); the ranks holding the same slice, every size-th, are its replica group (dp / size of
them), over which that slice's gradients are reduced and ZeRO-1 partitions its optimizer state (DeepSpeed's own
expert groups, deepspeed_internals.access.use_deepspeed_expert_groups). Tensor parallelism keeps every expert whole
on each rank of its group (models/moe.py MoEBlock), so expert parallelism runs beside it unchanged: a group's ranks
share one tensor-parallel rank and exchange that rank's tokens.

A layer's dispatch, per micro-batch: the T x k choices sorted by expert (as LocalExperts sorts them), the per-expert
counts exchanged by one small all-to-all and read on the host (the split sizes of what follows: the one host sync of
a layer and micro-batch), the rows sent to their experts' ranks, sorted there by local expert and run as one grouped
GEMM, sent back, then weighted, unsorted and summed per token in routing order as LocalExperts does: each token's
outputs are the same sums as transformers'. Backward runs both exchanges in reverse (collectives.exchange_rows).
Under activation checkpointing (keeping_dispatch) the first forward keeps the routing decision and both exchanges'
outputs, so the recomputation in backward runs no collective and no host read (KeptDispatch).
"""
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

import collectives
from models.moe import Experts, MoEBlock, combine, inverse_permutation, sort_by_expert


class ExpertParallel:
    """This rank's place in expert parallelism (size 1: every expert on every rank) and the all-to-all dispatcher
    of its sparse layers. group / ranks: its expert-parallel group; replica_group / replica_ranks: the ranks holding
    its slice (global ranks, in data-parallel order)."""

    def __init__(self, size=1, rank=0, group=None, ranks=(0,), replica_group=None, replica_ranks=(0,)):
        self.size, self.rank, self.group, self.ranks = size, rank, group, list(ranks)
        self.replica_group, self.replica_ranks = replica_group, list(replica_ranks)

    @property
    def name(self):
        """DeepSpeed's name of the groups (its expert parameters' group_name)."""
        return f"ep_size_{self.size}"

    def expert_range(self, num_experts):
        count = num_experts // self.size
        return self.rank * count, count

    def split_experts(self, layer, device=None):
        """A built decoder layer's experts (a sparse layer's) as this rank's slice of them, dispatched by this
        all-to-all: new experts made on `device` (None: torch's default) unless the layer's are on the meta device
        and so is `device`."""
        if not isinstance(layer.mlp, MoEBlock):
            return
        block, whole = layer.mlp, layer.mlp.experts
        first, count = self.expert_range(block.moe.num_experts)
        with torch.device(device if device is not None else torch.get_default_device()):
            block.experts = Experts(block.moe, whole.hidden_size, whole.act_fn, first, count)
        block.dispatcher = self

    def __call__(self, hidden, expert_ids, weights, experts):
        top_k, local = expert_ids.shape[1], experts.num_local_experts
        kept = KeptDispatch.replaying()
        if kept is not None:  # a checkpointed layer's recomputation: the first forward's routing and exchanges
            plan, received_rows, returned_rows = kept
            rows = collectives.kept_exchange(hidden[plan.order // top_k], received_rows, plan.from_rank, plan.sent,
                                             self.group)
            out = experts(rows[plan.by_expert], plan.expert_counts, plan.per_expert)
            back = collectives.kept_exchange(out[inverse_permutation(plan.by_expert)], returned_rows, plan.sent,
                                             plan.from_rank, self.group)
            return combine(back, plan.order, weights, hidden.dtype)
        plan = self.plan(expert_ids, local)
        rows = collectives.exchange_rows(hidden[plan.order // top_k], plan.from_rank, plan.sent, self.group)
        out = experts(rows[plan.by_expert], plan.expert_counts, plan.per_expert)
        back = collectives.exchange_rows(out[inverse_permutation(plan.by_expert)], plan.sent, plan.from_rank,
                                         self.group)
        KeptDispatch.record(plan, rows, back)
        return combine(back, plan.order, weights, hidden.dtype)

    def plan(self, expert_ids, local):
        """A layer's routing decision as the exchanges need it: the T x k choices sorted by expert, each expert's
        count sent to its owner (one small all-to-all) and the split sizes read on the host (the layer's one sync),
        and the order of the received rows by local expert."""
        order, counts = sort_by_expert(expert_ids, local * self.size)
        received = torch.empty_like(counts)  # [source rank, local expert]: the rows each rank sends each expert here
        collectives.all_to_all_single(received, counts, group=self.group)
        sizes = torch.cat([counts.view(self.size, local).sum(dim=1), received]).tolist()  # the layer's host read
        sent, from_each = sizes[:self.size], sizes[self.size:]
        from_rank = [sum(from_each[r * local:(r + 1) * local]) for r in range(self.size)]
        rows_expert = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(self.size), received,
                                              output_size=sum(from_rank))
        return DispatchPlan(order, sent, from_rank, received.view(self.size, local).sum(dim=0),
                            [sum(from_each[e::local]) for e in range(local)], torch.argsort(rows_expert, stable=True))


class DispatchPlan(NamedTuple):
    """A sparse layer's routing decision on this rank, what its exchanges and experts take: `order` (the T x k
    choices sorted by expert), the rows sent to each rank and received from each (`sent`, `from_rank`), each local
    expert's received rows on the device and on the host (`expert_counts`, `per_expert`), and `by_expert`, the
    received rows' order by local expert."""
    order: torch.Tensor
    sent: list
    from_rank: list
    expert_counts: torch.Tensor
    per_expert: list
    by_expert: torch.Tensor


class KeptDispatch:
    """What a checkpointed block's first forward keeps of each sparse layer's dispatch, for its recomputation in
    backward: the routing decision (DispatchPlan) and both exchanges' outputs, the received rows and the rows come
    back. The recomputation then runs no collective and reads nothing to the host, and takes the routing of the
    first forward whatever it would recompute, so every rank of a group reaches its backward's two exchanges
    (torchtitan's selective checkpointing keeps the same). Their price: a sparse layer's two row tensors, T x k rows
    of the hidden size, kept beside the block's input until its backward."""

    _active = []  # the KeptDispatch of the block running now, innermost last

    def __init__(self):
        self.layers, self.replay = [], None

    @classmethod
    def replaying(cls):
        """The next layer's kept (plan, received rows, rows come back) during a recomputation, else None."""
        if not cls._active or cls._active[-1].replay is None:
            return None
        return next(cls._active[-1].replay)

    @classmethod
    def record(cls, plan, rows, back):
        if cls._active:
            cls._active[-1].layers.append((plan, rows.detach(), back.detach()))

    def run(self, function, *args):
        """function(*args), its dispatches kept on the first call, replayed on every later one (a recomputation)."""
        self.replay = iter(self.layers) if self.layers else None
        KeptDispatch._active.append(self)
        try:
            return function(*args)
        finally:
            KeptDispatch._active.pop()


def keeping_dispatch(checkpoint):
    """An activation-checkpointing function (DeepSpeed's reentrant or non-reentrant: checkpoint(function, *args))
    whose blocks keep their sparse layers' dispatch for the recomputation (KeptDispatch): a checkpointed sparse layer
    runs its two exchanges' reverses in backward and no other all-to-all, where recomputing the dispatch would add
    three and a host sync."""
    def checkpointed(function, *args):
        return checkpoint(functools.partial(KeptDispatch().run, function), *args)
    return checkpointed


NO_EXPERT_PARALLEL = ExpertParallel()


def build_expert_parallel(topology, size):
    """This rank's ExpertParallel. Every rank creates every group, in the same order, as new_group requires."""
    if size == 1:
        return NO_EXPERT_PARALLEL
    rank, mine = dist.get_rank(), {}
    for data_ranks in topology.get_axis_comm_lists("data"):
        for start in range(0, len(data_ranks), size):
            members = data_ranks[start:start + size]
            group = dist.new_group(members)
            if rank in members:
                mine.update(rank=members.index(rank), group=group, ranks=members)
        for first in range(size):
            members = data_ranks[first::size]
            group = dist.new_group(members)
            if rank in members:
                mine.update(replica_group=group, replica_ranks=members)
    return ExpertParallel(size, **mine)


def expert_parallel_error(size, data_parallel, num_experts):
    """Why expert_parallel_size cannot split this run (a line naming the value and what to set), or None."""
    if size == 1:
        return None
    if num_experts is None:
        return (f"expert_parallel_size={size} splits the experts of a mixture of experts, and this model has none; "
                f"set expert_parallel_size=1.")
    if data_parallel % size:
        return (f"expert_parallel_size={size} does not divide the {data_parallel} data-parallel ranks of a stage: "
                f"launch a multiple of {size} data-parallel replicas or set expert_parallel_size to a divisor of "
                f"{data_parallel}.")
    if num_experts % size:
        return (f"expert_parallel_size={size} does not divide the model's {num_experts} experts per layer: set "
                f"expert_parallel_size to a divisor of {num_experts} (and of the {data_parallel} data-parallel ranks).")
    return None
