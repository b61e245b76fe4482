"""The zero-bubble pipeline schedule (ZB-H1, Qi et al., ICLR 2024) in DeepSpeed's instruction style.

Each backward is split in two: B, the input gradient the previous stage waits for, and W, the weight gradient
nobody waits for (models/weight_grads.py defers it). A stage runs B as soon as its gradient has arrived, else the
next forward, else the oldest pending W: the Ws of the last micro-batches fill the cool-down, where 1F1B idles.
Memory stays 1F1B's: a stage starts a forward only while fewer than `p` micro-batches are between their F and their
W (1F1B's peak, that of stage 0; a micro-batch waiting only for W holds its linear layers' inputs and output
gradients, less than a whole forward's activations).

The order of each stage's computations comes from a list-scheduling simulation of all stages (`stage_orders`),
with equal F, B and W times unless measured ones are given; bench/schedule_simulator.py runs the same simulation
with measured times. Any order it produces respects every dependency, so executing it with non-blocking sends
(training/pipeline_engine.py) cannot deadlock.
"""
from deepspeed.runtime.pipe.schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction,
                                             RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation,
                                             SendGrad, TrainSchedule)

PIPELINE_SCHEDULES = ("1f1b", "zero_bubble")


class BackwardWeightPass(PipeInstruction):
    """Compute the weight gradients deferred by the oldest micro-batch's BackwardPass and accumulate them."""


def simulate(stages, micro_batches, costs, policy):
    """Run every stage's computations in time; returns ({(kind, stage, micro_batch): (start, end)}, orders), orders
    being [[(kind, micro_batch), ...] per stage]. costs: per stage {"F": s, "B": s, "W": s}. policy "1f1b":
    DeepSpeed's TrainSchedule order (stage s runs min(p - s, m) forwards, then backward and forward alternate; a
    backward is B and W together); "zero_bubble": B if its gradient is there, else F while fewer than p
    micro-batches await their W, else the oldest W. Transfers between stages take no time."""
    p, m = stages, micro_batches
    kinds = ("F", "B") if policy == "1f1b" else ("F", "B", "W")
    cost_of = [dict(c, B=c["B"] + c["W"]) if policy == "1f1b" else c for c in costs]
    done, free_at = {}, [0.0] * p
    count = [dict.fromkeys(kinds, 0) for _ in range(p)]
    orders = [[] for _ in range(p)]

    def producer(kind, s, j):
        if kind == "F":
            return ("F", s - 1, j) if s > 0 else None
        if kind == "B":
            return ("B", s + 1, j) if s < p - 1 else ("F", s, j)
        return ("B", s, j)

    def options(s):
        n = count[s]
        if policy == "1f1b":
            warmup = min(p - s, m)
            if n["B"] == m:
                return []
            return [("B", n["B"])] if n["F"] == m or n["F"] - n["B"] == warmup else [("F", n["F"])]
        return ([("B", n["B"])] if n["B"] < n["F"] else []) + \
               ([("F", n["F"])] if n["F"] < m and n["F"] - n["W"] < p else []) + \
               ([("W", n["W"])] if n["W"] < n["B"] else [])

    def inputs_ready(kind, s, j):
        """When (kind, s, j) could start, or None while its producer is not scheduled."""
        source = producer(kind, s, j)
        return 0.0 if source is None else done[source][1] if source in done else None

    while True:
        busy = [s for s in range(p) if options(s)]
        if not busy:
            return done, orders
        now = min(free_at[s] for s in busy)
        deciding = [s for s in busy if free_at[s] == now]
        for s in deciding:
            runnable = [(kind, j) for kind, j in options(s)
                        if inputs_ready(kind, s, j) is not None and inputs_ready(kind, s, j) <= now]
            if runnable:
                kind, j = runnable[0]
                done[(kind, s, j)] = (now, now + cost_of[s][kind])
                free_at[s] = now + cost_of[s][kind]
                count[s][kind] += 1
                orders[s].append((kind, j))
                break
        else:  # nobody can start now: the idle stages wait for the next end or decision elsewhere
            later = [end for _, end in done.values() if end > now] + [free_at[o] for o in busy if free_at[o] > now]
            if not later:
                raise RuntimeError(f"{policy} schedule deadlocks at time {now}")
            for s in deciding:
                free_at[s] = min(later)


def stage_orders(stages, micro_batches, costs=None):
    """The zero-bubble order of computations of every stage: [[("F" | "B" | "W", micro_batch), ...] per stage]."""
    costs = costs or [{"F": 1.0, "B": 1.0, "W": 1.0}] * stages
    return simulate(stages, micro_batches, costs, "zero_bubble")[1]


class ZeroBubbleSchedule(TrainSchedule):
    """One step per computation of this stage's zero-bubble order: receive what it needs, compute, send what it
    made. The optimizer step comes after the last W, so it sees every gradient of the batch."""

    def __init__(self, micro_batches, stages, stage_id):
        super().__init__(micro_batches, stages, stage_id)
        self.order = stage_orders(stages, micro_batches)[stage_id]

    def steps(self):
        for kind, micro_batch in self.order:
            buffer_id = self._buffer_idx(micro_batch)
            if kind == "F":
                cmds = [] if self.is_first_stage else [RecvActivation(buffer_id)]
                if self.is_first_stage or self.is_last_stage:
                    cmds.append(LoadMicroBatch(buffer_id))
                cmds.append(ForwardPass(buffer_id))
                if not self.is_last_stage:
                    cmds.append(SendActivation(buffer_id))
            elif kind == "B":
                cmds = [] if self.is_last_stage else [RecvGrad(buffer_id)]
                cmds.append(BackwardPass(buffer_id))
                if not self.is_first_stage:
                    cmds.append(SendGrad(buffer_id))
            else:
                cmds = [BackwardWeightPass()]
            yield cmds
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def num_pipe_buffers(self):
        """One buffer per micro-batch: a buffer holds tensors only between a micro-batch's F and its B."""
        return self.micro_batches
