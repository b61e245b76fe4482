"""Every pipeline schedule's point-to-point operations, checked against a model of NCCL's semantics: both directions
of a link share one stream per side, operations run in the order each side issued them, a send completes only when
the peer's matching receive runs (no buffering, unlike gloo, so the CPU runs cannot show a deadlock), and a
collective completes once every rank of its group has reached it: under expert parallelism the all-to-alls each
forward and backward of a stage holding experts runs (models/expert_parallel.py; its expert-parallel group: the
stage's ranks in the data-parallel replicas, each running its stage's program, so each group's ranks must meet at
the same all-to-alls in the same order). A pair that is not a send facing a receive of the same shape and dtype
waits forever or delivers the wrong tensor.

The operations are recorded from the engines themselves: each stage's engine (DeepSpeed's PipelineEngine for 1F1B,
the zero-bubble engine of engines/pipeline_engine.py, the chunked engine of engines/chunked_engine.py for
interleaved_1f1b and zbv) runs its schedules through DeepSpeed's own instruction loop and its own handlers: sends
and receives (the chunked engine's per tensor, posted and waited for where its program says), the shapes' exchange
(DeepSpeed's blocking metadata, the zero-bubble engine's; the chunked engine's message ahead of each boundary's
first activations, its receive waited for where it is posted), the chunked engine's in-place hand-over between two
chunks of one rank, and W. Only what computes is replaced (forward, backward, loading, the reductions and the
optimizer step: stand-ins that make the tensors a stage or chunk passes on, as the project's layers shape them, and
check the ones it took), and so is the communication under the handlers (DeepSpeed's p2p.send / p2p.recv and
torch.distributed's send, recv, isend and irecv), by a recorder. Stages run one after another, first to last; each
receive gets what its peer sent over that link before, in order, as both gloo and NCCL match them: under one chunk
per rank from the stages recorded before (so the activations are checked, the gradients not), under several in
passes that each take the previous pass's sends, since ranks also receive from ranks after them, until every link's
sends keep their shapes, then in a last one that checks every activation and gradient."""
import collections
import functools
import itertools
import pathlib
import types

import pytest
import torch
import yaml
from deepspeed.runtime.pipe.schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, RecvActivation,
                                             ReduceGrads)

from deepspeed_internals.access import (handlers_only_pipeline_engine, inference_schedule, instruction_handlers,
                                        pipe_buffer, pipe_p2p, received_gradients, replace_instruction_handlers,
                                        replace_passes, run_schedule, set_pipe_buffer, train_schedule)
from engines.chunked_engine import set_chunk_program, use_chunked_pipeline
from engines.pipeline_engine import use_zero_bubble
from engines.zero_bubble_schedule import (BackwardInputPass, BackwardWeightPass, PostRecvActivation, WaitRecvActivation,
                                          ZeroBubbleSchedule)
from schedules.orders import rank_orders
from schedules.p2p import p2p_program
from engines.zbv_auto import robust_sums
from schedules.zbv_order import stage_times
from schedules.zbv_order import EQUAL_TIMES, configured_zbv_durations

# Stage and micro-batch counts: those of the tests and around them (fewer micro-batches than stages, as many, more),
# and every config's (config_counts).
STAGES = range(2, 9)
MICRO_BATCHES = [*range(1, 10), 16]
MAX_WAITING = [None, 0, 1, 2, 4]
# What the project's stages pass on (models/pipeline_layers.py): hidden states, document ids, position ids.
ROWS, SEQUENCE, HIDDEN = 2, 8, 16
CONF = pathlib.Path(__file__).parents[1] / "conf"


class Grid:
    """The process grid as the handlers read it. Stage s is global rank 2s + 1, as for data-parallel replica 1 of 2,
    so a stage passed where a rank belongs shows."""
    PIPE_GROUP = "the pipeline's ranks"

    def __init__(self, stage, stages):
        self.stage, self.pipe_parallel_size = stage, stages

    def get_stage_id(self):
        return self.stage

    def get_pipe_parallel_group(self):
        return self.PIPE_GROUP

    @staticmethod
    def stage_to_global(stage_id, **coordinates):
        return 2 * stage_id + 1


class Work:
    """An isend / irecv request. Whether it completed is unknown while recording: the engine keeps it and waits."""

    def __init__(self, recorder, op):
        self.recorder, self.op = recorder, op

    def wait(self):
        self.recorder.program.append(("wait", self.op))
        return True

    def is_completed(self):
        return False


class Recorder:
    """One stage's point-to-point layer. Its program: ("post", op) where an operation is issued, ("wait", op) where
    the stage blocks until it completed, ("collective", op) for an expert-parallel all-to-all; op = (peer stage,
    "send" | "recv", dtype, shape, number on this stage). neighbours: the stages it may send to and receive from
    (default: the next and the previous); sent: {(from, to): tensors sent}, which it adds to; inbox: the same for
    what its receives take, in order (default: sent, which the stages recorded before it filled); a receive that
    finds nothing of its shape there takes zeros (the chunked engine's shapes message: no tensors)."""

    def __init__(self, stage, sent, neighbours=None, inbox=None):
        self.stage, self.sent, self.program = stage, sent, []
        self.neighbours = {stage - 1, stage + 1} if neighbours is None else neighbours
        self.inbox = sent if inbox is None else inbox

    def post(self, tensor, peer, direction):
        if peer not in self.neighbours:
            raise AssertionError(f"stage {self.stage} {direction}s to stage {peer}, not a neighbour")
        op = (peer, direction, tensor.dtype, tuple(tensor.shape), len(self.program))
        self.program.append(("post", op))
        if direction == "send":
            self.sent[(self.stage, peer)].append(tensor.detach().clone())
        else:  # what a stage recorded before it (or, chunked, in the previous pass) sent; zeros if none of its shape
            delivered = self.inbox[(peer, self.stage)].popleft() if self.inbox[(peer, self.stage)] else None
            if delivered is not None and delivered.shape == tensor.shape and delivered.dtype == tensor.dtype:
                tensor.copy_(delivered)
            else:
                tensor.zero_()
        return op

    def all_to_all(self, identity):
        """An expert-parallel all-to-all (models/expert_parallel.py): a collective over the ranks of this stage's
        expert-parallel group, which runs one in each forward and backward of a chunk holding experts (and none
        in W); identity: which computation's, (kind, chunk, micro-batch), that its group's ranks must share."""
        self.program.append(("collective", (self.stage, "all_to_all", None, identity, len(self.program))))

    def blocking(self, tensor, peer, direction):
        self.program.append(("wait", self.post(tensor, peer, direction)))

    @staticmethod
    def stage_of(rank):
        assert rank % 2 == 1, f"rank {rank} is no stage's (Grid): a stage passed as a rank?"
        return rank // 2

    # DeepSpeed's p2p layer: stages, blocking.
    def p2p_send(self, tensor, dest_stage, async_op=False):
        assert not async_op
        self.blocking(tensor, dest_stage, "send")

    def p2p_recv(self, tensor, src_stage, async_op=False):
        assert not async_op
        self.blocking(tensor, src_stage, "recv")

    # torch.distributed: global ranks.
    def send(self, tensor, dst, group=None, tag=0):
        self.blocking(tensor, self.stage_of(dst), "send")

    def recv(self, tensor, src=None, group=None, tag=0):
        self.blocking(tensor, self.stage_of(src), "recv")

    def isend(self, tensor, dst, group=None, tag=0):
        return Work(self, self.post(tensor, self.stage_of(dst), "send"))

    def irecv(self, tensor, src=None, group=None, tag=0):
        return Work(self, self.post(tensor, self.stage_of(src), "recv"))


class Computation:
    """A stage's computing instructions, replaced. Forward number k (micro-batches go forward in order, in every
    schedule) checks that its inputs are the previous stage's forward k, received into the buffer it runs, and
    makes outputs holding k; a backward gives the inputs' floating-point tensors a gradient. all_to_all: the
    recorder's, called by each forward and backward (B) as a stage holding experts under expert parallelism does,
    or None."""

    def __init__(self, all_to_all=None):
        self.forwards = self.backwards = 0
        self.all_to_all = all_to_all or (lambda identity: None)

    def forward(self, engine, buffer_id):
        self.all_to_all(("F", 0, self.forwards))
        if engine.stage_id > 0:
            hidden, document_ids, position_ids = pipe_buffer(engine, "inputs", buffer_id)
            assert hidden.requires_grad and not document_ids.requires_grad
            assert hidden.eq(self.forwards).all() and position_ids.eq(self.forwards).all(), (
                f"stage {engine.stage_id}'s forward {self.forwards} received another micro-batch's activations")
        outputs = (torch.full((ROWS, SEQUENCE, HIDDEN), self.forwards, dtype=torch.bfloat16),
                   torch.full((ROWS, SEQUENCE), self.forwards, dtype=torch.long),
                   torch.full((ROWS, SEQUENCE), self.forwards, dtype=torch.long))
        set_pipe_buffer(engine, "outputs", buffer_id, outputs)
        self.forwards += 1

    def backward(self, engine, buffer_id):
        self.all_to_all(("B", 0, self.backwards))
        self.backwards += 1
        if engine.stage_id > 0:
            for tensor in pipe_buffer(engine, "inputs", buffer_id):
                if tensor.is_floating_point():
                    tensor.grad = torch.zeros_like(tensor)

    @staticmethod
    def nothing(engine, **instruction):
        pass

    def install(self, engine):
        handlers = {ForwardPass: self.forward, BackwardPass: self.backward, BackwardInputPass: self.backward,
                    BackwardWeightPass: self.nothing, LoadMicroBatch: self.nothing, ReduceGrads: self.nothing,
                    OptimizerStep: self.nothing}
        replace_instruction_handlers(engine, {**instruction_handlers(engine), **{
            instruction: handler for instruction, handler in handlers.items()
            if instruction in instruction_handlers(engine)}})


def train(engine):
    return train_schedule(engine)


def evaluate(micro_batches):
    return lambda engine: inference_schedule(engine, micro_batches)


def record(stages, micro_batches, batches, zero_bubble=None, experts=False):
    """Each stage's program over `batches` (each: engine -> the schedule that batch runs); zero_bubble: None for
    DeepSpeed's engine, else {"max_waiting": ...} for engines/pipeline_engine.py's; experts: every stage runs an
    expert-parallel all-to-all in each forward and backward."""
    sent = collections.defaultdict(collections.deque)
    programs = []
    for stage in range(stages):
        module = types.SimpleNamespace(parallel=types.SimpleNamespace(), get_tied_weights_and_groups=list,
                                       modules=list)
        engine = handlers_only_pipeline_engine(Grid(stage, stages), module, micro_batches, torch.device("cpu"))
        if zero_bubble is not None:
            use_zero_bubble(engine, **zero_bubble)
        recorder = Recorder(stage, sent)
        Computation(recorder.all_to_all if experts else None).install(engine)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipe_p2p(), "send", recorder.p2p_send)
            patch.setattr(pipe_p2p(), "recv", recorder.p2p_recv)
            for name in ("send", "recv", "isend", "irecv"):
                patch.setattr(torch.distributed, name, getattr(recorder, name))
            for batch in batches:
                run_schedule(engine, batch(engine))
        programs.append(recorder.program)
    return programs


def describe(rank, op):
    (stage, replica), (peer, direction, dtype, shape, number) = rank, op
    where = f"stage {stage}" + (f" (replica {replica})" if replica else "")
    return f"{where}'s {direction} #{number} ({dtype} {list(shape)}, {'to' if direction == 'send' else 'from'} " \
           f"stage {peer})"


def collective_members(rank, replicas):
    """The ranks an all-to-all of `rank` waits for: its stage's ranks in every replica (the widest expert-parallel
    group: expert_parallel_size = the data-parallel size)."""
    return [(rank[0], other) for other in range(replicas)]


def run_on_nccl(*replicas):
    """Execute the programs under the model; raise on a deadlock, a send matched with a receive of another shape or
    dtype, a collective whose ranks meet at different ones, or an operation nobody matched. replicas: each
    data-parallel replica's programs, one per stage: rank (stage, replica) runs its own, its point-to-point
    operations go to its replica's stages (the pipeline's ranks of a replica), and its all-to-alls over its stage's
    ranks of every replica (an expert-parallel group)."""
    programs = {(stage, replica): program for replica, stage_programs in enumerate(replicas)
                for stage, program in enumerate(stage_programs)}
    streams = collections.defaultdict(collections.deque)
    done, position = set(), dict.fromkeys(programs, 0)
    progressed = True
    while progressed:
        progressed = False
        for rank, program in programs.items():  # run each rank up to its next wait on an unfinished operation
            while position[rank] < len(program):
                action, op = program[position[rank]]
                if action in ("wait", "collective") and (rank, op) not in done:
                    break
                if action == "post":
                    streams[(rank, (op[0], rank[1]))].append(op)
                position[rank] += 1
                progressed = True
        at_collective = {rank: program[position[rank]][1] for rank, program in programs.items()
                         if position[rank] < len(program) and program[position[rank]][0] == "collective"}
        for rank, op in at_collective.items():  # a collective completes once all its ranks have reached it
            members = collective_members(rank, len(replicas))
            if (rank, op) in done or not all(at_collective.get(member, (None, None))[1] == op[1] for member in members):
                continue
            if len({at_collective[member][:4] for member in members}) > 1:
                raise AssertionError(f"the ranks of a collective ({op[1]}) meet at different ones: "
                                     f"{[at_collective[member] for member in members]}")
            done.update((member, at_collective[member]) for member in members)
            progressed = True
        for (rank, peer), stream in list(streams.items()):  # the heads of a link's two streams complete together
            other = streams.get((peer, rank))
            if rank > peer or not stream or not other:
                continue
            mine, theirs = stream[0], other[0]
            if mine[1] == theirs[1]:
                continue  # two sends (or two receives) facing each other: neither completes
            if mine[2:4] != theirs[2:4]:
                raise AssertionError(f"{describe(rank, mine)} is matched with {describe(peer, theirs)}: the wrong "
                                     f"tensor")
            done.update({(rank, stream.popleft()), (peer, other.popleft())})
            progressed = True
    stuck = {rank: describe(rank, program[position[rank]][1]) for rank, program in programs.items()
             if position[rank] < len(program)}
    heads = {link: describe(link[0], stream[0]) for link, stream in streams.items() if stream}
    if stuck:
        raise AssertionError(f"deadlock: ranks wait at {stuck}; heads of the link streams {heads}")
    if heads:
        raise AssertionError(f"never matched: {heads}")


def train_first(micro_batches):
    """A run from its start: the shapes go with the first training activations; an evaluation between steps ends
    on a short chunk (evaluation/eval_set.py evaluates in chunks of at most gradient_accumulation_steps)."""
    return [train, evaluate(micro_batches), evaluate(max(1, micro_batches - 1)), train]


def evaluation_first(micro_batches):
    """A DPO run: the reference pass (eval_batch, evaluation/reference.py) goes first and sends the shapes."""
    return [evaluate(micro_batches), evaluate(1), train, train]


def config_counts():
    """{(stages, micro-batches)} of every config in conf/ that has more than one stage."""
    base = yaml.safe_load((CONF / "base.yaml").read_text())
    configs = [{**base, **yaml.safe_load(path.read_text())} for path in sorted(CONF.glob("*.yaml"))]
    return {(config["num_stages"], config["gradient_accumulation_steps"]) for config in configs
            if config["num_stages"] > 1}


def micro_batch_counts(stages):
    return sorted({*MICRO_BATCHES, *(m for config_stages, m in config_counts() if config_stages == stages)})


def caps(stages):
    """The zero_bubble_max_waiting values that give distinct orders on `stages` stages (stage s holds min(s, c))."""
    return [None, *(cap for cap in MAX_WAITING[1:] if cap < stages - 1)]


@pytest.mark.parametrize("stages", STAGES)
def test_deepspeed_1f1b_is_matched_on_every_link(stages):
    """DeepSpeed's own engine and schedules pass: the model of NCCL's semantics accepts a known-good order."""
    for micro_batches in micro_batch_counts(stages):
        for run in (train_first, evaluation_first):
            run_on_nccl(record(stages, micro_batches, run(micro_batches)))


@pytest.mark.parametrize("stages", STAGES)
def test_zero_bubble_is_matched_on_every_link(stages):
    for micro_batches in micro_batch_counts(stages):
        run_on_nccl(record(stages, micro_batches, evaluation_first(micro_batches), zero_bubble={"max_waiting": None}))
        for max_waiting in caps(stages):
            run_on_nccl(record(stages, micro_batches, train_first(micro_batches),
                               zero_bubble={"max_waiting": max_waiting}))


class ReceiveAtTheForward(ZeroBubbleSchedule):
    """The zero-bubble order before the link order (`git show ac713eb^:schedules/orders.py`): each activation
    received, blocking, at its forward; sends posted and waited for at the step's end, as now."""

    def steps(self):
        for cmds in super().steps():
            yield [RecvActivation(cmd.buffer_id) if isinstance(cmd, WaitRecvActivation) else cmd
                   for cmd in cmds if not isinstance(cmd, PostRecvActivation)]


def old_order_step(engine):
    return ReceiveAtTheForward(engine.micro_batches, engine.num_stages, engine.stage_id)


def test_the_old_order_deadlocks_on_the_zero_bubble_engine():
    """2 stages, 2 micro-batches, the engine's own handlers: the link's second operation is a send on both sides
    (stage 0 sends micro-batch 1's activations while stage 1 sends micro-batch 0's gradient); gloo buffered it, so
    the recording (which delivers in order, as gloo) ran, and NCCL would hang."""
    programs = record(2, 2, [old_order_step], zero_bubble={"max_waiting": None})
    crossed_sends = (r"deadlock: .*stage 0's send #\d+ \(torch.bfloat16 \[2, 8, 16\], to stage 1\).*"
                     r"stage 1's send #\d+ \(torch.bfloat16 \[2, 8, 16\], to stage 0")
    with pytest.raises(AssertionError, match=crossed_sends):
        run_on_nccl(programs)
    run_on_nccl(record(2, 2, [train], zero_bubble={"max_waiting": None}))  # the same step in today's order
    for stages, micro_batches in itertools.product(STAGES, (2, 8)):  # and so on every stage count
        with pytest.raises(AssertionError, match="deadlock"):
            run_on_nccl(record(stages, micro_batches, [old_order_step], zero_bubble={"max_waiting": None}))


def test_a_receive_of_another_shape_is_the_wrong_tensor():
    """The model's second failure: a send facing a receive of another shape (here the shapes' metadata facing
    activations, as when one side skips sending the shapes)."""
    programs = record(2, 1, [train])
    first_activation = next(i for i, (action, op) in enumerate(programs[1]) if op[3] == (ROWS, SEQUENCE, HIDDEN))
    metadata = next(i for i, (action, op) in enumerate(programs[1]) if op[2] == torch.int32)
    del programs[1][metadata:first_activation]
    with pytest.raises(AssertionError, match=r"the wrong tensor"):
        run_on_nccl(programs)


def test_every_config_is_checked():
    assert {(2, 4), (4, 32), (8, 32), (8, 64)} <= config_counts()
    assert all(stages in STAGES or (stages, m) in WIDE_CONFIGS for stages, m in config_counts())


WIDE_CONFIGS = sorted((stages, m) for stages, m in config_counts() if stages not in STAGES)  # gpt_oss_120b's 24


@pytest.mark.parametrize("stages, micro_batches", WIDE_CONFIGS)
def test_configs_beyond_eight_stages_are_matched_on_every_link(stages, micro_batches):
    """A config's own layout past STAGES: its training step under every schedule, on the engines."""
    run_on_nccl(record(stages, micro_batches, train_first(micro_batches)))
    run_on_nccl(record(stages, micro_batches, train_first(micro_batches), zero_bubble={"max_waiting": None}))
    for schedule, virtual_stages in [("zbv", 1), ("interleaved_1f1b", 2)]:
        step_micro_batches, run = chunk_runs(schedule, stages, micro_batches)[0]
        run_on_nccl(record_chunked(schedule, stages, step_micro_batches, run[:1], virtual_stages))


@functools.cache  # one per (tensor, chunk, micro-batch): nobody writes into it (a receive writes into its own)
def saying(tensor, chunk, micro_batch):
    """A hidden-states-shaped bf16 tensor that says what it is: an activation (+1) or a gradient (-1) of a chunk's
    micro-batch (small integers: exact in bf16)."""
    told = torch.zeros(ROWS, SEQUENCE, HIDDEN, dtype=torch.bfloat16)
    told[..., 0], told[..., 1], told[..., 2] = chunk, micro_batch, {"activation": 1, "gradient": -1}[tensor]
    return told


@functools.cache
def ids(value):
    return torch.full((ROWS, SEQUENCE), value, dtype=torch.long)


@functools.cache
def carried(chunk):
    """The floating tensors after chunk `chunk` beside its hidden states, another count and shape at each boundary
    (as Gemma 4's keys and values, carried from their source layer to their last reuser): chunk % 3 fp32 tensors
    saying the chunk, of SEQUENCE + chunk positions."""
    return tuple(torch.full((ROWS, SEQUENCE + chunk, HIDDEN // 2), float(chunk)) for _ in range(chunk % 3))


class ChunkComputation:
    """The chunked engine's computing, replaced: DeepSpeed's forward, backward and loading, which the engine runs for
    each chunk. Every schedule takes each chunk's micro-batches in order, forward and backward: in each batch, a
    chunk's forward k checks that its inputs are the previous chunk's forward k's outputs (received, or handed over
    in place on its rank) and makes outputs that say (chunk, k), with the chunk's own carried tensors (carried: the
    tuple differs by boundary, as Gemma 4's does); its backward k checks that its outputs' gradients are the next
    chunk's backward k's (the last chunk's: its own forward k's loss), one for each floating output, and gives its
    inputs' floating tensors a gradient, the hidden states' saying (chunk, k). checking=False: nothing checked (an
    unchecked pass, whose receives may find nothing sent yet). all_to_all: as Computation's, each chunk's forward
    and backward calling it."""

    def __init__(self, engine, checking, all_to_all=None):
        self.engine, self.checking = engine, checking
        self.forwards, self.backwards = collections.Counter(), collections.Counter()
        self.all_to_all = all_to_all or (lambda identity: None)

    def forward(self, buffer_id):
        engine, chunk = self.engine, self.engine.running_chunk
        j, self.forwards[chunk] = self.forwards[chunk], self.forwards[chunk] + 1
        self.all_to_all(("F", chunk, j))
        if chunk > 0 and self.checking:
            hidden, *kept, document_ids, position_ids = pipe_buffer(engine, "inputs", buffer_id)
            assert hidden.requires_grad and not document_ids.requires_grad and not position_ids.requires_grad
            assert (hidden.equal(saying("activation", chunk - 1, j)) and document_ids.eq(chunk - 1).all()
                    and position_ids.eq(j).all()), (f"rank {engine.stage_id}'s chunk {chunk}, forward {j}, received "
                                                    f"another chunk's or micro-batch's activations")
            assert len(kept) == len(carried(chunk - 1)) and all(
                t.requires_grad and t.equal(c) for t, c in zip(kept, carried(chunk - 1))), (
                f"rank {engine.stage_id}'s chunk {chunk}, forward {j}, received another boundary's tuple")
        if chunk == engine.last_chunk:
            engine.loss = torch.tensor(float(j))
        else:
            set_pipe_buffer(engine, "outputs", buffer_id,
                            (saying("activation", chunk, j), *carried(chunk), ids(chunk), ids(j)))

    def backward(self, buffer_id):
        engine, chunk = self.engine, self.engine.running_chunk
        j, self.backwards[chunk] = self.backwards[chunk], self.backwards[chunk] + 1
        self.all_to_all(("B", chunk, j))
        if self.checking and chunk == engine.last_chunk:
            assert engine.loss.item() == j, f"the last chunk's backward {j} took forward {engine.loss.item()}'s loss"
        elif self.checking:
            grad, *kept = received_gradients(engine)
            assert grad.equal(saying("gradient", chunk + 1, j)), (
                f"rank {engine.stage_id}'s chunk {chunk}, backward {j}, received another gradient")
            assert [t.shape for t in kept] == [c.shape for c in carried(chunk)], (
                f"rank {engine.stage_id}'s chunk {chunk}, backward {j}, received another boundary's gradients")
        if chunk > 0:  # (an unchecked pass's chunk may have received an empty tuple: no tensors)
            floating = [t for t in pipe_buffer(engine, "inputs", buffer_id) if t.is_floating_point()]
            for k, tensor in enumerate(floating):
                tensor.grad = saying("gradient", chunk, j) if k == 0 else torch.zeros_like(tensor)

    @staticmethod
    def load(buffer_id):
        pass


def record_chunked(schedule, stages, micro_batches, batches, virtual_stages=1, max_waiting=None,
                   zbv_times=EQUAL_TIMES, programs=None, checked=True, experts=False):
    """Each rank's operations over `batches` (as record's), recorded from engines/chunked_engine.py: each rank's
    ChunkedPipelineEngine runs its schedule (its program, p2p_program's items as instructions) through DeepSpeed's
    instruction loop and its own handlers: each boundary's shapes message, each tensor's send and receive posted and
    waited for where the program says, the in-place hand-over between chunks of one rank, W. Only DeepSpeed's
    computing is replaced (ChunkComputation, and no reduction or optimizer step). Several passes: ranks receive from
    ranks recorded after them (ZB-V's way back up, interleaving's wrap link), so each pass delivers the previous
    pass's sends in order; a receive of a boundary's shapes that finds none takes zeros (no tensors), and the tensors
    a chunk sends depend on the tuple it received, so unchecked passes run until every link's sends keep their
    shapes, and a last pass checks what each chunk took. zbv_times: the durations the V order is made for (set on the
    engine as zbv_times=auto does); programs: a program per rank to run instead; checked=False: the unchecked passes
    alone; experts: every chunk runs an expert-parallel all-to-all in each forward and backward."""
    sent, shapes, passes = {}, None, 0
    while True:
        sent, recorded = record_chunked_pass(schedule, stages, micro_batches, batches, virtual_stages, max_waiting,
                                             zbv_times, programs, experts, sent, checking=False)
        passes, previous = passes + 1, shapes
        shapes = {link: [(t.dtype, t.shape) for t in tensors] for link, tensors in sent.items()}
        if shapes == previous:
            break
        assert passes <= 2 * stages, "the sends' shapes never settle"
    if not checked:
        return recorded
    return record_chunked_pass(schedule, stages, micro_batches, batches, virtual_stages, max_waiting, zbv_times,
                               programs, experts, sent, checking=True)[1]


def record_chunked_pass(schedule, stages, micro_batches, batches, virtual_stages, max_waiting, zbv_times, programs,
                        experts, previous_sends, checking):
    """One pass of record_chunked, its receives taking previous_sends: (this pass's sends, each rank's program)."""
    inbox = collections.defaultdict(collections.deque, {link: collections.deque(tensors)
                                                        for link, tensors in previous_sends.items()})
    sent, recorded = collections.defaultdict(collections.deque), []
    for rank in range(stages):
        module = types.SimpleNamespace(parallel=types.SimpleNamespace(), get_tied_weights_and_groups=list,
                                       modules=list)
        engine = handlers_only_pipeline_engine(Grid(rank, stages), module, micro_batches, torch.device("cpu"))
        use_chunked_pipeline(engine, schedule, virtual_stages if schedule == "interleaved_1f1b" else None,
                             max_waiting)
        if zbv_times != EQUAL_TIMES or programs:
            set_chunk_program(engine, programs[rank] if programs else p2p_program(
                schedule, stages, micro_batches, rank, virtual_stages, max_waiting, zbv_times))
        neighbours = {engine.chunk_owner[chunk + step] for chunk in engine.local_chunks for step in (-1, 1)
                      if chunk + step in engine.chunk_owner} - {rank}
        recorder = Recorder(rank, sent, neighbours, inbox)
        computation = ChunkComputation(engine, checking, recorder.all_to_all if experts else None)
        replace_passes(engine, computation.forward, computation.backward, computation.load)
        replace_instruction_handlers(engine, {**instruction_handlers(engine), ReduceGrads: Computation.nothing,
                                              OptimizerStep: Computation.nothing})
        with pytest.MonkeyPatch.context() as patch:
            for name in ("send", "recv", "isend", "irecv"):
                patch.setattr(torch.distributed, name, getattr(recorder, name))
            for batch in batches:
                computation.forwards.clear(), computation.backwards.clear()  # each batch's micro-batches from 0
                with torch.set_grad_enabled(batch is train):  # eval_batch's forwards run without autograd
                    run_schedule(engine, batch(engine))
        recorded.append(recorder.program)
    return sent, recorded


def chunk_runs(schedule, stages, micro_batches):
    """[(the engine's micro-batches per step, a run's batches)] a chunked schedule is recorded over: from a run's
    start, and from a DPO reference pass; interleaving trains on multiples of p only, its evaluation takes any count
    (here with p micro-batches a step)."""
    if schedule == "interleaved_1f1b" and micro_batches % stages:
        return [(stages, [evaluate(micro_batches), evaluate(max(1, micro_batches - 1)), train])]
    return [(micro_batches, train_first(micro_batches)), (micro_batches, evaluation_first(micro_batches))]


@pytest.mark.parametrize("stages", STAGES)
def test_multi_chunk_schedules_are_matched_on_every_link(stages):
    """zbv and interleaved_1f1b (v = 2; v = 3 at p and p + 1 micro-batches; its training micro-batch counts are
    multiples of p, evaluation's any count: its last chunk may be short) on their engine, from a run's start (and, at
    1, p and p + 1 micro-batches, from a DPO reference pass; the configs' 32 and 64: a training step): both sides of
    every link (the wrap link last rank -> rank 0 of interleaving included; on 2 ranks it is the same pair as the link
    down) post their operations in one order, no send waits on a send, each boundary's shapes message arrives where
    its receiver waits for it, and each chunk takes its own micro-batch's activations and gradients (each boundary
    its own tuple)."""
    for micro_batches in micro_batch_counts(stages):
        edge = micro_batches in (1, stages, stages + 1)
        for schedule, virtual_stages in [("zbv", 1), ("interleaved_1f1b", 2), *([("interleaved_1f1b", 3)] * edge)]:
            for step_micro_batches, run in chunk_runs(schedule, stages, micro_batches)[:1 + edge]:
                run = run if micro_batches <= 16 else run[:1]  # the configs' 32 and 64: their training step
                run_on_nccl(record_chunked(schedule, stages, step_micro_batches, run, virtual_stages))


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_zbv_orders_made_for_other_times_are_matched_on_every_link(stages):
    """zbv_times (conf): the V order list-scheduled for a chunk's F, B and W times, alike on every rank or one per
    rank (the first heavier: embedding and head), up to conf's 8x spread: every link matched on the engine, every
    rank's order complete and within 1F1B's activations (2p micro-batch-chunks between F and W)."""
    heavy_first = [((6, 3, 2),) + ((4, 4, 3),) * (stages - 1), ((6, 4, 2),) + ((5, 7, 3),) * (stages - 1)]
    for zbv_times in [((1, 2, 1),), ((2, 1, 1),), ((1, 1, 2),), ((3, 4, 2),), ((8, 1, 1),), ((1, 8, 8),), *heavy_first]:
        for micro_batches in sorted({1, stages, stages + 1, 9}):
            run_on_nccl(record_chunked("zbv", stages, micro_batches, [train], zbv_times=zbv_times))
            for order in rank_orders("zbv", stages, micro_batches, zbv_times=zbv_times):
                assert sorted(order) == sorted((kind, chunk, j) for kind in "FBW" for chunk in (0, 1)
                                               for j in range(micro_batches))
                held = itertools.accumulate({"F": 1, "B": 0, "W": -1}[kind] for kind, _, _ in order)
                assert max(held) <= 2 * stages


@pytest.mark.parametrize("stages", [2, 4])
def test_zbv_with_max_waiting_is_matched_on_every_link(stages):
    """zero_bubble_max_waiting under zbv (each distinct cap), on the engine."""
    for micro_batches, max_waiting in itertools.product(micro_batch_counts(stages)[:10], caps(stages)[1:] or [0]):
        run_on_nccl(record_chunked("zbv", stages, micro_batches, [train], max_waiting=max_waiting))


def receives_posted_at_their_wait(program):
    """A rank's program with each receive posted right before the computation that takes it, as a rank following
    only its own compute order would (sends stay right after the computation that makes them)."""
    posts = {op: ("post", op) for action, op in program if action == "post" and op.direction == "recv"}
    return [entry for action, op in program if not (action == "post" and op.direction == "recv")
            for entry in ([posts[op]] if action == "wait" and op.direction == "recv" else []) + [(action, op)]]


def test_sends_posted_in_compute_order_deadlock_under_zbv():
    """What p2p_program prevents: each side posting its link's receives where its own compute order takes them, run
    by the engine, crosses two sends on ZB-V's 2-rank link."""
    programs = [receives_posted_at_their_wait(p2p_program("zbv", 2, 4, rank)) for rank in range(2)]
    with pytest.raises(AssertionError, match="deadlock: .*'s send #.*'s send #"):  # (gloo: the wrong tensors)
        run_on_nccl(record_chunked("zbv", 2, 4, [train], programs=programs, checked=False))
    run_on_nccl(record_chunked("zbv", 2, 4, [train]))  # the same step in p2p_program's order


def test_a_chunk_given_another_micro_batch_is_caught():
    """What the model cannot see (every activation has one shape), the stand-ins do: rank 1 posting two activation
    receives in another order than rank 0 sends them (micro-batches 1 and 2, posted one after the other) hands its
    chunk another micro-batch's activations."""
    programs = [p2p_program("zbv", 2, 4, rank) for rank in range(2)]
    first, second = [i for i, (action, op) in enumerate(programs[1])
                     if action == "post" and op.direction == "recv" and op.tensor == "activation"][1:3]
    assert second == first + 1
    programs[1][first], programs[1][second] = programs[1][second], programs[1][first]
    with pytest.raises(AssertionError, match="received another chunk's or micro-batch's activations"):
        record_chunked("zbv", 2, 4, [train], programs=programs)


def test_zbv_auto_times_agreed_by_every_rank_make_one_matched_order():
    """zbv_times=auto (engines/zbv_auto.py): a rank's F, B, W are robust to a slowed instruction; each stage's times
    are the mean of its ranks' all-gathered rows (2 data-parallel replicas per stage, in rank order), each raised to
    1/8 of the longest (a LoRA run's W is tiny); the order made for them is another than F = B = W's, and matched on
    every link."""
    # a rank's sums: each kind's median x its count (two chunks of 1 s and 3 s, one F slowed to 50 s by a neighbour)
    forwards = {("F", serial): seconds for serial, seconds in enumerate([1.0, 3.0, 1.1, 2.9, 50.0, 1.0])}
    assert robust_sums({**forwards, ("B", 6): 2.0, ("W", 7): 0.5}) == [12.0, 2.0, 0.5]
    rows = [[0, 1.2, 0.5, 0.002], [1, 0.7, 0.9, 0.6], [0, 1.4, 0.7, 0.004], [1, 0.9, 0.7, 0.6]]
    times = stage_times(rows, 2)
    assert sum(times, []) == pytest.approx([1.3, 0.6, 1.3 / 8, 0.8, 0.8, 0.6])
    durations = configured_zbv_durations(times)
    assert durations == ((16, 7, 2), (10, 10, 7))
    assert rank_orders("zbv", 2, 4, zbv_times=durations) != rank_orders("zbv", 2, 4)
    for micro_batches in (1, 2, 4, 9):
        run_on_nccl(record_chunked("zbv", 2, micro_batches, [train, train], zbv_times=durations))


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_expert_parallel_all_to_alls_keep_every_link_matched(stages):
    """Expert parallelism: each forward and backward (B) of a stage or chunk holding experts runs all-to-alls over
    its expert-parallel group, the stage's ranks in the other data-parallel replicas, and W runs none. Every rank of
    a stage runs its stage's program, so the group's ranks reach the same all-to-alls in the same order, between the
    same point-to-point operations; with them as collectives over those groups (2 replicas, one group each stage),
    every link stays matched and nothing waits forever, under every schedule, from a run's start and from a DPO
    reference pass."""
    for micro_batches in sorted({1, stages, stages + 1, 2 * stages}):
        for run in (train_first, evaluation_first):
            for zero_bubble in (None, {"max_waiting": None}):
                programs = record(stages, micro_batches, run(micro_batches), zero_bubble, experts=True)
                run_on_nccl(programs, programs)
        for schedule, virtual_stages in [("zbv", 1), ("interleaved_1f1b", 2)]:
            for step_micro_batches, run in chunk_runs(schedule, stages, micro_batches):
                programs = record_chunked(schedule, stages, step_micro_batches, run, virtual_stages, experts=True)
                run_on_nccl(programs, programs)


def test_expert_parallel_ranks_running_other_orders_are_caught():
    """Why a stage's ranks must run one program (zbv_times=auto agrees the measured times over all ranks,
    engines/zbv_auto.py): a replica running the V order made for other times reaches its all-to-alls in another
    order, which the model refuses; alone, each replica's order is matched."""
    equal = record_chunked("zbv", 2, 4, [train], experts=True)
    other = record_chunked("zbv", 2, 4, [train], zbv_times=((1, 2, 1),), experts=True)
    assert equal != other
    run_on_nccl(other, other)
    with pytest.raises(AssertionError, match=r"the ranks of a collective \(all_to_all\) meet at different ones"):
        run_on_nccl(equal, other)

