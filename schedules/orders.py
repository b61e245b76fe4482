"""The zero-bubble pipeline schedule (ZB-H1, Qi et al., ICLR 2024) in DeepSpeed's instruction style.

Each backward is split in two: B, the input gradient the previous stage waits for, and W, the weight gradient
nobody waits for (models/weight_grads.py defers it). Stage s runs its forwards and Bs in 1F1B's order and places
the Ws: in the steady state B_j is followed by W_(j-s) (stage s holds its Ws s micro-batches back), in the cool-down,
where 1F1B idles waiting for gradients, one pending W follows each B, and the rest come last. The bubble shrinks
from (p-1)(F+B+W) to (p-1)(F+B-W) for any F, B, W with W <= B (the paper's ZB-H1 bound; tests/test_schedule.py
checks it by simulation). Memory stays within 1F1B's peak: at most p micro-batches are between their F and their W
on any stage, as on 1F1B's first stage (one waiting only for W holds its linear layers' inputs and output
gradients, less than a forward's activations); later stages hold more than under 1F1B.

With activation checkpointing a micro-batch waiting for W keeps far more than its checkpoints, so `max_waiting`
(conf: zero_bubble_max_waiting) caps the Ws a stage holds back at c: stage s holds min(s, c), and the bubble is
(p-1)(F+B) - min(c, p-1) W. Even c = 0 (each W right after its B) beats 1F1B by (p-1) W: the previous stage gets
its gradient after B, not after B + W.

Point-to-point order: NCCL runs both directions of a link on one stream, in the order each side issues them, and a
send completes only when the peer's matching receive is posted; two neighbours that each send first wait on each
other forever (gloo buffers, so the CPU cannot show it). ZB-H1's orders interleave a link's sends and receives
differently on its two sides, so each link's order is its upstream stage's: the upstream stage sends and receives as
its order computes, and the downstream stage posts each activation receive (non-blocking, training/pipeline_engine.py)
as soon as the upstream order has it come, before the gradient sends that follow it there. tests/test_p2p_order.py
records each link's operations from the engines' own handlers and checks them against a model of NCCL's
semantics. `simulate` times these orders for bench/schedule_simulator.py.

Schedules with several chunks of layers per rank (global chunk g holds the g-th run of layers; `chunk_ids`):
- interleaved_1f1b (Megatron's virtual pipeline stages): rank r holds chunks r, r + p, ..., r + (v-1)p and runs
  Megatron's interleaved order (`interleaved_order`); its bubble is 1F1B's divided by v, (p-1)/(v m + p - 1).
- zbv (Qi et al.'s ZB-V, "Pipeline Parallelism with Controllable Memory"): rank r holds chunks r and 2p-1-r, so a
  micro-batch runs down the ranks and back up, turning on the last rank without a transfer; backwards split into B
  and W as in ZB-H1 (training/zbv_order.py's list schedule).
Their point-to-point operations come in one order per link that both sides follow (`p2p_program`), so no rank sends
while its peer sends; tests/test_p2p_order.py runs them under the model of NCCL's semantics.
"""
import collections
import functools

from deepspeed.runtime.pipe.schedule import (BackwardPass, BufferOpInstruction, ForwardPass, LoadMicroBatch,
                                             OptimizerStep, PipeInstruction, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                             SendActivation, SendGrad, TrainSchedule)

from deepspeed_internals.access import buffer_of_micro_batch
from models.pipeline_schedule_rules import (chunk_ids, chunks_per_rank, held_back_micro_batches,
                                            in_flight_micro_batches, producer)
from training.zbv_order import EQUAL_TIMES, zbv_durations, zbv_orders

PIPELINE_SCHEDULES = ("1f1b", "zero_bubble", "interleaved_1f1b", "zbv")
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", "zbv")  # B and W apart; the others run one backward, B + W


class BackwardInputPass(BackwardPass):
    """B: the input gradients the previous stage waits for; the weight gradients wait for a BackwardWeightPass."""


class BackwardWeightPass(PipeInstruction):
    """Compute the weight gradients deferred by the oldest micro-batch's BackwardInputPass and accumulate them."""


class PostRecvActivation(BufferOpInstruction):
    """Post the receive of a micro-batch's activations without waiting for it (the link's order, above)."""


class WaitRecvActivation(BufferOpInstruction):
    """Wait for the oldest posted activation receive and make it the buffer's inputs."""


def one_f_one_b_order(stages, micro_batches, stage):
    """DeepSpeed's TrainSchedule: min(p - s, m) forwards, then backward and forward alternate: [("F"|"B", j)]."""
    warmup = in_flight_micro_batches(stage, stages, micro_batches)
    order = [("F", j) for j in range(warmup)]
    for j in range(micro_batches - warmup):
        order += [("B", j), ("F", j + warmup)]
    return order + [("B", j) for j in range(micro_batches - warmup, micro_batches)]


def zero_bubble_order(stages, micro_batches, stage, max_waiting=None):
    """ZB-H1 on stage s: 1F1B's order of F and B, W_{j-h} after B_j in the steady state, where h = s, or
    min(s, max_waiting) if given (W before the next F keeps at most p micro-batches waiting for their W), one W
    after each cool-down B, the rest last."""
    held = held_back_micro_batches(stage, max_waiting)
    cool_down = micro_batches - in_flight_micro_batches(stage, stages, micro_batches)  # from B_cool_down on, no F
    order = []
    weights_done = 0
    for kind, j in one_f_one_b_order(stages, micro_batches, stage):
        order.append((kind, j))
        steady = j < cool_down
        if kind == "B" and (not steady or j - held >= weights_done):
            order.append(("W", weights_done))
            weights_done += 1
    return order + [("W", j) for j in range(weights_done, micro_batches)]


def activations_between_gradients(upstream_order):
    """The micro-batches whose activations a stage sends before it receives its first gradient, then between each
    gradient and the next: [[j, ...] before gradient 0, [j, ...] after gradient 0, ...]. upstream_order: the order
    of a stage that has a next stage (each F sends activations, each B receives a gradient)."""
    groups = [[]]
    for kind, micro_batch in upstream_order:
        if kind == "F":
            groups[-1].append(micro_batch)
        elif kind == "B":
            groups.append([])
    return groups


def stage_orders(stages, micro_batches, schedule="zero_bubble", max_waiting=None):
    """[[(kind, micro_batch), ...] per stage] of a one-chunk schedule (1f1b, zero_bubble)."""
    if schedule == "zero_bubble":
        return [zero_bubble_order(stages, micro_batches, stage, max_waiting) for stage in range(stages)]
    return [one_f_one_b_order(stages, micro_batches, stage) for stage in range(stages)]


@functools.lru_cache(maxsize=64)
def chunk_placement(schedule, stages, virtual_stages=1):
    """((rank, local chunk) of each global chunk, ...)."""
    placement = {}
    for rank in range(stages):
        for local, chunk in enumerate(chunk_ids(schedule, stages, rank, virtual_stages)):
            placement[chunk] = (rank, local)
    return tuple(placement[chunk] for chunk in range(len(placement)))


def interleaved_order(stages, micro_batches, virtual_stages, rank):
    """Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving) on one rank:
    [(kind, local_chunk, micro_batch)]. The step's m·v chunk forwards go in groups of p micro-batches per chunk
    (micro-batches 0..p-1 through chunk 0, then through chunk 1, ..., then micro-batches p..2p-1), the backwards
    likewise from the last chunk; (p - r - 1)·2 + (v - 1)·p forwards warm up, then forward and backward alternate."""
    if micro_batches % stages:
        raise ValueError(f"interleaved_1f1b needs a multiple of {stages} micro-batches, not {micro_batches}")
    total, group = micro_batches * virtual_stages, stages * virtual_stages

    def step(kind, k):
        chunk = k % group // stages
        return kind, chunk if kind == "F" else virtual_stages - 1 - chunk, k // group * stages + k % stages

    warmup = min((stages - rank - 1) * 2 + (virtual_stages - 1) * stages, total)
    order = [step("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step("F", k + warmup), step("B", k)]
    return order + [step("B", k) for k in range(total - warmup, total)]


def rank_orders(schedule, stages, micro_batches, virtual_stages=1, max_waiting=None, zbv_times=EQUAL_TIMES):
    """[[(kind, local_chunk, micro_batch), ...] per rank] of any schedule; zbv_times: zbv_order's durations."""
    if schedule == "interleaved_1f1b":
        orders = [interleaved_order(stages, micro_batches, virtual_stages, rank) for rank in range(stages)]
    elif schedule == "zbv":
        orders = [list(order) for order in zbv_orders(stages, micro_batches, max_waiting, zbv_times)]
    else:
        orders = [[(kind, 0, j) for kind, j in order]
                  for order in stage_orders(stages, micro_batches, schedule, max_waiting)]
    return orders


def simulate(stages, micro_batches, costs, schedule, max_waiting=None, virtual_stages=1, orders=None):
    """Time every rank's order: each computation starts when its rank is free and its input is complete
    (transfers free). costs: per rank {"F": s, "B": s, "W": s} for all its layers (a rank's chunks split them
    evenly), or [one such per local chunk]; where a schedule does not split the backward, it costs B + W. orders:
    rank_orders' (by default this schedule's; zbv's list-scheduled for each rank's times). Returns
    {(kind, global_chunk, micro_batch): (start, end)} (one chunk per rank: the chunk is the stage)."""
    per_rank = chunks_per_rank(schedule, virtual_stages)
    costs = [c if isinstance(c, (list, tuple)) else [{kind: t / per_rank for kind, t in c.items()}] * per_rank
             for c in costs]
    if orders is None:  # zbv: the list schedule for these times
        zbv_times = (zbv_durations([{kind: sum(chunk[kind] for chunk in c) for kind in "FBW"} for c in costs])
                     if schedule == "zbv" else EQUAL_TIMES)
        orders = rank_orders(schedule, stages, micro_batches, virtual_stages, max_waiting, zbv_times=zbv_times)
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    cost_of = [[{"F": c["F"], "B": c["B"] + (0 if split else c["W"]), "W": c["W"]} for c in rank_costs]
               for rank_costs in costs]
    chunk_of = [chunk_ids(schedule, stages, rank, virtual_stages) for rank in range(stages)]
    chunks = stages * per_rank
    done, free_at, position = {}, [0.0] * stages, [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for rank in range(stages):
            while position[rank] < len(orders[rank]):
                kind, local, j = orders[rank][position[rank]]
                step = (kind, chunk_of[rank][local], j)
                source = producer(*step, chunks)
                if source is not None and source not in done:
                    break
                start = max(free_at[rank], done[source][1] if source else 0.0)
                done[step] = (start, start + cost_of[rank][local][kind])
                free_at[rank] = start + cost_of[rank][local][kind]
                position[rank] += 1
                progressed = True
    if any(position[rank] < len(orders[rank]) for rank in range(stages)):
        raise RuntimeError(f"{schedule} orders deadlock for {stages} stages and {micro_batches} micro-batches")
    return done


P2POp = collections.namedtuple("P2POp", "direction peer tensor local_chunk micro_batch")
P2POp.__doc__ = """One point-to-point operation of a rank: direction "send" | "recv", peer rank, tensor "activation"
(a chunk's output, to the next chunk's rank) | "gradient" (a chunk's input gradient, to the previous chunk's rank),
local_chunk: this rank's chunk that made it (send) or takes it (recv), micro_batch."""


@functools.lru_cache(maxsize=64)
def link_transfers(schedule, stages, micro_batches, virtual_stages=1, max_waiting=None, zbv_times=EQUAL_TIMES):
    """{(rank, peer) with rank < peer: [(sender, P2POp of the sender, P2POp of the receiver), ...] in the link's
    order}: every transfer between two chunks on different ranks, ordered by when the unit-time run of the orders
    (F = B = W) makes it (ties: the upstream chunk's first). Both sides issue a link's operations in this order."""
    orders = rank_orders(schedule, stages, micro_batches, virtual_stages, max_waiting, zbv_times)
    placement = chunk_placement(schedule, stages, virtual_stages)
    done = simulate(stages, micro_batches, [{"F": 1, "B": 1, "W": 1}] * stages, schedule, max_waiting,
                    virtual_stages, orders)
    links = collections.defaultdict(list)
    for (kind, chunk, j), (_, end) in done.items():
        target = chunk + 1 if kind == "F" else chunk - 1
        if kind == "W" or not 0 <= target < len(placement) or placement[target][0] == placement[chunk][0]:
            continue
        (sender, sender_local), (receiver, receiver_local) = placement[chunk], placement[target]
        tensor = "activation" if kind == "F" else "gradient"
        links[(min(sender, receiver), max(sender, receiver))].append(
            ((end, min(chunk, target), kind != "F"), sender,
             P2POp("send", receiver, tensor, sender_local, j), P2POp("recv", sender, tensor, receiver_local, j)))
    return {link: tuple(transfer[1:] for transfer in sorted(transfers)) for link, transfers in links.items()}


def p2p_program(schedule, stages, micro_batches, rank, virtual_stages=1, max_waiting=None, zbv_times=EQUAL_TIMES):
    """What a rank issues, in order, to run its order over NCCL: [(action, item)] with
    ("compute", (kind, local_chunk, micro_batch)): run it;
    ("post", P2POp): issue the send or receive without waiting (isend / irecv);
    ("wait", P2POp): wait until that posted operation completed (each receive right before the computation that takes
    it; the sends at the end, where the step waits for all of them).
    Every link's operations are posted in link_transfers' order on both sides, so each side's stream holds the
    same transfers in the same order and a send always faces its own receive. A send is posted right after the
    computation that made it, with any receives of the link ahead of it posted first; a receive is posted when it
    is waited for, or earlier when a send of the link comes after it. tests/test_p2p_order.py executes these
    programs under its model of NCCL for 2-8 ranks. zbv_times: zbv_order's durations."""
    order = rank_orders(schedule, stages, micro_batches, virtual_stages, max_waiting, zbv_times)[rank]
    queues = {}  # peer: this rank's operations on the link, in the link's order
    for (low, high), transfers in link_transfers(schedule, stages, micro_batches, virtual_stages, max_waiting,
                                                 zbv_times).items():
        if rank in (low, high):
            queues[high if rank == low else low] = collections.deque(
                send if sender == rank else receive for sender, send, receive in transfers)
    program, sends, posted = [], [], set()

    def post_through(op):
        """Post the link's operations up to op; only receives may be ahead of it (a send not yet made would be)."""
        queue = queues[op.peer]
        while True:
            head = queue.popleft()
            if head != op and head.direction == "send":
                raise AssertionError(f"rank {rank}: {op} comes after {head} on its link, which is not made yet")
            program.append(("post", head))
            posted.add(head)
            if head == op:
                return

    for kind, local, j in order:
        for op in inputs_received(schedule, stages, rank, virtual_stages, (kind, local, j)):
            if op not in posted:
                post_through(op)
            program.append(("wait", op))
        program.append(("compute", (kind, local, j)))
        for op in outputs_sent(schedule, stages, rank, virtual_stages, (kind, local, j)):
            post_through(op)
            sends.append(op)
    leftover = {peer: list(queue) for peer, queue in queues.items() if queue}
    assert not leftover, f"rank {rank}: operations never posted {leftover}"
    return program + [("wait", op) for op in sends]


def _neighbour(schedule, stages, rank, virtual_stages, local, step):
    """(peer rank, peer's local chunk) of the chunk `step` (+1 or -1) from this rank's local chunk, if it is on
    another rank; else None."""
    placement = chunk_placement(schedule, stages, virtual_stages)
    chunk = chunk_ids(schedule, stages, rank, virtual_stages)[local] + step
    if not 0 <= chunk < len(placement) or placement[chunk][0] == rank:
        return None
    return placement[chunk]


def inputs_received(schedule, stages, rank, virtual_stages, computation):
    """The receives a computation takes: an F the previous chunk's activations, a B the next chunk's gradient."""
    kind, local, j = computation
    if kind == "W":
        return []
    peer = _neighbour(schedule, stages, rank, virtual_stages, local, -1 if kind == "F" else 1)
    return [] if peer is None else [P2POp("recv", peer[0], "activation" if kind == "F" else "gradient", local, j)]


def outputs_sent(schedule, stages, rank, virtual_stages, computation):
    """The sends a computation makes: an F's activations to the next chunk, a B's input gradient to the previous."""
    kind, local, j = computation
    if kind == "W":
        return []
    peer = _neighbour(schedule, stages, rank, virtual_stages, local, 1 if kind == "F" else -1)
    return [] if peer is None else [P2POp("send", peer[0], "activation" if kind == "F" else "gradient", local, j)]

class ZeroBubbleSchedule(TrainSchedule):
    """One step per computation of this stage's zero-bubble order: receive what it needs, compute, send what it
    made. The optimizer step comes after the last W, so it sees every gradient of the batch. Pipe buffers are
    TrainSchedule's: a buffer holds a micro-batch from its F to its B, and those run in 1F1B's order.

    The first stage runs each B and its W as one undivided BackwardPass, 1F1B's: its order puts every W right
    after its own B, and no stage waits for the first stage's input gradient, so splitting would only cost (the
    split backward computes 2-5% slower on this project's CPU, bench/pipeline_efficiency.py)."""

    def __init__(self, micro_batches, stages, stage_id, max_waiting=None):
        super().__init__(micro_batches, stages, stage_id)
        self.order = zero_bubble_order(stages, micro_batches, stage_id, max_waiting)
        # Activation receives in the previous stage's order of its link (module docstring).
        self.receives = [] if self.is_first_stage else activations_between_gradients(
            zero_bubble_order(stages, micro_batches, stage_id - 1, max_waiting))

    def _post_receives(self, after_gradients):
        return [PostRecvActivation(buffer_of_micro_batch(self, j)) for j in self.receives[after_gradients]]

    def steps(self):
        posted = self._post_receives(0) if self.receives else []
        for kind, micro_batch in self.order:
            if kind == "W" and self.is_first_stage:
                continue
            buffer_id = buffer_of_micro_batch(self, micro_batch)
            if kind == "F":
                cmds = posted + ([] if self.is_first_stage else [WaitRecvActivation(buffer_id)])
                posted = []
                if self.is_first_stage or self.is_last_stage:
                    cmds.append(LoadMicroBatch(buffer_id))
                cmds.append(ForwardPass(buffer_id))
                if not self.is_last_stage:
                    cmds.append(SendActivation(buffer_id))
            elif kind == "B":
                cmds = [] if self.is_last_stage else [RecvGrad(buffer_id)]
                if self.is_first_stage:
                    cmds.append(BackwardPass(buffer_id))
                else:
                    cmds += [BackwardInputPass(buffer_id), SendGrad(buffer_id)]
                    cmds += self._post_receives(micro_batch + 1)
            else:
                cmds = [BackwardWeightPass()]
            yield cmds
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
