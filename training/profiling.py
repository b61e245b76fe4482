"""Where a training step's time goes on each rank (`profile=true`): every engine instruction of the pipeline schedule
(forward, backward, W, sends, receives, gradient reductions, optimizer step, batch loading), the engine's own work
between them (the loss broadcast, its timers), and the loop's work between steps (logging, evaluation, the preemption
check, checkpoints). Written to output_dir/profile/rank{R}.json when the run ends; bench/trainer_profile.py turns the
files into a table per stage. The first step is left out: it allocates the buffers every later step reuses.
"""
import json
import os
import time

from training.instruction_listeners import add_instruction_listener


def time_instructions(engine, record):
    """record(instruction name, seconds) after each instruction the engine runs."""
    add_instruction_listener(engine, InstructionTimer(record))


class InstructionTimer:
    def __init__(self, record):
        self.record = record

    def instruction_started(self, instruction):
        return time.perf_counter()

    def instruction_ended(self, instruction, started):
        self.record(instruction.__name__, time.perf_counter() - started)


def add_to(totals):
    def record(name, seconds):
        totals[name] = totals.get(name, 0.0) + seconds
    return record


class StepProfile:
    """Seconds per instruction and per part of the loop, summed over the profiled steps. lap(name) adds the time
    since the previous lap to `name`: the loop calls it after each of its parts."""

    def __init__(self, engine, output_dir, rank, planned_tflops):
        """planned_tflops: the start-up plan's compute of this stage per micro-batch (planner/stage_costs.py), which
        bench/trainer_profile.py sets beside the measured compute time."""
        self.path = os.path.join(output_dir, "profile", f"rank{rank:05d}.json")
        self.stage, self.planned_tflops = engine.stage_id, planned_tflops
        self.instructions, self.loop, self.step_seconds = {}, {}, []
        self.training = True
        time_instructions(engine, self.record_instruction)
        engine.eval_batch = self.not_recorded(engine.eval_batch)
        self.started = self.last = time.perf_counter()
        self.first_step = True

    def record_instruction(self, name, seconds):
        if self.training:  # evaluation's instructions count as a whole, under the loop's "evaluation"
            self.instructions[name] = self.instructions.get(name, 0.0) + seconds

    def not_recorded(self, eval_batch):
        def unrecorded_eval_batch(*args, **kwargs):
            self.training = False
            try:
                return eval_batch(*args, **kwargs)
            finally:
                self.training = True
        return unrecorded_eval_batch

    def lap(self, name):
        now = time.perf_counter()
        self.loop[name] = self.loop.get(name, 0.0) + now - self.last
        self.last = now

    def step_done(self):
        """Called after the lap of the loop's last part of a step: the step ends where that lap did."""
        if self.first_step:
            self.instructions.clear()
            self.loop.clear()
            self.first_step = False
        else:
            self.step_seconds.append(self.last - self.started)
        self.started = self.last

    def write(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"stage": self.stage, "planned_tflops_per_micro_batch": self.planned_tflops,
                       "step_seconds": self.step_seconds, "instructions": self.instructions, "loop": self.loop}, f,
                      indent=1)


class NoProfile:
    """profile=false: the loop's calls cost nothing."""

    def lap(self, name):
        pass

    def step_done(self):
        pass

    def write(self):
        pass
