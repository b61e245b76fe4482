"""Where a training step's time goes on each rank (`profile=true`): every engine instruction of the pipeline schedule
(forward, backward, W, sends, receives, gradient reductions, optimizer step, batch loading), the engine's own work
between them (the loss broadcast, its timers), and the loop's work between steps (logging, evaluation, the preemption
check, checkpoints). Written to output_dir/profile/rank{R}.json when the run ends; bench/trainer_profile.py turns the
files into a table per stage. The first step is left out: it allocates the buffers every later step reuses.
Each figure is kept twice: wall-clock seconds, and the CPU seconds of the training thread (time.thread_time), which
a shared host's load changes far less and which a wait in a receive or a collective does not count.
"""
import json
import os
import time

from engines.instruction_listeners import add_instruction_listener


def time_instructions(engine, record):
    """record(instruction name, seconds, CPU seconds of the training thread) after each instruction the engine runs."""
    add_instruction_listener(engine, InstructionTimer(record))


class InstructionTimer:
    def __init__(self, record):
        self.record = record

    def instruction_started(self, instruction):
        return time.perf_counter(), time.thread_time()

    def instruction_ended(self, instruction, started):
        self.record(instruction.__name__, time.perf_counter() - started[0], time.thread_time() - started[1])


def add_to(totals):
    """A record for time_instructions summing wall-clock seconds per instruction into totals."""
    def record(name, seconds, cpu_seconds):
        add(totals, name, seconds)
    return record


class StepProfile:
    """Seconds per instruction and per part of the loop, summed over the profiled steps, wall-clock and CPU. lap(name)
    adds the time since the previous lap to `name`: the loop calls it after each of its parts."""

    def __init__(self, engine, output_dir, rank, planned_tflops):
        """planned_tflops: the start-up plan's compute of this stage per micro-batch (planner/stage_costs.py), which
        bench/trainer_profile.py sets beside the measured compute time."""
        self.path = os.path.join(output_dir, "profile", f"rank{rank:05d}.json")
        self.stage, self.planned_tflops = engine.stage_id, planned_tflops
        self.instructions, self.loop, self.step_seconds = {}, {}, []
        self.instructions_cpu, self.loop_cpu, self.step_cpu_seconds = {}, {}, []
        self.training = True
        time_instructions(engine, self.record_instruction)
        engine.eval_batch = self.not_recorded(engine.eval_batch)
        self.started, self.started_cpu = self.last, self.last_cpu = time.perf_counter(), time.thread_time()
        self.first_step = True

    def record_instruction(self, name, seconds, cpu_seconds):
        if self.training:  # evaluation's instructions count as a whole, under the loop's "evaluation"
            add(self.instructions, name, seconds)
            add(self.instructions_cpu, name, cpu_seconds)

    def not_recorded(self, eval_batch):
        def unrecorded_eval_batch(*args, **kwargs):
            self.training = False
            try:
                return eval_batch(*args, **kwargs)
            finally:
                self.training = True
        return unrecorded_eval_batch

    def lap(self, name):
        now, now_cpu = time.perf_counter(), time.thread_time()
        add(self.loop, name, now - self.last)
        add(self.loop_cpu, name, now_cpu - self.last_cpu)
        self.last, self.last_cpu = now, now_cpu

    def step_done(self):
        """Called after the lap of the loop's last part of a step: the step ends where that lap did."""
        if self.first_step:
            for totals in (self.instructions, self.loop, self.instructions_cpu, self.loop_cpu):
                totals.clear()
            self.first_step = False
        else:
            self.step_seconds.append(self.last - self.started)
            self.step_cpu_seconds.append(self.last_cpu - self.started_cpu)
        self.started, self.started_cpu = self.last, self.last_cpu

    def write(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"stage": self.stage, "planned_tflops_per_micro_batch": self.planned_tflops,
                       "step_seconds": self.step_seconds, "instructions": self.instructions, "loop": self.loop,
                       "step_cpu_seconds": self.step_cpu_seconds, "instructions_cpu": self.instructions_cpu,
                       "loop_cpu": self.loop_cpu}, f, indent=1)


def add(totals, name, seconds):
    totals[name] = totals.get(name, 0.0) + seconds


class NoProfile:
    """profile=false: the loop's calls cost nothing."""

    def lap(self, name):
        pass

    def step_done(self):
        pass

    def write(self):
        pass
