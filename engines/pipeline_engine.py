"""DeepSpeed's PipelineEngine running the zero-bubble schedule (schedules/orders.py).

What changes against the 1F1B engine: the new BackwardInputPass computes only input gradients (the stage's linear
layers queue their weight-gradient work, models/weight_grads.py) and the new BackwardWeightPass instruction runs the
oldest queued work into the same gradient buffers (fp32 or bf16, ZeRO-0 or 1, offloaded or not). Each link's
operations follow its upstream stage's order (schedules/orders.py, for NCCL): activation receives are posted ahead
and waited for at the forward, sends are posted and waited for at the step's end. Loss, gradient reduction,
clipping and the optimizer step are the engine's own, and run after every W of the batch.

Every schedule's engine (1F1B's too: use_one_backward) runs a stage's backward as one autograd pass from all of its
floating outputs. DeepSpeed's handler runs one pass per output (a mixture of experts sends its hidden states and its
router-probability sums, models/router_loss.py), so each parameter's gradient would be summed in parts that depend
on where the stages cut the model: 1F1B and the chunked schedules then differ by rounding (4e-7 of a gradient, which
Adam's first step carries to 5e-5 of a weight), where one pass gives the same bits on any partition.
"""
import collections

import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

import collectives
from deepspeed_internals.access import (accumulated_gradient, activation_buffer, add_grads_to_bf16_optimizer,
                                        add_instruction_handlers, clear_bf16_optimizer_grads, pipe_buffer,
                                        receive_activation_shapes_once, received_gradients, run_backward_pass,
                                        send_activation_shapes_once, sends_need_deepspeed_handlers, set_pipe_buffer,
                                        set_received_gradients, uses_bf16_optimizer)
from errors import ConfigError
from models.tensor_parallel import sum_step_gradients
from models.weight_grads import WeightGradQueue
from engines.zero_bubble_schedule import (BackwardInputPass, BackwardWeightPass, PostRecvActivation, WaitRecvActivation,
                                          ZeroBubbleSchedule)


class HandGradients(torch.autograd.Function):
    """One node over a stage's floating outputs: a backward from its output (0-d) hands each of them its received
    gradient, so that autograd runs a single pass from all of them."""

    @staticmethod
    def forward(ctx, grads, *outputs):
        ctx.grads = grads
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads, ctx.grads = ctx.grads, None
        return None, *grads


class OneBackwardPipelineEngine(PipelineEngine):
    """DeepSpeed's 1F1B engine, a stage's backward one autograd pass from all of its floating outputs (the module's
    docstring says why). Its _exec_backward_pass overrides DeepSpeed's (deepspeed_internals/ lists it)."""

    def _exec_backward_pass(self, buffer_id):
        outputs = pipe_buffer(self, "outputs", buffer_id)
        floating = [t for t in outputs if t.is_floating_point()] if isinstance(outputs, tuple) else []
        if len(floating) < 2 or self.is_last_stage():
            return super()._exec_backward_pass(buffer_id)
        grads = received_gradients(self)  # DeepSpeed's 1F1B receives into them again: put back after
        joined = HandGradients.apply(grads, *floating)
        set_pipe_buffer(self, "outputs", buffer_id, joined)
        set_received_gradients(self, torch.ones_like(joined))
        super()._exec_backward_pass(buffer_id)
        set_received_gradients(self, grads)

    def _exec_reduce_tied_grads(self):
        """DeepSpeed's sums of the tied weights' gradients, then the tensor-parallel sums left to the step (a
        mixture's experts under sequence parallelism, models/tensor_parallel.py sum_gradients_at_step): after every
        backward (and W) of the step, before the data-parallel reduction and clipping."""
        super()._exec_reduce_tied_grads()
        sum_step_gradients(self.module, self.module.parallel, lambda param: accumulated_gradient(self, param))


add_instruction_handlers(OneBackwardPipelineEngine, {
    schedule.BackwardPass: OneBackwardPipelineEngine._exec_backward_pass,
    schedule.ReduceTiedGrads: OneBackwardPipelineEngine._exec_reduce_tied_grads,
})


def use_one_backward(engine):
    """Turn the PipelineEngine that deepspeed.initialize built into the one whose stage backward is one pass."""
    engine.__class__ = OneBackwardPipelineEngine
    return engine


class ZeroBubblePipelineEngine(OneBackwardPipelineEngine):
    """Its _train_schedule and _exec_* methods override DeepSpeed's (deepspeed_internals/ lists them)."""

    def _train_schedule(self):
        return ZeroBubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id,
                                  max_waiting=self.zero_bubble_max_waiting)

    def _exec_backward_input_pass(self, buffer_id):
        with self.module.parallel.weight_grads.defer():
            run_backward_pass(self, buffer_id)

    def _exec_backward_weight_pass(self):
        """The bf16 optimizer copies .grad into its fp32 buffer after each backward (B did, for the rest of the
        stage's gradients): W does the same with a cleared .grad, so nothing is added twice."""
        if uses_bf16_optimizer(self):
            clear_bf16_optimizer_grads(self.optimizer)
        self.module.parallel.weight_grads.run_oldest()
        if uses_bf16_optimizer(self):
            add_grads_to_bf16_optimizer(self.optimizer)

    def _exec_send_activations(self, buffer_id):
        outputs = pipe_buffer(self, "outputs", buffer_id)
        send_activation_shapes_once(self, outputs)  # blocking: the next stage's first instruction receives them
        self._send_async(outputs if isinstance(outputs, tuple) else (outputs,), self.next_stage)

    def _exec_post_recv_activations(self, buffer_id):
        """Into new tensors: the buffer may still hold an earlier micro-batch until its backward."""
        receive_activation_shapes_once(self)  # blocking: the previous stage sends them first
        shapes = activation_buffer(self)
        tensors = tuple(torch.empty_like(t) for t in (shapes if isinstance(shapes, tuple) else (shapes,)))
        peer = self.grid.stage_to_global(self.prev_stage)
        self._posted_receives.append((buffer_id, tensors, [collectives.irecv(t, peer) for t in tensors]))

    def _exec_wait_recv_activations(self, buffer_id):
        posted_buffer, tensors, works = self._posted_receives.popleft()
        if posted_buffer != buffer_id:
            raise RuntimeError(f"zero_bubble: activations posted for buffer {posted_buffer} waited for as {buffer_id}")
        collectives.wait(works)
        for tensor in tensors:
            tensor.requires_grad = tensor.is_floating_point()
        inputs = tensors if isinstance(activation_buffer(self), tuple) else tensors[0]
        set_pipe_buffer(self, "inputs", buffer_id, inputs)

    def _exec_send_grads(self, buffer_id):
        inputs = pipe_buffer(self, "inputs", buffer_id)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self._send_async([t.grad for t in inputs if t.is_floating_point()], self.prev_stage)
        set_pipe_buffer(self, "inputs", buffer_id, None)

    def _exec_recv_grads(self, buffer_id):
        """Into new tensors, not the engine's one reused buffer: a deferred W may still hold the last one."""
        outputs = pipe_buffer(self, "outputs", buffer_id)
        grads = [torch.empty_like(t) for t in (outputs if isinstance(outputs, tuple) else (outputs,))
                 if t.is_floating_point()]
        peer = self.grid.stage_to_global(self.next_stage)
        for grad in grads:
            collectives.recv(grad, peer)
        set_received_gradients(self, grads if isinstance(outputs, tuple) else grads[0])

    def _send_async(self, tensors, stage):
        """isend each tensor; the request keeps it alive until the receiver has it (waited for at the step's end)."""
        peer = self.grid.stage_to_global(stage)
        self._sends = [work for work in self._sends if not work.is_completed()]
        self._sends += [collectives.isend(t.contiguous(), peer) for t in tensors]

    def _exec_reduce_tied_grads(self):
        """The step's first instruction after the last W: sends complete, no weight gradient left behind."""
        if len(self.module.parallel.weight_grads) or self._posted_receives:
            raise RuntimeError("zero_bubble: a micro-batch's weight gradients or activations were left over at the step")
        collectives.wait(self._sends)
        self._sends = []
        super()._exec_reduce_tied_grads()


add_instruction_handlers(ZeroBubblePipelineEngine, {
    BackwardInputPass: ZeroBubblePipelineEngine._exec_backward_input_pass,
    BackwardWeightPass: ZeroBubblePipelineEngine._exec_backward_weight_pass,
    PostRecvActivation: ZeroBubblePipelineEngine._exec_post_recv_activations,
    WaitRecvActivation: ZeroBubblePipelineEngine._exec_wait_recv_activations,
    schedule.SendActivation: ZeroBubblePipelineEngine._exec_send_activations,
    schedule.SendGrad: ZeroBubblePipelineEngine._exec_send_grads,
    schedule.RecvGrad: ZeroBubblePipelineEngine._exec_recv_grads,
    schedule.ReduceTiedGrads: ZeroBubblePipelineEngine._exec_reduce_tied_grads,
})


def use_zero_bubble(engine, max_waiting=None):
    """Turn the PipelineEngine that deepspeed.initialize built (it picks the class itself) into the zero-bubble
    one: the subclass adds methods and instructions, and its state: the module's weight-gradient queue, the sends
    and activation receives in flight and the cap on micro-batches waiting for W (None: ZB-H1's)."""
    if sends_need_deepspeed_handlers(engine):
        raise ConfigError("pipeline_schedule=zero_bubble does not support dynamic shapes, bool tensors between "
                          "stages or pipe_partitioned; use pipeline_schedule=1f1b.")
    engine.module.parallel.weight_grads = WeightGradQueue()
    engine._sends = []
    engine._posted_receives = collections.deque()
    engine.zero_bubble_max_waiting = max_waiting
    engine.__class__ = ZeroBubblePipelineEngine
    return engine
