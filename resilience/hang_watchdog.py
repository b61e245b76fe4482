"""Hangs found, named and ended. A thread on each rank watches its progress: a training step must finish within
max(step_time_factor x the median of the measured step times, min_step_seconds); the first steps (before a step
time is measured) and the work between steps (logging, evaluation, saves, the next batch) get startup_seconds; and
no pipeline instruction may run longer than COLLECTIVE_TIMEOUT_SHARE of dist_timeout_minutes, so that the watchdog,
not a collective's timeout, ends a hung collective (NCCL's aborts the process: no stack, no record, no exit code to
restart on). On expiry the rank writes every thread's Python stack (and, on CUDA, NCCL's flight-recorder trace) to
output_dir/hang/, prints one line, on a line of its own, naming its rank, stage, data-parallel index, step, and the
pipeline instruction, micro-batch and peer it is stuck on, and exits HUNG, which a supervisor restarts
(resilience/supervisor.py). A slow rank only raises the median: the factor is the room it gets.

The stopped rank itself cannot report; its peers can: one stuck in RecvActivation of micro-batch 3 from rank 5
names rank 5. Under CUDA a receive or a wait returns on the host at once (NCCL makes the device's stream wait), and
the host goes on until something reads a result (the optimizer step's gradient norm): each instruction's end is
marked on the device's stream, and the first mark the device has not passed names what the rank actually waits on.
Every rank's position also goes into its rank record (resilience/rank_records.py) when its launcher ends it, so the
supervisor's line names who waited for whom.
"""
import collections
import faulthandler
import math
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe import schedule

from resilience.exit_codes import HUNG
from engines.instruction_listeners import add_instruction_listener
from engines.zero_bubble_schedule import PostRecvActivation, WaitRecvActivation
from cluster.console import say

HANG_DIR = "hang"  # in output_dir: each hung rank's stacks and flight-recorder trace, NCCL's trace at a timeout
POLL_SECONDS = 1.0  # the longest the thread sleeps: a phase's new, shorter limit is seen within it
STEP_TIMES_KEPT = 100  # the median follows the run's recent steps (a layout or sequence-length change moves it)
STEPS_BEFORE_LIMIT_CHECK = 3  # measured steps whose median startup_seconds is checked against, once
# The longest the watchdog lets a phase (startup_seconds' default) or one instruction run, as a share of the
# collectives' timeout: it names a hang and exits before a collective's timeout ends the rank, the rest left for the
# host running ahead of the device (NCCL times an operation from when it was queued) and the stacks' dump.
COLLECTIVE_TIMEOUT_SHARE = 0.9
PER_STEP_INSTRUCTIONS = (schedule.ReduceGrads, schedule.ReduceTiedGrads, schedule.OptimizerStep)
# The stage a point-to-point instruction waits on (-1 the previous one, +1 the next one).
PEERS = {schedule.RecvActivation: -1, PostRecvActivation: -1, WaitRecvActivation: -1, schedule.SendGrad: -1,
         schedule.RecvGrad: +1, schedule.SendActivation: +1}


def longest_limit(dist_timeout_minutes):
    """Seconds the watchdog lets a phase or an instruction run at most: below the collectives' timeout."""
    return int(COLLECTIVE_TIMEOUT_SHARE * 60 * dist_timeout_minutes)


class HangWatchdog:
    def __init__(self, settings, output_dir, engine, total_steps, record, dist_timeout_minutes):
        self.settings, self.factor = settings, settings.step_time_factor
        self.min_step_seconds = settings.min_step_seconds
        self.startup_seconds = settings.startup_seconds
        self.hang_dir, self.record = os.path.join(output_dir, HANG_DIR), record
        self.rank, self.stage, self.data_index = dist.get_rank(), engine.stage_id, engine.grid.get_data_parallel_id()
        self.engine = engine
        self.step_seconds = collections.deque(maxlen=STEP_TIMES_KEPT)
        self.instruction, self.micro_batches, self.device_marks = None, collections.Counter(), []
        self.instruction_at = None  # when the instruction running started; None between instructions
        self.startup_limit = self.startup_seconds, f"hang_watchdog.startup_seconds={self.startup_seconds}"
        self.dist_timeout_minutes = dist_timeout_minutes
        self.instruction_limit = (longest_limit(dist_timeout_minutes),
                                  f"one pipeline instruction, {COLLECTIVE_TIMEOUT_SHARE} x dist_timeout_minutes="
                                  f"{dist_timeout_minutes}: a collective's timeout would end the rank without a word")
        self.first_step = engine.global_steps  # a resumed run's first step is the one after its checkpoint
        self.armed_at, self.phase, self.limit = time.monotonic(), ("start", self.first_step + 1), self.startup_limit
        record.where = self.position
        self._watch_engine(total_steps)
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="hang-watchdog").start()

    def _watch_engine(self, total_steps):
        """Follow the engine's steps and instructions; after its last step the end of training (the final save,
        the export) is left to the collectives' timeout."""
        engine = self.engine
        add_instruction_listener(engine, self)
        train_batch, eval_batch = engine.train_batch, engine.eval_batch

        def watched_train_batch(*args, **kwargs):
            step = engine.global_steps + 1
            self._enter(("step", step), self.step_limit())
            started = time.monotonic()
            loss = train_batch(*args, **kwargs)
            if step > 1 + self.first_step:  # the first step allocates what later ones reuse
                self.step_seconds.append(time.monotonic() - started)
                if len(self.step_seconds) == STEPS_BEFORE_LIMIT_CHECK and self.rank == 0:
                    warning = startup_limit_warning(self.settings, statistics.median(self.step_seconds),
                                                    self.dist_timeout_minutes)
                    if warning:
                        say(warning)
            if step >= total_steps:
                self.stop()
            else:
                self._enter(("after", step), self.startup_limit)
            return loss

        def watched_eval_batch(*args, **kwargs):
            previous = self.phase, self.limit
            self._enter(("evaluation", engine.global_steps), self.startup_limit)
            try:
                return eval_batch(*args, **kwargs)
            finally:
                self._enter(*previous)
        engine.train_batch, engine.eval_batch = watched_train_batch, watched_eval_batch

    def step_limit(self):
        """(seconds, why) a training step may take."""
        if not self.step_seconds:
            return self.startup_limit
        median = statistics.median(self.step_seconds)
        return (max(self.factor * median, self.min_step_seconds),
                f"{self.factor} x the median step time {median:.2f}s, at least "
                f"hang_watchdog.min_step_seconds={self.min_step_seconds}")

    def stop(self):
        self._stopped.set()

    def _enter(self, phase, limit):
        self.armed_at = time.monotonic()  # first: the thread may read it with the old limit, never the reverse
        self.phase, self.limit, self.instruction, self.instruction_at = phase, limit, None, None
        self.micro_batches.clear()
        self.device_marks = []

    def instruction_started(self, instruction):
        """The n-th instruction of a kind in a step is micro-batch n's: each runs its micro-batches in order."""
        micro_batch = None
        if instruction not in PER_STEP_INSTRUCTIONS:
            self.micro_batches[instruction] += 1
            micro_batch = self.micro_batches[instruction]
        self.instruction, self.instruction_at = (instruction, micro_batch), time.monotonic()

    def instruction_ended(self, instruction, started):
        """The position stays until the next instruction (a hang after a handler is named by its last one); under
        CUDA the device's progress past it is marked on its stream."""
        self.instruction_at = None
        mark = device_mark()
        if mark is not None:
            self.device_marks.append((self.instruction, mark))

    def position(self):
        """{where: this rank's phase and instruction, waiting_for: the peer rank it waits on, or None}: the
        instruction the device has not got past, where it lags the host, else the host's."""
        waited_on = next((instruction for instruction, mark in self.device_marks if not mark.query()), None)
        instruction = waited_on or self.instruction
        where, waiting_for = describe_phase(self.phase, instruction), None
        if waited_on is not None and self.instruction is not None and waited_on is not self.instruction:
            where += f" (on the device; the host waits in {self.instruction[0].__name__})"
        if instruction is not None and instruction[0] in PEERS:
            waiting_for = self.engine.grid.stage_to_global(self.stage + PEERS[instruction[0]])
        return {"where": where, "waiting_for": waiting_for}

    def _expired(self):
        """(seconds waited, (limit, why)) of the phase or the instruction whose limit has passed, else None."""
        now, instruction_at = time.monotonic(), self.instruction_at
        if instruction_at is not None and now - instruction_at > self.instruction_limit[0]:
            return now - instruction_at, self.instruction_limit
        if now - self.armed_at > self.limit[0]:
            return now - self.armed_at, self.limit
        return None

    def _watch(self):
        """Wakes at the phase's or the running instruction's limit, whichever comes first (or within POLL_SECONDS,
        to see progress and a new limit): a hang is named as the limit passes, not up to a poll later."""
        while True:
            now, instruction_at = time.monotonic(), self.instruction_at
            remaining = self.limit[0] - (now - self.armed_at)
            if instruction_at is not None:
                remaining = min(remaining, self.instruction_limit[0] - (now - instruction_at))
            if self._stopped.wait(min(POLL_SECONDS, max(remaining, 0.0) + 0.01)):
                return
            expired = self._expired()
            if expired:
                self._report_and_exit(*expired)

    def _report_and_exit(self, waited, limit):
        os.makedirs(self.hang_dir, exist_ok=True)
        stacks = os.path.join(self.hang_dir, f"rank{self.rank:05d}-stacks.txt")
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        trace = dump_nccl_flight_recorder(os.path.join(self.hang_dir, f"rank{self.rank:05d}-nccl_trace.pickle"))
        trace = f", NCCL's flight recorder: {trace}" if trace else ""
        position = self.position()
        peer = f", waiting for rank {position['waiting_for']}" if position["waiting_for"] is not None else ""
        line = (f"hang watchdog: rank {self.rank} (stage {self.stage}, data-parallel {self.data_index}) hung "
                f"{position['where']}{peer}: no progress for {waited:.0f}s (limit {limit[0]:.0f}s: {limit[1]}); "
                f"every thread's stack: {stacks}{trace}; exiting {HUNG} for a restart")
        say(line, sys.stderr)
        self.record.end(HUNG, line)
        os._exit(HUNG)


def describe_phase(phase, instruction):
    """Where a rank is, for a person: the pipeline instruction ((kind, micro-batch) or None) in its phase."""
    kind, step = phase
    doing = ""
    if instruction is not None:
        name, micro_batch = instruction[0].__name__, instruction[1]
        doing = f"in {name}" + (f" of micro-batch {micro_batch}" if micro_batch else "") + " "
    if kind == "step":
        return f"{doing}at step {step}" if doing else f"at step {step}, before its first pipeline instruction"
    if kind == "evaluation":
        return f"{doing}in an evaluation after step {step}"
    if kind == "after":
        return f"after step {step} (logging, evaluation, saving, loading the next batch)"
    return f"before step {step} (setting up, loading its first batch)"


def device_mark():
    """An event on the device's current stream, passed once the device has run what was queued before it; None
    off CUDA, where a wait blocks the host (gloo)."""
    if get_accelerator().device_name() != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def dump_nccl_flight_recorder(path):
    """NCCL's flight recorder (the last collectives and point-to-point operations of every group, and which are
    still pending) into path; None off CUDA or where this torch lacks it."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if get_accelerator().device_name() != "cuda" or dump is None:
        return None
    try:
        trace = dump()
    except RuntimeError as error:  # e.g. the buffer was off: say so in the line, do not lose the stacks
        return f"not written ({error})"
    with open(path, "wb") as f:
        f.write(trace)
    return path


def startup_limit_warning(settings, median_step_seconds, dist_timeout_minutes=None):
    """A line when startup_seconds is shorter than the limit the run's measured step time gives a step: a restart's
    first steps (before its own step time is measured) and the work between steps run under it. None when not. The
    value it advises must stay below the collectives' timeout (training/config_checks.py): where it cannot, the line
    says by how much to raise dist_timeout_minutes."""
    step_limit = settings.step_time_factor * median_step_seconds
    if settings.startup_seconds >= step_limit:
        return None
    advice = f"raise it to at least {math.ceil(step_limit)}"
    if dist_timeout_minutes is not None and math.ceil(step_limit) >= 60 * dist_timeout_minutes:
        advice += (f", and dist_timeout_minutes, which it must stay below, to at least "
                   f"{math.ceil(step_limit) // 60 + 1}")
    return (f"hang watchdog: warning: hang_watchdog.startup_seconds={settings.startup_seconds} is shorter than "
            f"{settings.step_time_factor} x the measured median step time {median_step_seconds:.1f}s "
            f"({step_limit:.0f}s): a restart's first steps, which run under it, and the saves and evaluations between "
            f"steps may be ended as hangs; {advice}.")


class NoWatchdog:
    """hang_watchdog.enabled=false."""

    def stop(self):
        pass


def hang_watchdog(cfg, engine, total_steps, record):
    """The watchdog of a training run, watching from its first step."""
    if cfg.hang_watchdog.enabled:
        return HangWatchdog(cfg.hang_watchdog, cfg.output_dir, engine, total_steps, record, cfg.dist_timeout_minutes)
    return NoWatchdog()
