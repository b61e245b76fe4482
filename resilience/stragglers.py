"""Stragglers reported. A pipeline runs at the pace of its slowest rank, and the others only wait: every logging
interval each rank's seconds of compute (the schedule's forward, backward and W instructions) and of communication
(sends, receives, gradient reductions: mostly waiting for a peer) are gathered, and a rank computing more than
`straggler_margin` slower than the median of the other ranks of its stage (the same work), or a stage than the
median of the other stages, is named in the log and the metrics. Timed on the device's stream under CUDA (events,
read once per interval: no host sync per micro-batch), by the clock on the CPU.
"""
import statistics

from deepspeed.runtime.pipe import schedule

import collectives
from deepspeed_internals.access import instruction_handlers
from engines.chunked_engine import ChunkBackwardPass, ChunkForwardPass, PostTransfer, WaitTransfer
from engines.instruction_listeners import InstructionClock, add_instruction_listener
from engines.zero_bubble_schedule import BackwardWeightPass, PostRecvActivation, WaitRecvActivation

# BackwardInputPass is a BackwardPass; the chunked schedules' (engines/chunked_engine.py) count too
COMPUTE = (schedule.ForwardPass, schedule.BackwardPass, BackwardWeightPass, ChunkForwardPass, ChunkBackwardPass)
COMMUNICATION = (schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad, schedule.RecvGrad,
                 PostRecvActivation, WaitRecvActivation, PostTransfer, WaitTransfer, schedule.ReduceGrads,
                 schedule.ReduceTiedGrads)


class StragglerWatch:
    def __init__(self, engine, margin):
        self.engine, self.margin = engine, margin
        self.clock, self.training = InstructionClock(), False
        self.kinds = {instruction: "compute" if issubclass(instruction, COMPUTE) else "communication"
                      for instruction in instruction_handlers(engine)
                      if issubclass(instruction, COMPUTE + COMMUNICATION)}
        add_instruction_listener(engine, self)
        train_batch = engine.train_batch

        def training_batch(*args, **kwargs):  # evaluation's instructions are not counted
            self.training = True
            try:
                return train_batch(*args, **kwargs)
            finally:
                self.training = False
        engine.train_batch = training_batch

    def instruction_started(self, instruction):
        if not self.training or instruction not in self.kinds:
            return None
        return self.clock.start()

    def instruction_ended(self, instruction, started):
        if started is not None:
            self.clock.stop(self.kinds[instruction], started)

    def window_report(self, log):
        """Collective, once per logging interval: gather every rank's seconds since the last call, log a line per
        straggler (log: rank 0's print) and return the metrics."""
        seconds = self.clock.take()
        every_rank = collectives.all_gather_numbers(
            [seconds.get("compute", 0.0), seconds.get("communication", 0.0), self.engine.stage_id])
        compute, communication = [float(t[0]) for t in every_rank], [float(t[1]) for t in every_rank]
        ranks, stages = find_stragglers(compute, [int(t[2]) for t in every_rank], communication, self.margin)
        for line in [*ranks.values(), *stages.values()]:
            log(line)
        slowest = max(range(len(compute)), key=compute.__getitem__)
        return {"slowest_rank": slowest, "slowest_rank_compute_s": compute[slowest],
                "median_rank_compute_s": statistics.median(compute),
                **({"straggler_ranks": list(ranks)} if ranks else {}),
                **({"straggler_stages": list(stages)} if stages else {})}


def find_stragglers(compute, stages, communication, margin):
    """({rank: line} for each rank computing more than (1 + margin) x the median of the other ranks of its stage,
    {stage: line} for each stage computing (its ranks' median) more than that x the median of the other stages)."""
    by_stage, ranks, slow_stages = {}, {}, {}
    for rank, stage in enumerate(stages):
        by_stage.setdefault(stage, []).append(rank)
    for stage, members in sorted(by_stage.items()):
        for rank in members:
            others = [compute[r] for r in members if r != rank]
            if others and compute[rank] > (1 + margin) * statistics.median(others):
                ranks[rank] = (f"straggler: rank {rank} (stage {stage}) computed {compute[rank]:.2f}s in this "
                               f"interval, {compute[rank] / statistics.median(others):.2f}x the median of its "
                               f"stage's other ranks; it waited {communication[rank]:.2f}s on peers")
    stage_compute = {stage: statistics.median(compute[r] for r in members) for stage, members in by_stage.items()}
    for stage, seconds in sorted(stage_compute.items()):
        others = [s for other, s in stage_compute.items() if other != stage]
        if others and seconds > (1 + margin) * statistics.median(others):
            waited = statistics.median(communication[r] for r in by_stage[stage])
            slow_stages[stage] = (f"straggler: stage {stage} computed {seconds:.2f}s in this interval, "
                                  f"{seconds / statistics.median(others):.2f}x the median of the other stages; its "
                                  f"ranks waited {waited:.2f}s on peers (a slow device, or an unbalanced partition)")
    return ranks, slow_stages
