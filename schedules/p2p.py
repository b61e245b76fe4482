"""Each rank's point-to-point program: the sends and receives its order needs, in one order per link that both of
its sides follow, so that NCCL (which runs a link's operations in the order each side issues them and does not
buffer) cannot deadlock. tests/test_p2p_order.py executes these programs under a model of NCCL's semantics."""
import collections
import functools

from schedules.orders import chunk_placement, rank_orders
from schedules.rules import chunk_ids
from schedules.simulator import simulate
from schedules.zbv_order import EQUAL_TIMES


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
