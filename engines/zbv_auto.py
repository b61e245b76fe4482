"""zbv_times=auto: ZB-V's V order made for the run's own F, B and W times, measured by the trainer.

The V order made for F = B = W lets ranks wait where their F, B and W differ (the rank holding the LM head and the
loss computes a heavy F, the other rank a heavy B; bench/README.md), and those times depend on the device, the model
and the partition. Under auto every rank times its chunks' F, B and W instructions through one step (MEASURED_STEP:
the first is left out, it allocates what later steps reuse), the ranks all-gather them (each kind's median times its
count, which a rank slowed now and then by another process does not move; collectives/), and every rank makes the
V order for each stage's mean over its ranks (its data, tensor and context parallel replicas) from the same
gathered numbers: every rank runs the same order from the next step on, so each link's operations
stay matched on both of its sides (schedules/orders.py p2p_program; tests/test_p2p_order.py runs orders made for
other times under its model of NCCL). On CUDA the instructions are timed by events on the device's stream, read once,
after the measured step; on the CPU by the process's CPU time. A new order changes when each computation runs, not
what it computes.
"""
import itertools
import statistics
import time

import collectives
from engines.instruction_listeners import InstructionClock, add_instruction_listener
from schedules.zbv_order import stage_times

MEASURED_STEP = 2  # the train_batch whose F, B and W are timed (the first allocates the buffers later steps reuse)




def robust_sums(seconds):
    """[F, B, W] seconds of a step from each instruction's ({(kind, serial): seconds}): each kind's median times its
    count, which a few instructions slowed by another process (a shared host) do not move. A rank's two chunks run
    m of each kind apiece, so the median falls between the two chunks' times."""
    by_kind = {kind: sorted(t for (k, _), t in seconds.items() if k == kind) for kind in "FBW"}
    return [statistics.median(times) * len(times) if times else 0.0 for times in by_kind.values()]


class MeasuredTimes:
    """Times F, B and W (kinds: {instruction class: "F" | "B" | "W"}) through the MEASURED_STEP-th train_batch,
    then agrees on each stage's times with every rank and calls remake([[F, B, W] seconds per stage])."""

    def __init__(self, engine, kinds, remake):
        self.engine, self.kinds, self.remake = engine, kinds, remake
        # on the CPU the process's CPU time: what another process on a shared host takes does not count
        self.clock = InstructionClock(time.process_time)
        self.serial, self.steps, self.timing = itertools.count(), 0, False
        add_instruction_listener(engine, self)
        train_batch = engine.train_batch

        def measured_train_batch(*args, **kwargs):  # evaluation's instructions are not timed
            self.steps += 1
            self.timing = self.steps == MEASURED_STEP
            try:
                result = train_batch(*args, **kwargs)
            finally:
                self.timing = False
            if self.steps == MEASURED_STEP:
                self.remake(self.agreed_times())
            return result
        engine.train_batch = measured_train_batch

    def instruction_started(self, instruction):
        return self.clock.start() if self.timing and instruction in self.kinds else None

    def instruction_ended(self, instruction, started):
        if started is not None:  # each instruction apart, for the medians
            self.clock.stop((self.kinds[instruction], next(self.serial)), started)

    def agreed_times(self):
        """Collective: every rank's F, B, W seconds all-gathered; each stage's (stage_times), alike on every rank."""
        every_rank = collectives.all_gather_numbers([self.engine.stage_id, *robust_sums(self.clock.take())])
        return stage_times(every_rank, self.engine.num_stages)
