"""One wrapper around a pipeline engine's instruction handlers, with listeners: what watches the schedule as it runs
(the hang watchdog's position, resilience/hang_watchdog.py; the straggler report's compute and communication times,
resilience/stragglers.py; the profile's time per instruction, engines/profiling.py) adds a listener instead of
wrapping the handlers once more. A listener has instruction_started(instruction), whose result is handed to its
instruction_ended(instruction, started) once the handler returns (not after an exception: the step is lost)."""
import time
import weakref

import torch
from deepspeed.accelerator import get_accelerator

from deepspeed_internals.access import instruction_handlers, replace_instruction_handlers

_wrappers = weakref.WeakKeyDictionary()  # engine: its InstructionListeners


class InstructionListeners:
    def __init__(self, engine):
        self.listeners = []
        replace_instruction_handlers(engine, {instruction: self._listened(instruction, handler)
                                              for instruction, handler in instruction_handlers(engine).items()})

    def _listened(self, instruction, handler):
        def listened(engine, *args, **kwargs):
            started = [listener.instruction_started(instruction) for listener in self.listeners]
            result = handler(engine, *args, **kwargs)
            for listener, value in zip(reversed(self.listeners), reversed(started)):  # the last started ends first
                listener.instruction_ended(instruction, value)
            return result
        return listened


def add_instruction_listener(engine, listener):
    """listener hears every instruction the engine runs from now on (the engine's handlers wrapped at the first)."""
    if engine not in _wrappers:
        _wrappers[engine] = InstructionListeners(engine)
    _wrappers[engine].listeners.append(listener)


class InstructionClock:
    """Seconds per kind of instruction for a listener: by events on the device's stream under CUDA (read once, by
    take: no host sync per instruction), by `clock` on the CPU."""

    def __init__(self, clock=time.perf_counter):
        self.events = get_accelerator().device_name() == "cuda"
        self.clock, self.seconds, self.pending = clock, {}, []

    def start(self):
        if self.events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return self.clock()

    def stop(self, kind, started):
        if self.events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((kind, started, end))
        else:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + self.clock() - started

    def take(self):
        """{kind: seconds} since the last take (waits for the device's last timed instruction)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for kind, start, end in self.pending:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + start.elapsed_time(end) / 1000
            self.pending = []
        seconds, self.seconds = self.seconds, {}
        return seconds
