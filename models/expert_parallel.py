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
"""
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
        order, counts = sort_by_expert(expert_ids, local * self.size)
        received = torch.empty_like(counts)  # [source rank, local expert]: the rows each rank sends each expert here
        collectives.all_to_all_single(received, counts, group=self.group)
        sizes = torch.cat([counts.view(self.size, local).sum(dim=1), received]).tolist()  # the layer's host read
        sent, from_each = sizes[:self.size], sizes[self.size:]
        from_rank = [sum(from_each[r * local:(r + 1) * local]) for r in range(self.size)]
        per_expert = [sum(from_each[e::local]) for e in range(local)]
        rows = collectives.exchange_rows(hidden[order // top_k], from_rank, sent, self.group)
        rows_expert = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(self.size), received,
                                              output_size=rows.shape[0])
        by_expert = torch.argsort(rows_expert, stable=True)
        out = experts(rows[by_expert], received.view(self.size, local).sum(dim=0), per_expert)
        back = collectives.exchange_rows(out[inverse_permutation(by_expert)], sent, from_rank, self.group)
        return combine(back, order, weights, hidden.dtype)


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
