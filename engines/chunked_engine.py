"""DeepSpeed's PipelineEngine running several chunks of layers per rank: interleaved 1F1B (rank r holds chunks r,
r + p, ...) and ZB-V (rank r holds chunks r and 2p - 1 - r), from a rank's program of computations (kind, local
chunk, micro-batch) and point-to-point operations (schedules/orders.py computes both; the model's chunks:
models/pipeline.py LlamaPipeline).

Each instruction names its chunk; a (chunk, micro-batch) has its own pipe buffer. The activations of global chunk g
go to the rank holding chunk g + 1 and its input gradients to the rank holding g - 1: posted (isend / irecv through
collectives/) and waited for where the program says, which is each link's one order on both of its sides (NCCL
runs a link's operations in the order each side issues them), or handed over in place where that rank is this one
(the V's turn on the last rank). DeepSpeed's own forward and backward handlers compute each chunk: while a chunk
runs, the engine's first and last stage are the model's first and last chunk, so the loss is the last chunk's (the
last rank's under interleaving, rank 0's under the V) and only that chunk scales by the accumulation steps. Outside
a chunk they mean the rank holding them: the rank of the first chunk loads inputs, that of the last chunk labels
(under the V rank 0 does both; a rank holding neither reads no data). An order with W splits each backward as the
zero-bubble schedule does (models/weight_grads.py: B now, W in the order's place, oldest first), but the first
chunk's: no rank waits for its input gradient, so its B runs whole and its W is left out (ZB-H1's first stage does
the same; a split backward computes slower on the CPU, bench/README.md).

Each chunk boundary carries its own tuple (Gemma 4's keys and values travel only from their source layer to the
last layer reusing them, models/pipeline_layers.py StageTuple.carried_sources): the count, dtypes and shapes of
the tensors after chunk g are chunk g's outputs'. They go over the boundary's link once, as a message of
SHAPES_SIZE integers posted right before the first activations after chunk g, in the link's order on both sides;
the receiver waits for that message as it posts its first receive of the boundary (its receives are allocated
from it) and keeps it for the boundary's later receives. That wait cannot hang: the program posts the receive
where it waits for it, or earlier only ahead of a send of the same link that comes after it in the link's order
(schedules/p2p.py), which is the order in which the unit-time run of the schedule ends its computations, so whatever
the sender's forward of chunk g waits for was done before the receiver posts (tests/test_p2p_order.py runs every
program under its model of NCCL). Gradients are received like the chunk's floating outputs. A step of another
sequence length sends the shapes again (reset_activation_shape, engines/sequence_length.py).
"""
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import OptimizerStep, PipeInstruction, ReduceGrads, ReduceTiedGrads, TrainSchedule

import collectives
from deepspeed_internals.access import (add_instruction_handlers, load_micro_batch, pipe_buffer, run_backward_pass,
                                        run_forward_pass, set_pipe_buffer, set_received_gradients)
from schedules.rules import chunk_ids, chunks_per_rank
from engines.pipeline_engine import ZeroBubblePipelineEngine, use_zero_bubble
from engines.zero_bubble_schedule import BackwardWeightPass
from schedules.p2p import P2POp, p2p_program
from engines.zbv_auto import MeasuredTimes
from schedules.zbv_order import configured_zbv_durations
from cluster.console import say

SHAPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
SHAPES_SIZE = 64  # integers in the shapes message: a count, then dtype, ndim and dims per tensor


class ChunkForwardPass(PipeInstruction):
    """F of a local chunk on a micro-batch: its input loaded, received or handed over, the forward pass (the loss
    on the last chunk), its output to the next chunk."""


class ChunkBackwardPass(PipeInstruction):
    """B of a local chunk on a micro-batch (split: input gradients only, its W later), the input gradient to the
    previous chunk."""


class PostTransfer(PipeInstruction):
    """Post a send or a receive (op: schedules/orders.py's P2POp) without waiting for it."""


class WaitTransfer(PipeInstruction):
    """Wait for a posted send or receive; a received tensor goes to the chunk that takes it."""


class ChunkedSchedule(TrainSchedule):
    """One step per item of the rank's program, then (training) the gradient reductions and the optimizer step."""

    def __init__(self, micro_batches, stages, stage_id, program, num_chunks, holds_first_chunk, training=True):
        super().__init__(micro_batches, stages, stage_id)
        self.program, self.num_chunks, self.holds_first_chunk = program, num_chunks, holds_first_chunk
        self.split = any(item[0] == "W" for action, item in program if action == "compute")
        self.training = training

    def num_pipe_buffers(self):
        return self.num_chunks * self.micro_batches

    def steps(self):
        first_chunk = 0 if self.holds_first_chunk else None  # the model's first chunk is local chunk 0 of its rank
        for action, item in self.program:
            if action == "post":
                yield [PostTransfer(op=item)]
            elif action == "wait":
                yield [WaitTransfer(op=item)]
            elif item[0] == "F":
                yield [ChunkForwardPass(chunk=item[1], micro_batch=item[2])]
            elif item[0] == "B":
                split = self.split and item[1] != first_chunk
                yield [ChunkBackwardPass(chunk=item[1], micro_batch=item[2], split=split)]
            elif item[1] != first_chunk:
                yield [BackwardWeightPass()]
        if self.training:
            yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def forward_program(chunk_ids, micro_batches, rank):
    """Evaluation's program for any chunk layout and micro-batch count: every rank runs its forwards micro-batch by
    micro-batch, chunk by chunk ((j, g) ascending), receiving right before and sending right after each. A transfer
    sits between (j, g) and its successor (j, g + 1) on both of its sides, so every link's operations come in the
    same order on its two sides."""
    owner = {chunk: r for r, chunks in enumerate(chunk_ids) for chunk in chunks}
    mine, program, sends = chunk_ids[rank], [], []
    for j in range(micro_batches):
        for g in sorted(mine):
            local = mine.index(g)
            if g > 0 and owner[g - 1] != rank:
                receive = P2POp("recv", owner[g - 1], "activation", local, j)
                program += [("post", receive), ("wait", receive)]
            program.append(("compute", ("F", local, j)))
            if g + 1 in owner and owner[g + 1] != rank:
                sends.append(P2POp("send", owner[g + 1], "activation", local, j))
                program.append(("post", sends[-1]))
    return program + [("wait", send) for send in sends]


def as_tuple(tensors):
    return tensors if isinstance(tensors, tuple) else (tensors,)


def pack_shapes(tensors, device):
    values = [len(tensors)]
    for tensor in tensors:
        values += [SHAPE_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    if len(values) > SHAPES_SIZE:
        raise ValueError(f"{len(tensors)} tensors between chunks need more than {SHAPES_SIZE} integers of shapes")
    return torch.tensor(values + [0] * (SHAPES_SIZE - len(values)), dtype=torch.int64, device=device)


def unpack_shapes(message, device):
    """Empty tensors of the packed shapes (one host read, once per boundary and sequence length)."""
    values, tensors, at = message.tolist(), [], 1
    for _ in range(values[0]):
        dtype, ndim = SHAPE_DTYPES[values[at]], values[at + 1]
        tensors.append(torch.empty(values[at + 2:at + 2 + ndim], dtype=dtype, device=device))
        at += 2 + ndim
    return tuple(tensors)


class ChunkedPipelineEngine(ZeroBubblePipelineEngine):
    """Its _train_schedule, _inference_schedule, is_first_stage, is_last_stage, _loss_stage_global_rank and
    reset_activation_shape override DeepSpeed's (deepspeed_internals/ lists them); W is the zero-bubble engine's."""

    def _train_schedule(self):
        self._buffers_per_chunk = self.micro_batches
        return ChunkedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.chunk_program,
                               len(self.local_chunks), 0 in self.local_chunks)

    def _inference_schedule(self, micro_batches):
        self._buffers_per_chunk = micro_batches
        return ChunkedSchedule(micro_batches, self.num_stages, self.stage_id,
                               forward_program(self.chunk_ids, micro_batches, self.stage_id), len(self.local_chunks),
                               0 in self.local_chunks, training=False)

    def _runs_or_holds(self, chunk):
        return chunk == self.running_chunk if self.running_chunk is not None else chunk in self.local_chunks

    def is_first_stage(self):
        return self._runs_or_holds(0)

    def is_last_stage(self):
        return self._runs_or_holds(self.last_chunk)

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.chunk_owner[self.last_chunk])

    def _buffer(self, chunk, micro_batch):
        return chunk * self._buffers_per_chunk + micro_batch

    def _run_chunk(self, chunk, handler, buffer_id):
        self.running_chunk, self.module.active_chunk = self.local_chunks[chunk], chunk
        try:
            handler(self, buffer_id)
        finally:
            self.running_chunk = None

    def _exec_chunk_forward_pass(self, chunk, micro_batch):
        g, buffer_id = self.local_chunks[chunk], self._buffer(chunk, micro_batch)
        if g == 0 or (g == self.last_chunk and 0 not in self.local_chunks):
            load_micro_batch(self, buffer_id)  # inputs where chunk 0 is, labels where the last chunk is
        if g == 0 and self.last_chunk in self.local_chunks:  # the V's rank 0: the labels to the last chunk's buffer
            labels_buffer = self._buffer(self.local_chunks.index(self.last_chunk), micro_batch)
            set_pipe_buffer(self, "labels", labels_buffer, pipe_buffer(self, "labels", buffer_id))
            set_pipe_buffer(self, "labels", buffer_id, None)
        if g > 0:
            set_pipe_buffer(self, "inputs", buffer_id, self._arrived.pop(("activation", chunk, micro_batch)))
        self._run_chunk(chunk, run_forward_pass, buffer_id)
        if g == self.last_chunk:
            if torch.is_grad_enabled():  # for its backward (evaluation's losses are DeepSpeed's fwd_outputs)
                self._losses[buffer_id] = self.loss
        else:
            self._give("activation", chunk, micro_batch, as_tuple(pipe_buffer(self, "outputs", buffer_id)))

    def _exec_chunk_backward_pass(self, chunk, micro_batch, split):
        g, buffer_id = self.local_chunks[chunk], self._buffer(chunk, micro_batch)
        if g == self.last_chunk:
            self.loss = self._losses.pop(buffer_id)
        else:
            grads = self._arrived.pop(("gradient", chunk, micro_batch))
            outputs = pipe_buffer(self, "outputs", buffer_id)
            set_received_gradients(self, list(grads) if isinstance(outputs, tuple) else grads[0])
        if split:
            with self.module.parallel.weight_grads.defer():
                self._run_chunk(chunk, run_backward_pass, buffer_id)
        else:
            self._run_chunk(chunk, run_backward_pass, buffer_id)
        if g > 0:
            inputs = as_tuple(pipe_buffer(self, "inputs", buffer_id))
            self._give("gradient", chunk, micro_batch, tuple(t.grad for t in inputs if t.is_floating_point()))
        set_pipe_buffer(self, "inputs", buffer_id, None)

    def _give(self, tensor, chunk, micro_batch, tensors):
        """A local chunk's output activations or input gradients: handed over in place to this rank's neighbour
        chunk, or kept for the send the program posts next."""
        neighbour = self.local_chunks[chunk] + (1 if tensor == "activation" else -1)
        if self.chunk_owner[neighbour] != self.stage_id:
            self._made[(tensor, chunk, micro_batch)] = tensors
            return
        if tensor == "activation":  # new leaves: the next chunk's backward leaves their gradients in .grad
            tensors = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in tensors)
        self._arrived[(tensor, self.local_chunks.index(neighbour), micro_batch)] = tensors

    def reset_activation_shape(self):
        """DeepSpeed's, and each boundary's shapes sent again before its next first activations."""
        super().reset_activation_shape()
        self._shapes_sent, self._input_shapes = set(), {}

    def _exec_post_transfer(self, op):
        key = (op.tensor, op.local_chunk, op.micro_batch)
        peer = self.grid.stage_to_global(op.peer)
        if op.direction == "send":
            tensors = tuple(t.contiguous() for t in self._made.pop(key))  # held until the wait: what is sent
            if op.tensor == "activation" and op.local_chunk not in self._shapes_sent:  # the boundary's first
                self._shapes_sent.add(op.local_chunk)
                tensors = (pack_shapes(tensors, self.device), *tensors)
            self._posted[op] = (tensors, [collectives.isend(t, peer) for t in tensors])
            return
        if op.tensor == "activation":
            like = self._received_shapes(op.local_chunk, peer)
        else:  # the gradients of the chunk's floating outputs
            outputs = pipe_buffer(self, "outputs", self._buffer(op.local_chunk, op.micro_batch))
            like = [t for t in as_tuple(outputs) if t.is_floating_point()]
        tensors = tuple(torch.empty_like(t) for t in like)
        self._posted[op] = (tensors, [collectives.irecv(t, peer) for t in tensors])

    def _received_shapes(self, chunk, peer):
        """Empty tensors of the tuple local chunk `chunk` receives: the boundary's first receive waits for the
        shapes its sender posts ahead of its first activations (the module's docstring says why this cannot hang),
        the later ones reuse them."""
        if chunk not in self._input_shapes:
            message = torch.empty(SHAPES_SIZE, dtype=torch.int64, device=self.device)
            collectives.recv(message, peer)
            self._input_shapes[chunk] = unpack_shapes(message, self.device)
        return self._input_shapes[chunk]

    def _exec_wait_transfer(self, op):
        tensors, works = self._posted.pop(op)
        collectives.wait(works)
        if op.direction == "recv":
            for tensor in tensors:
                tensor.requires_grad = op.tensor == "activation" and tensor.is_floating_point()
            self._arrived[(op.tensor, op.local_chunk, op.micro_batch)] = tensors

    def _exec_reduce_tied_grads(self):
        if self._arrived or self._made or self._posted or self._losses:
            left = [*self._arrived, *self._made, *self._posted, *self._losses]
            raise RuntimeError(f"{self.pipeline_schedule}: transfers or losses were left over at the step: {left}")
        super()._exec_reduce_tied_grads()


add_instruction_handlers(ChunkedPipelineEngine, {
    ChunkForwardPass: ChunkedPipelineEngine._exec_chunk_forward_pass,
    ChunkBackwardPass: ChunkedPipelineEngine._exec_chunk_backward_pass,
    PostTransfer: ChunkedPipelineEngine._exec_post_transfer,
    WaitTransfer: ChunkedPipelineEngine._exec_wait_transfer,
    ReduceTiedGrads: ChunkedPipelineEngine._exec_reduce_tied_grads,
})


def rank_chunk_ids(schedule, stages, virtual_stages=None):
    """Each rank's global chunks under a schedule with several per rank (the module's chunk_ids), else None."""
    if chunks_per_rank(schedule, virtual_stages or 1) == 1:
        return None
    return [chunk_ids(schedule, stages, rank, virtual_stages or 1) for rank in range(stages)]


def stage_reads_data(schedule, stages, rank, virtual_stages=None):
    """Whether a rank reads micro-batches: it holds the model's first chunk (inputs) or its last (labels)."""
    chunks = rank_chunk_ids(schedule, stages, virtual_stages)
    if chunks is None:
        return rank in (0, stages - 1)
    return bool({0, stages * len(chunks[rank]) - 1} & set(chunks[rank]))


def use_chunked_pipeline(engine, schedule, virtual_stages=None, max_waiting=None, zbv_times=None):
    """Turn the PipelineEngine that deepspeed.initialize built over a chunked LlamaPipeline (rank_chunk_ids' chunks)
    into the chunked one, running its rank's program of the schedule (schedules/orders.py p2p_program; zbv's V
    order made for zbv_times, a chunk's [F, B, W] times, or for F = B = W; "auto": for F = B = W, then from the
    second step's end for the times measured in it, engines/zbv_auto.py)."""
    chunks = rank_chunk_ids(schedule, engine.num_stages, virtual_stages)
    use_zero_bubble(engine)  # its W and its checks
    engine.__class__ = ChunkedPipelineEngine
    engine.pipeline_schedule = schedule
    engine.chunk_ids = chunks
    engine.local_chunks = chunks[engine.stage_id]
    engine.chunk_owner = {chunk: rank for rank, rank_chunks in enumerate(chunks) for chunk in rank_chunks}
    engine.last_chunk = len(engine.chunk_owner) - 1
    engine.running_chunk = None
    engine._shapes_sent, engine._input_shapes = set(), {}  # per boundary: its shapes sent, its shapes received
    engine._arrived, engine._made, engine._posted, engine._losses = {}, {}, {}, {}

    def make_program(times):
        set_chunk_program(engine, p2p_program(schedule, engine.num_stages, engine.micro_batches, engine.stage_id,
                                              virtual_stages or 1, max_waiting, configured_zbv_durations(times)))
    make_program(zbv_times)
    if zbv_times == "auto":
        MeasuredTimes(engine, {ChunkForwardPass: "F", ChunkBackwardPass: "B", BackwardWeightPass: "W"},
                      lambda times: remake_for_measured_times(engine, times, make_program))
    return engine


def remake_for_measured_times(engine, times, make_program):
    """zbv_times=auto: the V order made for each stage's measured [F, B, W] seconds (alike on every rank), said once."""
    make_program(times)
    engine.zbv_measured_times = times
    if dist.get_rank() == 0:
        say("zbv_times=auto: each stage's F/B/W ms in the measured step " + ", ".join(
            f"stage {stage} " + "/".join(f"{1e3 * t:.0f}" for t in stage_times) for stage, stage_times in
            enumerate(times)) + "; the V order is made for them from the next step on")


def set_chunk_program(engine, program):
    """The rank's program from the next step on. Ws run oldest first, so they must follow the Bs' order."""
    computed = [item for action, item in program if action == "compute"]
    backwards = [(chunk, j) for kind, chunk, j in computed if kind == "B"]
    weights = [(chunk, j) for kind, chunk, j in computed if kind == "W"]
    if weights and weights != backwards:
        raise ValueError(f"{engine.pipeline_schedule}: the order's Ws {weights} do not follow its Bs {backwards}.")
    engine.chunk_program = program
