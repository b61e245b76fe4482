"""One wrapper around a pipeline engine's instruction handlers, with listeners: what watches the schedule as it runs
(the hang watchdog's position, training/hang_watchdog.py; the straggler report's compute and communication times,
training/stragglers.py; the profile's time per instruction, training/profiling.py) adds a listener instead of
wrapping the handlers once more. A listener has instruction_started(instruction), whose result is handed to its
instruction_ended(instruction, started) once the handler returns (not after an exception: the step is lost)."""
import weakref

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
