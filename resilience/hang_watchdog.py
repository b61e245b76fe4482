"""Hangs found, named and ended. A thread on each rank watches its progress: a training step must finish within
max(step_time_factor x the median of the measured step times, min_step_seconds); the first steps (before a step
time is measured) and the work between steps (logging, evaluation, saves, the next batch) get startup_seconds. On
expiry the rank writes every thread's Python stack (and, on CUDA, NCCL's flight-recorder trace) to
output_dir/hang/, prints one line naming its rank, stage, data-parallel index, step, and the pipeline instruction,
micro-batch and peer it is stuck on, and exits HUNG, which a supervisor restarts (resilience/supervisor.py). A slow
rank only raises the median: the factor is the room it gets. The collectives' own timeout (dist_timeout_minutes)
stays as the last resort.

The stopped rank itself cannot report; its peers can: one stuck in RecvActivation of micro-batch 3 from rank 5
names rank 5. Every rank's position also goes into its rank record (resilience/rank_records.py) when its launcher
ends it, so the supervisor's line names who waited for whom.
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

POLL_SECONDS = 1.0  # the longest the thread sleeps: a phase's new, shorter limit is seen within it
STEP_TIMES_KEPT = 100  # the median follows the run's recent steps (a layout or sequence-length change moves it)
STEPS_BEFORE_LIMIT_CHECK = 3  # measured steps whose median startup_seconds is checked against, once
PER_STEP_INSTRUCTIONS = (schedule.ReduceGrads, schedule.ReduceTiedGrads, schedule.OptimizerStep)
# The stage a point-to-point instruction waits on (-1 the previous one, +1 the next one), and which way.
PEERS = {schedule.RecvActivation: (-1, "from"), PostRecvActivation: (-1, "from"), WaitRecvActivation: (-1, "from"),
         schedule.SendGrad: (-1, "to"), schedule.RecvGrad: (+1, "from"), schedule.SendActivation: (+1, "to")}


class HangWatchdog:
    def __init__(self, settings, output_dir, engine, total_steps, record):
        self.settings, self.factor = settings, settings.step_time_factor
        self.min_step_seconds = settings.min_step_seconds
        self.startup_seconds = settings.startup_seconds
        self.hang_dir, self.record = os.path.join(output_dir, "hang"), record
        self.rank, self.stage, self.data_index = dist.get_rank(), engine.stage_id, engine.grid.get_data_parallel_id()
        self.engine = engine
        self.step_seconds = collections.deque(maxlen=STEP_TIMES_KEPT)
        self.instruction, self.micro_batches = None, collections.Counter()
        self.startup_limit = self.startup_seconds, f"hang_watchdog.startup_seconds={self.startup_seconds}"
        self.armed_at, self.phase, self.limit = time.monotonic(), "the first step", self.startup_limit
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
            self._enter(f"step {step}", self.step_limit())
            started = time.monotonic()
            loss = train_batch(*args, **kwargs)
            if step > 1 + self.first_step:  # the first step allocates what later ones reuse
                self.step_seconds.append(time.monotonic() - started)
                if len(self.step_seconds) == STEPS_BEFORE_LIMIT_CHECK and self.rank == 0:
                    warning = startup_limit_warning(self.settings, statistics.median(self.step_seconds))
                    if warning:
                        print(warning, flush=True)
            if step >= total_steps:
                self.stop()
            else:
                self._enter(f"after step {step} (logging, evaluation, saving, loading the next batch)",
                            self.startup_limit)
            return loss

        def watched_eval_batch(*args, **kwargs):
            previous = self.phase, self.limit
            self._enter("evaluation", self.startup_limit)
            try:
                return eval_batch(*args, **kwargs)
            finally:
                self._enter(*previous)
        self.first_step = engine.global_steps  # a resumed run's first step is the one after its checkpoint
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
        self.phase, self.limit, self.instruction = phase, limit, None
        self.micro_batches.clear()

    def instruction_started(self, instruction):
        """The n-th instruction of a kind in a step is micro-batch n's: each runs its micro-batches in order."""
        micro_batch = None
        if instruction not in PER_STEP_INSTRUCTIONS:
            self.micro_batches[instruction] += 1
            micro_batch = self.micro_batches[instruction]
        self.instruction = instruction, micro_batch

    def instruction_ended(self, instruction, started):
        pass  # the position stays until the next instruction: a hang after a handler is named by its last one

    def position(self):
        """{where: this rank's phase and instruction, waiting_for: the peer rank it waits on, or None}."""
        where, waiting_for = self.phase, None
        if self.instruction is not None:
            instruction, micro_batch = self.instruction
            where += f", in {instruction.__name__}" + (f" of micro-batch {micro_batch}" if micro_batch else "")
            if instruction in PEERS:
                stage_offset, direction = PEERS[instruction]
                waiting_for = self.engine.grid.stage_to_global(self.stage + stage_offset)
                where += f" ({direction} rank {waiting_for})"
        return {"where": where, "waiting_for": waiting_for}

    def _watch(self):
        """Wakes at the limit (or within POLL_SECONDS, to see progress and a new limit): a hang is named as the
        limit passes, not up to a poll later."""
        while True:
            remaining = self.limit[0] - (time.monotonic() - self.armed_at)
            if self._stopped.wait(min(POLL_SECONDS, max(remaining, 0.0) + 0.01)):
                return
            waited = time.monotonic() - self.armed_at
            if waited > self.limit[0]:
                self._report_and_exit(waited)

    def _report_and_exit(self, waited):
        os.makedirs(self.hang_dir, exist_ok=True)
        stacks = os.path.join(self.hang_dir, f"rank{self.rank:05d}-stacks.txt")
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        trace = dump_nccl_flight_recorder(os.path.join(self.hang_dir, f"rank{self.rank:05d}-nccl_trace.pickle"))
        trace = f", NCCL's flight recorder: {trace}" if trace else ""
        line = (f"hang watchdog: rank {self.rank} (stage {self.stage}, data-parallel {self.data_index}) made no "
                f"progress for {waited:.0f}s (limit {self.limit[0]:.0f}s: {self.limit[1]}) in "
                f"{self.position()['where']}; every thread's stack: {stacks}{trace}; exiting {HUNG} for a restart")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        self.record.end(HUNG, line)
        os._exit(HUNG)


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


def startup_limit_warning(settings, median_step_seconds):
    """A line when startup_seconds is shorter than the limit the run's measured step time gives a step: a restart's
    first steps (before its own step time is measured) and the work between steps run under it. None when not."""
    step_limit = settings.step_time_factor * median_step_seconds
    if settings.startup_seconds >= step_limit:
        return None
    return (f"hang watchdog: warning: hang_watchdog.startup_seconds={settings.startup_seconds} is shorter than "
            f"{settings.step_time_factor} x the measured median step time {median_step_seconds:.1f}s "
            f"({step_limit:.0f}s): a restart's first steps, which run under it, and the saves and evaluations between "
            f"steps may be ended as hangs; raise it to at least {math.ceil(step_limit)}.")


class NoWatchdog:
    """hang_watchdog.enabled=false."""

    def stop(self):
        pass


def hang_watchdog(cfg, engine, total_steps, record):
    """The watchdog of a training run, watching from its first step."""
    if cfg.hang_watchdog.enabled:
        return HangWatchdog(cfg.hang_watchdog, cfg.output_dir, engine, total_steps, record)
    return NoWatchdog()
