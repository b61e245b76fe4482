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
"""
from deepspeed.runtime.pipe.schedule import (BackwardPass, BufferOpInstruction, ForwardPass, LoadMicroBatch,
                                             OptimizerStep, PipeInstruction, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                             SendActivation, SendGrad, TrainSchedule)

from deepspeed_internals.access import buffer_of_micro_batch
from models.pipeline_schedule_rules import held_back_micro_batches, in_flight_micro_batches

PIPELINE_SCHEDULES = ("1f1b", "zero_bubble")


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
    """[[(kind, micro_batch), ...] per stage] of a schedule."""
    if schedule == "zero_bubble":
        return [zero_bubble_order(stages, micro_batches, stage, max_waiting) for stage in range(stages)]
    return [one_f_one_b_order(stages, micro_batches, stage) for stage in range(stages)]


def simulate(stages, micro_batches, costs, schedule, max_waiting=None):
    """Time every stage's order: each computation starts when its stage is free and its input is complete
    (transfers free). costs: per stage {"F": s, "B": s, "W": s}; under 1F1B a backward costs B + W.
    Returns {(kind, stage, micro_batch): (start, end)}."""
    orders = stage_orders(stages, micro_batches, schedule, max_waiting)
    cost_of = [dict(c, B=c["B"] + c["W"]) if schedule == "1f1b" else c for c in costs]
    done, free_at, position = {}, [0.0] * stages, [0] * stages

    def producer(kind, s, j):
        if kind == "F":
            return ("F", s - 1, j) if s > 0 else None
        if kind == "B":
            return ("B", s + 1, j) if s < stages - 1 else ("F", s, j)
        return ("B", s, j)

    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, j = orders[s][position[s]]
                source = producer(kind, s, j)
                if source is not None and source not in done:
                    break
                start = max(free_at[s], done[source][1] if source else 0.0)
                done[(kind, s, j)] = (start, start + cost_of[s][kind])
                free_at[s] = start + cost_of[s][kind]
                position[s] += 1
                progressed = True
    if any(position[s] < len(orders[s]) for s in range(stages)):
        raise RuntimeError(f"{schedule} orders deadlock for {stages} stages and {micro_batches} micro-batches")
    return done


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
