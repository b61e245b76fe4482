"""Every pipeline schedule's point-to-point operations, checked against a model of NCCL's semantics: both directions
of a link share one stream per side, operations run in the order each side issued them, and a send completes only
when the peer's matching receive runs (no buffering, unlike gloo, so the CPU runs cannot show a deadlock). A pair
that is not a send facing a receive of the same tensor waits forever or delivers the wrong tensor.

The operations are derived from the schedules' instructions as each engine executes them: DeepSpeed's
PipelineEngine blocks on every send and receive; the zero-bubble engine (training/pipeline_engine.py) posts its
sends and activation receives and waits for them later."""
import collections
import itertools

import pytest
from deepspeed.runtime.pipe.schedule import (InferenceSchedule, RecvActivation, RecvGrad, ReduceTiedGrads,
                                             SendActivation, SendGrad, TrainSchedule)

from training.schedule import PostRecvActivation, WaitRecvActivation, ZeroBubbleSchedule

# Stage and micro-batch counts of every config and test, and around them.
STAGES = range(2, 9)
MICRO_BATCHES = [*range(1, 18), 32, 64]
MAX_WAITING = [None, 0, 1, 2, 4]


class Rank:
    """One stage's program as NCCL sees it: ("post", op) puts an operation on its link's stream, ("wait", op) blocks
    the stage until it completed. op: (peer stage, "send" | "recv", tensor kind, index of that kind on the link)."""

    def __init__(self, stage):
        self.stage, self.program, self.counts, self.meta_sent = stage, [], collections.Counter(), set()
        self.posted = collections.deque()  # posted activation receives, waited for oldest first

    def op(self, peer, direction, kind):
        self.counts[(peer, direction, kind)] += 1
        return (peer, direction, kind, self.counts[(peer, direction, kind)])

    def blocking(self, peer, direction, kind):
        op = self.op(peer, direction, kind)
        self.program += [("post", op), ("wait", op)]

    def post(self, peer, direction, kind):
        op = self.op(peer, direction, kind)
        self.program.append(("post", op))
        return op

    def meta(self, peer, direction):
        """DeepSpeed sends the activations' shapes once, blocking, before the first activations."""
        if peer not in self.meta_sent:
            self.meta_sent.add(peer)
            self.blocking(peer, direction, "meta")


def deepspeed_engine(rank, cmd):
    """deepspeed.runtime.pipe.engine.PipelineEngine: p2p.send / p2p.recv block."""
    s = rank.stage
    if isinstance(cmd, SendActivation):
        rank.meta(s + 1, "send")
        rank.blocking(s + 1, "send", "activation")
    elif isinstance(cmd, RecvActivation):
        rank.meta(s - 1, "recv")
        rank.blocking(s - 1, "recv", "activation")
    elif isinstance(cmd, SendGrad):
        rank.blocking(s - 1, "send", "gradient")
    elif isinstance(cmd, RecvGrad):
        rank.blocking(s + 1, "recv", "gradient")


def zero_bubble_engine(rank, cmd):
    """training/pipeline_engine.py: sends are posted (isend) and waited for at the step's end, activation receives
    posted (irecv) and waited for at the forward; gradients are received blocking; evaluation receives as
    DeepSpeed does."""
    s = rank.stage
    if isinstance(cmd, SendActivation):
        rank.meta(s + 1, "send")
        rank.sends.append(rank.post(s + 1, "send", "activation"))
    elif isinstance(cmd, SendGrad):
        rank.sends.append(rank.post(s - 1, "send", "gradient"))
    elif isinstance(cmd, PostRecvActivation):
        rank.meta(s - 1, "recv")
        rank.posted.append(rank.post(s - 1, "recv", "activation"))
    elif isinstance(cmd, WaitRecvActivation):
        rank.program.append(("wait", rank.posted.popleft()))
    elif isinstance(cmd, ReduceTiedGrads):
        rank.program += [("wait", op) for op in rank.sends]
        rank.sends = []
    else:
        deepspeed_engine(rank, cmd)


def programs(schedules, engine):
    """Each stage's program over a sequence of batches: schedules(stage) -> [schedule, ...] for that stage."""
    ranks = []
    for stage, batches in enumerate(schedules):
        rank = Rank(stage)
        rank.sends = []
        for schedule in batches:
            for cmds in schedule.steps():
                for cmd in cmds:
                    engine(rank, cmd)
        rank.program += [("wait", op) for op in rank.sends]  # evaluation's sends complete before the process ends
        ranks.append(rank)
    return ranks


def run_on_nccl(ranks):
    """Execute the programs under the model; raise on a deadlock or a send matched with the wrong receive."""
    streams = {(r.stage, peer): collections.deque() for r in ranks for peer in (r.stage - 1, r.stage + 1)}
    done, position = set(), [0] * len(ranks)
    progressed = True
    while progressed:
        progressed = False
        for rank in ranks:  # run each stage up to its next wait on an unfinished operation
            while position[rank.stage] < len(rank.program):
                action, op = rank.program[position[rank.stage]]
                if action == "wait" and (rank.stage, op) not in done:
                    break
                if action == "post":
                    streams[(rank.stage, op[0])].append(op)
                position[rank.stage] += 1
                progressed = True
        for (stage, peer), stream in streams.items():  # the heads of a link's two streams complete together
            other = streams.get((peer, stage))
            if stage > peer or not stream or not other:
                continue
            mine, theirs = stream[0], other[0]
            if mine[1] == theirs[1]:
                continue  # two sends (or two receives) facing each other: neither completes
            if mine[2:] != theirs[2:]:
                raise AssertionError(f"stage {stage}'s {mine[1]} of {mine[2]} #{mine[3]} is matched with stage "
                                     f"{peer}'s {theirs[1]} of {theirs[2]} #{theirs[3]}: the wrong tensor")
            done.update({(stage, stream.popleft()), (peer, other.popleft())})
            progressed = True
    stuck = {r.stage: r.program[position[r.stage]] for r in ranks if position[r.stage] < len(r.program)}
    if stuck:
        heads = {link: stream[0] for link, stream in streams.items() if stream}
        raise AssertionError(f"deadlock: stages wait at {stuck}; heads of the link streams {heads}")


def train_eval_train(schedule_of, stages, micro_batches):
    """A training step, an evaluation, another training step: the shapes are sent once, in whichever comes first."""
    return [[schedule_of(stage), InferenceSchedule(micro_batches, stages, stage), schedule_of(stage)]
            for stage in range(stages)]


@pytest.mark.parametrize("stages", STAGES)
def test_deepspeed_1f1b_is_matched_on_every_link(stages):
    """DeepSpeed's own schedule passes: the model of NCCL's semantics accepts a known-good order."""
    for micro_batches in MICRO_BATCHES:
        run_on_nccl(programs(train_eval_train(lambda s: TrainSchedule(micro_batches, stages, s), stages,
                                              micro_batches), deepspeed_engine))


@pytest.mark.parametrize("stages", STAGES)
def test_zero_bubble_is_matched_on_every_link(stages):
    for micro_batches, max_waiting in itertools.product(MICRO_BATCHES, MAX_WAITING):
        run_on_nccl(programs(train_eval_train(lambda s: ZeroBubbleSchedule(micro_batches, stages, s, max_waiting),
                                              stages, micro_batches), zero_bubble_engine))


def receive_when_needed(rank, cmd):
    """The zero-bubble engine before the link order: each activation received, blocking, at its forward."""
    if isinstance(cmd, WaitRecvActivation):
        rank.meta(rank.stage - 1, "recv")
        rank.blocking(rank.stage - 1, "recv", "activation")
    elif not isinstance(cmd, PostRecvActivation):
        zero_bubble_engine(rank, cmd)


def test_model_catches_the_crossed_sends_of_receiving_at_the_forward():
    """2 stages, 2 micro-batches: the link's second operation was a send on both sides (stage 0 sends micro-batch
    1's activations while stage 1 sends micro-batch 0's gradient); gloo buffered it, NCCL would hang."""
    ranks = programs([[ZeroBubbleSchedule(2, 2, s)] for s in range(2)], receive_when_needed)
    with pytest.raises(AssertionError, match="deadlock"):
        run_on_nccl(ranks)
