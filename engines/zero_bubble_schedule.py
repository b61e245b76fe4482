"""The zero-bubble schedule (ZB-H1) in DeepSpeed's instruction style: its split backward's instructions and the
TrainSchedule that issues them from schedules/orders.py's zero_bubble_order (engines/pipeline_engine.py runs them)."""
from deepspeed.runtime.pipe.schedule import (BackwardPass, BufferOpInstruction, ForwardPass, LoadMicroBatch,
                                             OptimizerStep, PipeInstruction, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                             SendActivation, SendGrad, TrainSchedule)

from deepspeed_internals.access import buffer_of_micro_batch
from schedules.orders import activations_between_gradients, zero_bubble_order


class BackwardInputPass(BackwardPass):
    """B: the input gradients the previous stage waits for; the weight gradients wait for a BackwardWeightPass."""


class BackwardWeightPass(PipeInstruction):
    """Compute the weight gradients deferred by the oldest micro-batch's BackwardInputPass and accumulate them."""


class PostRecvActivation(BufferOpInstruction):
    """Post the receive of a micro-batch's activations without waiting for it (the link's order, above)."""


class WaitRecvActivation(BufferOpInstruction):
    """Wait for the oldest posted activation receive and make it the buffer's inputs."""


class ZeroBubbleSchedule(TrainSchedule):
    """One step per computation of this stage's zero-bubble order: receive what it needs, compute, send what it
    made. The optimizer step comes after the last W, so it sees every gradient of the batch. Pipe buffers are
    TrainSchedule's: a buffer holds a micro-batch from its F to its B, and those run in 1F1B's order.

    The first stage runs each B and its W as one undivided BackwardPass, 1F1B's: its order puts every W right
    after its own B, and no stage waits for the first stage's input gradient, so splitting would only cost (a split
    backward computes slower than an undivided one: bench/README.md)."""

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
