"""DeepSpeed's PipelineEngine running several chunks of layers per rank: interleaved 1F1B (rank r holds chunks r,
r + p, ...) and ZB-V (rank r holds chunks r and 2p - 1 - r), from orders of (kind, local chunk, micro-batch)
(training/schedule.py computes them; the model's chunks: models/pipeline.py LlamaPipeline).

Each instruction names its chunk; a (chunk, micro-batch) has its own pipe buffer. The activations of global chunk g
go to the rank holding chunk g + 1 and its input gradients to the rank holding g - 1: sent point-to-point through
collectives/, or handed over in place where that rank is this one (the V's turn on the last rank). DeepSpeed's
own forward and backward handlers compute each chunk: while a chunk runs, the engine's first and last stage are
the model's first and last chunk, so the loss is the last chunk's (the last rank's under interleaving, rank 0's
under the V) and only that chunk scales by the accumulation steps. Outside a chunk they mean the rank holding
them: the rank of the first chunk loads inputs, that of the last chunk labels (under the V rank 0 does both; a
rank holding neither reads no data). An order with W splits each backward as the zero-bubble schedule does
(models/weight_grads.py: B now, W in the order's place, oldest first).

Sends are posted (isend) as each chunk produces them and waited for at the step's end; a receive blocks where the
order needs its tensor. The first activation on each link is preceded by its shapes (DeepSpeed's meta message).
"""
import torch
from deepspeed.runtime.pipe.schedule import OptimizerStep, PipeInstruction, ReduceGrads, ReduceTiedGrads, TrainSchedule

import collectives
from deepspeed_internals.access import (add_instruction_handlers, load_micro_batch, pipe_buffer,
                                        receive_tensor_shapes, run_backward_pass, run_forward_pass,
                                        send_tensor_shapes, set_pipe_buffer, set_received_gradients)
from training.pipeline_engine import ZeroBubblePipelineEngine, use_zero_bubble
from training.schedule import BackwardWeightPass


class ChunkForwardPass(PipeInstruction):
    """F of a local chunk on a micro-batch: its input loaded, received or handed over, the forward pass (the loss
    on the last chunk), its output to the next chunk."""


class ChunkBackwardPass(PipeInstruction):
    """B of a local chunk on a micro-batch (split: input gradients only, its W later), the input gradient to the
    previous chunk."""


class ChunkedSchedule(TrainSchedule):
    """One step per entry of the rank's order, then the gradient reductions and the optimizer step."""

    def __init__(self, micro_batches, stages, stage_id, order, num_chunks):
        super().__init__(micro_batches, stages, stage_id)
        self.order, self.num_chunks = order, num_chunks
        self.split = any(kind == "W" for kind, _, _ in order)

    def num_pipe_buffers(self):
        return self.num_chunks * self.micro_batches

    def steps(self):
        for kind, chunk, micro_batch in self.order:
            if kind == "F":
                yield [ChunkForwardPass(chunk=chunk, micro_batch=micro_batch)]
            elif kind == "B":
                yield [ChunkBackwardPass(chunk=chunk, micro_batch=micro_batch, split=self.split)]
            else:
                yield [BackwardWeightPass()]
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def as_tuple(tensors):
    return tensors if isinstance(tensors, tuple) else (tensors,)


class ChunkedPipelineEngine(ZeroBubblePipelineEngine):
    """Its _train_schedule, is_first_stage, is_last_stage and _loss_stage_global_rank override DeepSpeed's
    (deepspeed_internals/ lists them); W and the sends are the zero-bubble engine's."""

    def _train_schedule(self):
        return ChunkedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.chunk_order,
                               len(self.local_chunks))

    def _runs_or_holds(self, chunk):
        return chunk == self.running_chunk if self.running_chunk is not None else chunk in self.local_chunks

    def is_first_stage(self):
        return self._runs_or_holds(0)

    def is_last_stage(self):
        return self._runs_or_holds(self.last_chunk)

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.chunk_owner[self.last_chunk])

    def _buffer(self, chunk, micro_batch):
        return chunk * self.micro_batches + micro_batch

    def _run_chunk(self, chunk, handler, buffer_id):
        self.running_chunk, self.module.active_chunk = self.local_chunks[chunk], chunk
        try:
            handler(self, buffer_id)
        finally:
            self.running_chunk = None

    def _exec_chunk_forward_pass(self, chunk, micro_batch):
        first_chunk_here = 0 in self.local_chunks
        g, buffer_id = self.local_chunks[chunk], self._buffer(chunk, micro_batch)
        if g == 0 or (g == self.last_chunk and not first_chunk_here):
            load_micro_batch(self, buffer_id)  # inputs where chunk 0 is, labels where the last chunk is
        if g == 0 and self.last_chunk in self.local_chunks:  # the V's rank 0: the labels to the last chunk's buffer
            labels_buffer = self._buffer(self.local_chunks.index(self.last_chunk), micro_batch)
            set_pipe_buffer(self, "labels", labels_buffer, pipe_buffer(self, "labels", buffer_id))
            set_pipe_buffer(self, "labels", buffer_id, None)
        if g > 0:
            set_pipe_buffer(self, "inputs", buffer_id, self._take("activations", g, micro_batch))
        self._run_chunk(chunk, run_forward_pass, buffer_id)
        if g == self.last_chunk:
            self._losses[buffer_id] = self.loss
        else:
            self._give("activations", g + 1, micro_batch, as_tuple(pipe_buffer(self, "outputs", buffer_id)))

    def _exec_chunk_backward_pass(self, chunk, micro_batch, split):
        g, buffer_id = self.local_chunks[chunk], self._buffer(chunk, micro_batch)
        if g == self.last_chunk:
            self.loss = self._losses.pop(buffer_id)
        else:
            outputs = pipe_buffer(self, "outputs", buffer_id)
            grads = self._take("gradients", g, micro_batch, [t for t in as_tuple(outputs) if t.is_floating_point()])
            set_received_gradients(self, list(grads) if isinstance(outputs, tuple) else grads[0])
        if split:
            with self.module.parallel.weight_grads.defer():
                self._run_chunk(chunk, run_backward_pass, buffer_id)
        else:
            self._run_chunk(chunk, run_backward_pass, buffer_id)
        if g > 0:
            inputs = as_tuple(pipe_buffer(self, "inputs", buffer_id))
            self._give("gradients", g - 1, micro_batch, tuple(t.grad for t in inputs if t.is_floating_point()))
        set_pipe_buffer(self, "inputs", buffer_id, None)

    def _give(self, kind, chunk, micro_batch, tensors):
        """A chunk's activations or input gradients to the rank of `chunk`, the chunk that takes them."""
        owner = self.chunk_owner[chunk]
        if owner == self.stage_id:
            if kind == "activations":  # new leaves: the next chunk's backward leaves their gradients in .grad
                tensors = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in tensors)
            self._handed_over[(kind, chunk, micro_batch)] = tensors
            return
        if kind == "activations" and owner not in self._shapes_sent:
            self._shapes_sent.add(owner)
            send_tensor_shapes(self, tensors, owner)  # blocking: the owner's first receive from here reads them
        self._send_async(tensors, owner)

    def _take(self, kind, chunk, micro_batch, like=None):
        """What `chunk` needs from its neighbour chunk: its input activations, or its output gradients (shaped
        like `like`), handed over here or received, into new tensors (a deferred W may hold earlier ones)."""
        handed_over = self._handed_over.pop((kind, chunk, micro_batch), None)
        if handed_over is not None:
            return handed_over
        source = self.chunk_owner[chunk - 1 if kind == "activations" else chunk + 1]
        if kind == "activations":
            if source not in self._shapes_received:
                self._shapes_received[source] = as_tuple(receive_tensor_shapes(self, source))
            like = self._shapes_received[source]
        tensors = tuple(torch.empty_like(t) for t in like)
        for tensor in tensors:
            collectives.recv(tensor, self.grid.stage_to_global(source))
            tensor.requires_grad = kind == "activations" and tensor.is_floating_point()
        return tensors

    def _exec_reduce_tied_grads(self):
        if self._handed_over or self._losses:
            raise RuntimeError(f"{self.pipeline_schedule}: activations, gradients or losses were left over at the "
                               f"step: {sorted(self._handed_over)} {sorted(self._losses)}")
        super()._exec_reduce_tied_grads()


add_instruction_handlers(ChunkedPipelineEngine, {
    ChunkForwardPass: ChunkedPipelineEngine._exec_chunk_forward_pass,
    ChunkBackwardPass: ChunkedPipelineEngine._exec_chunk_backward_pass,
    ReduceTiedGrads: ChunkedPipelineEngine._exec_reduce_tied_grads,
})


def use_chunked_pipeline(engine, schedule, chunk_ids, order):
    """Turn the PipelineEngine that deepspeed.initialize built over a chunked LlamaPipeline into the chunked one.
    chunk_ids: each rank's global chunks (the module's); order: this rank's [(kind "F"/"B"/"W", local chunk,
    micro-batch)] for every step. Ws run oldest first, so they must follow the Bs' order."""
    backwards = [(chunk, j) for kind, chunk, j in order if kind == "B"]
    weights = [(chunk, j) for kind, chunk, j in order if kind == "W"]
    if weights and weights != backwards:
        raise ValueError(f"{schedule}: the order's Ws {weights} do not follow its Bs {backwards}.")
    use_zero_bubble(engine)  # its W, its sends and their checks
    engine.__class__ = ChunkedPipelineEngine
    engine.pipeline_schedule = schedule
    engine.local_chunks = list(chunk_ids[engine.stage_id])
    engine.chunk_owner = {chunk: rank for rank, chunks in enumerate(chunk_ids) for chunk in chunks}
    engine.last_chunk = len(engine.chunk_owner) - 1
    engine.chunk_order = list(order)
    engine.running_chunk = None
    engine._handed_over, engine._losses = {}, {}
    engine._shapes_sent, engine._shapes_received = set(), {}
    return engine
