"""The orders of the pipeline schedules: which forward (F), backward (B) and weight-gradient (W) computation each
rank runs next, as pure arithmetic (no torch): what the engines run (engines/) and the planner simulates (planner/).

The zero-bubble pipeline schedule (ZB-H1, Qi et al., ICLR 2024) in DeepSpeed's instruction style.

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
its order computes, and the downstream stage posts each activation receive (non-blocking, engines/pipeline_engine.py)
as soon as the upstream order has it come, before the gradient sends that follow it there. tests/test_p2p_order.py
records each link's operations from the engines' own handlers and checks them against a model of NCCL's
semantics. `simulate` times these orders for bench/schedule_simulator.py.

Schedules with several chunks of layers per rank (global chunk g holds the g-th run of layers; `chunk_ids`):
- interleaved_1f1b (Megatron's virtual pipeline stages): rank r holds chunks r, r + p, ..., r + (v-1)p and runs
  Megatron's interleaved order (`interleaved_order`); its bubble is 1F1B's divided by v, (p-1)/(v m + p - 1).
- zbv (Qi et al.'s ZB-V, "Pipeline Parallelism with Controllable Memory"): rank r holds chunks r and 2p-1-r, so a
  micro-batch runs down the ranks and back up, turning on the last rank without a transfer; backwards split into B
  and W as in ZB-H1 (schedules/zbv_order.py's list schedule).
Their point-to-point operations come in one order per link that both sides follow (`p2p_program`), so no rank sends
while its peer sends; tests/test_p2p_order.py runs them under the model of NCCL's semantics.
"""
import functools

from schedules.rules import chunk_ids, held_back_micro_batches, in_flight_micro_batches
from schedules.zbv_order import EQUAL_TIMES, zbv_orders

PIPELINE_SCHEDULES = ("1f1b", "zero_bubble", "interleaved_1f1b", "zbv")
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", "zbv")  # B and W apart; the others run one backward, B + W


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
