"""Expert parallelism (`expert_parallel_size`): the experts of every sparse layer split over that many data-parallel
ranks of a stage, each holding a contiguous slice of them (models/moe.py's dispatcher seam), and every token sent to
the ranks of its k experts and back by all-to-all.

Groups, on DeepSpeed's data axis of each stage and tensor-parallel rank (cluster/distributed.py's topology): each
block of `size` consecutive data-parallel ranks is an expert-parallel group (rank r of it holds experts
[r E / size, (r + 1) E / size)); the ranks holding the same slice, every size-th, are its replica group (dp / size of
them), over which that slice's gradients are reduced and ZeRO-1 partitions its optimizer state (DeepSpeed's own
expert groups, deepspeed_internals.access.use_deepspeed_expert_groups). Tensor parallelism keeps every expert whole
on each rank of its group (models/moe.py MoEBlock), so expert parallelism runs beside it unchanged: a group's ranks
share one tensor-parallel rank and exchange that rank's tokens. The data axis holds the context ranks too
(models/context_parallel.py), so a group may take a context group's ranks: each sends its own tokens, whatever rows
they belong to, and its experts' gradients are reduced over the data axis as data-parallel ones.

A layer's dispatch, per micro-batch: the T x k choices sorted by expert (as LocalExperts sorts them), the counts of
what each rank sends each other exchanged by one small all-to-all and read on the host (the split sizes of what
follows: the one host sync of a layer and micro-batch), each token sent once to each rank holding one of its experts
with its choices there, expanded there into its choices, sorted by local expert and run as one grouped GEMM, each
choice's output sent back, then weighted, unsorted and summed per token in routing order as LocalExperts does: each
token's outputs are the same sums as transformers'. Backward runs both exchanges in reverse
(collectives.exchange_rows).
Under activation checkpointing (keeping_dispatch) the first forward keeps the routing decision and both exchanges'
outputs (or, with moe.checkpoint_keeps_rows=false, the routing alone), so the recomputation in backward runs no
collective (or the two row exchanges) and no host read (KeptDispatch).
"""
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

import collectives
from models.moe import Experts, combine, sort_by_expert


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
        """A built decoder layer's experts (a sparse layer's: its MoEBlock's, or Gemma 4's beside its dense MLP) as
        this rank's slice of them, dispatched by this all-to-all: new experts made on `device` (None: torch's
        default) unless the layer's are on the meta device and so is `device`. The router stays whole on every
        rank (Gemma 4's per_expert_scale with it): every rank routes its own tokens over all the experts."""
        block = next((m for m in (layer.mlp, layer) if isinstance(getattr(m, "experts", None), Experts)), None)
        if block is None:
            return
        whole = block.experts
        first, count = self.expert_range(whole.moe.num_experts)
        with torch.device(device if device is not None else torch.get_default_device()):
            block.experts = Experts(whole.moe, whole.hidden_size, whole.act_fn, first, count)
        block.dispatcher = self

    def __call__(self, hidden, expert_ids, weights, experts):
        kept = KeptDispatch.replaying()  # a checkpointed layer's recomputation: the first forward's dispatch
        plan, kept_rows, kept_back = kept if kept is not None else (self.plan(expert_ids, experts), None, None)
        rows = self.exchange(hidden[plan.pair_token], kept_rows, plan.from_tokens, plan.sent_tokens)
        out = experts(rows[plan.choice_row], plan.expert_counts, plan.per_expert)
        back = self.exchange(out[plan.back_order], kept_back, plan.sent, plan.from_rank)
        if kept is None:
            KeptDispatch.record(plan, rows, back)
        return combine(back, plan.order, weights, hidden.dtype)

    def exchange(self, tensor, kept, output_split_sizes, input_split_sizes):
        """collectives.exchange_rows, or where a recomputation has the first forward's output, that output."""
        if kept is None:
            return collectives.exchange_rows(tensor, output_split_sizes, input_split_sizes, self.group)
        return collectives.kept_exchange(tensor, kept, output_split_sizes, input_split_sizes, self.group)

    def plan(self, expert_ids, experts):
        """A layer's routing decision as the exchanges need it (DispatchPlan). Each token goes once to each rank
        holding one of its experts, its choices there with it; what each rank sends each other, in rows per local
        expert and in tokens, travels first by one small all-to-all and is read on the host (the layer's one
        sync)."""
        num_tokens, top_k = expert_ids.shape
        local, size = experts.num_local_experts, self.size
        order, counts = sort_by_expert(expert_ids, local * size)
        present = token_destinations(expert_ids, local, size)
        counts_to = torch.cat([counts.view(size, local), present.sum(dim=0)[:, None]], dim=1)  # [rank, local + 1]
        counts_from = torch.empty_like(counts_to)  # the same, of what each rank sends here
        collectives.all_to_all_single(counts_from, counts_to, group=self.group)
        to_rank, from_rank = torch.stack([counts_to, counts_from]).tolist()  # the layer's host read
        sent_tokens, from_tokens = [row[local] for row in to_rank], [row[local] for row in from_rank]
        # The (rank, token) pairs, rank by rank and each rank's in token order: by a stable sort, where nonzero would
        # read their count to the host a second time.
        pairs = torch.argsort(~present.t().reshape(-1), stable=True)[:sum(sent_tokens)]
        pair_rank, pair_token = pairs // num_tokens, pairs % num_tokens
        pair_experts = expert_ids[pair_token]
        choices = torch.where(pair_experts // local == pair_rank[:, None], pair_experts % local, -1)
        received_choices = choices.new_empty((sum(from_tokens), top_k))  # each received token's local experts, or -1
        collectives.all_to_all_single(received_choices, choices, from_tokens, sent_tokens, group=self.group)
        choices_from = [sum(row[:local]) for row in from_rank]
        choice_row, back_order = local_choices(received_choices, counts_from[:, local], sum(choices_from))
        return DispatchPlan(order, pair_token, sent_tokens, from_tokens, choice_row,
                            counts_from[:, :local].sum(dim=0), [sum(row[e] for row in from_rank) for e in range(local)],
                            back_order, [sum(row[:local]) for row in to_rank], choices_from)


def token_destinations(expert_ids, experts_per_rank, size):
    """[T, size] bool: whether each token has one of its experts (expert_ids [T, k]) on each rank, rank r holding
    experts [r * experts_per_rank, (r + 1) * experts_per_rank)."""
    present = torch.zeros(expert_ids.shape[0], size, dtype=torch.bool, device=expert_ids.device)
    return present.scatter_(1, expert_ids // experts_per_rank, True)


def local_choices(received_choices, tokens_from, num_choices):
    """(choice_row: the received token of each of this rank's choices, sorted by local expert, then source rank and
    the source's token order, as a grouped GEMM takes them and in the order one row per choice would arrive;
    back_order: those choices' order rank by rank, each rank's in its own sort by expert, as the combine sends them
    back). received_choices [N, k]: each received token's local experts, -1 for its choices elsewhere;
    tokens_from [size]: the tokens each rank sent; num_choices: the valid entries."""
    tokens, top_k = received_choices.shape
    row = torch.arange(tokens, device=received_choices.device)
    key = torch.where(received_choices >= 0, received_choices * tokens + row[:, None], torch.iinfo(torch.int64).max)
    choice_row = torch.argsort(key.reshape(-1), stable=True)[:num_choices] // top_k
    source = torch.repeat_interleave(torch.arange(tokens_from.shape[0], device=row.device), tokens_from,
                                     output_size=tokens)
    return choice_row, torch.argsort(source[choice_row], stable=True)


class DispatchPlan(NamedTuple):
    """A sparse layer's dispatch on this rank. Out: `order` (the T x k choices sorted by expert, as the combine takes
    the rows come back), `pair_token` (the token of each row sent: one per token and rank holding one of its
    experts, rank by rank), `sent_tokens` / `from_tokens` (the tokens sent to each rank and received from each).
    Here: `choice_row` (the received token of each choice this rank's experts run, sorted by local expert),
    `expert_counts` / `per_expert` (each local expert's rows, on the device and on the host), `back_order` (the
    choices' order as they go back) and `sent` / `from_rank` (the choices' rows coming back from each rank and sent
    back to each)."""
    order: torch.Tensor
    pair_token: torch.Tensor
    sent_tokens: list
    from_tokens: list
    choice_row: torch.Tensor
    expert_counts: torch.Tensor
    per_expert: list
    back_order: torch.Tensor
    sent: list
    from_rank: list


class KeptDispatch:
    """What a checkpointed block's first forward keeps of each sparse layer's dispatch, for its recomputation in
    backward: the routing decision (DispatchPlan: small) and, with keep_rows, both exchanges' outputs, the received
    rows and the rows come back. The recomputation then reads nothing to the host and takes the routing of the first
    forward whatever it would recompute, so every rank of a group reaches the same exchanges; with the rows it runs
    no collective at all (torchtitan's selective checkpointing keeps the same), without them it exchanges the rows
    again (2 all-to-alls). The rows' price: a sparse layer's two row tensors (its received tokens, at most T x k
    rows of the hidden size, and its T x k rows come back) kept beside the block's input until its backward."""

    _active = []  # the KeptDispatch of the block running now, innermost last

    def __init__(self, keep_rows=True):
        self.layers, self.replay, self.keep_rows = [], None, keep_rows

    @classmethod
    def replaying(cls):
        """The next layer's kept (plan, received rows, rows come back) during a recomputation, else None."""
        if not cls._active or cls._active[-1].replay is None:
            return None
        return next(cls._active[-1].replay)

    @classmethod
    def record(cls, plan, rows, back):
        if cls._active:
            keep_rows = cls._active[-1].keep_rows
            cls._active[-1].layers.append((plan, *((rows.detach(), back.detach()) if keep_rows else (None, None))))

    def run(self, function, *args):
        """function(*args), its dispatches kept on the first call, replayed on every later one (a recomputation)."""
        self.replay = iter(self.layers) if self.layers else None
        KeptDispatch._active.append(self)
        try:
            return function(*args)
        finally:
            KeptDispatch._active.pop()


def keeping_dispatch(checkpoint, keep_rows=True):
    """An activation-checkpointing function (DeepSpeed's reentrant or non-reentrant: checkpoint(function, *args))
    whose blocks keep their sparse layers' dispatch for the recomputation (KeptDispatch): a checkpointed sparse layer
    runs its two exchanges' reverses in backward and, without keep_rows, the two exchanges again, where recomputing
    the whole dispatch would add four all-to-alls and a host sync."""
    def checkpointed(function, *args):
        return checkpoint(functools.partial(KeptDispatch(keep_rows).run, function), *args)
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
    """Why expert_parallel_size cannot split this run (a line naming the value and what to set), or None.
    data_parallel: the ranks of a stage's data axis (data-parallel x context-parallel ones)."""
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
