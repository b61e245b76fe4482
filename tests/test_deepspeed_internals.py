"""The start-up check of DeepSpeed's internals (deepspeed_internals/registry.py): it passes on the installed DeepSpeed, and an
internal that is gone or has other parameters stops a run with one line naming the version, the piece and the fix."""

import inspect

import deepspeed
import deepspeed.runtime.engine
import pytest
from deepspeed.runtime.pipe.engine import PipelineEngine

from deepspeed_internals.registry import (PIPELINE_ENGINE, DeepSpeedMismatch, Unused,
                                          check_deepspeed_internals)
from tests.launch import run_python
from resilience.exit_codes import CONFIG_ERROR

VERSION = deepspeed.__version__
FIX = "install deepspeed==0.19.8 (requirements.txt) or see deepspeed_internals/ for what to check"


def test_the_installed_deepspeed_has_every_internal():
    check_deepspeed_internals()


def test_a_missing_method_is_named_with_its_parameters(monkeypatch):
    monkeypatch.delattr(PipelineEngine, "_exec_send_grads")
    with pytest.raises(DeepSpeedMismatch) as error:
        check_deepspeed_internals()
    assert str(error.value) == (f"deepspeed {VERSION} lacks deepspeed.runtime.pipe.engine.PipelineEngine."
                                f"_exec_send_grads(self, buffer_id), which the zero-bubble engine overrides; {FIX}")


def test_a_missing_module_attribute_is_named(monkeypatch):
    monkeypatch.delattr(deepspeed.runtime.engine, "MEMORY_OPT_ALLREDUCE_SIZE")
    with pytest.raises(DeepSpeedMismatch) as error:
        check_deepspeed_internals()
    assert str(error.value) == (f"deepspeed {VERSION} lacks deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE, the "
                                f"gradient all-reduce bucket the memory plan counts; {FIX}")


def test_changed_parameters_are_named(monkeypatch):
    monkeypatch.setattr(PipelineEngine, "_exec_send_grads", lambda self, buffer_id, stream: None)
    with pytest.raises(DeepSpeedMismatch) as error:
        check_deepspeed_internals()
    assert str(error.value) == (f"deepspeed {VERSION} has deepspeed.runtime.pipe.engine.PipelineEngine."
                                f"_exec_send_grads(self, buffer_id, stream), not (self, buffer_id), which the "
                                f"zero-bubble engine overrides; {FIX}")


def test_a_name_deepspeed_now_uses_too_is_named(monkeypatch):
    """A DeepSpeed that came to define a name the zero-bubble engine adds (a method, or state it sets on self)."""
    monkeypatch.setattr(PipelineEngine, "_send_async", lambda self, tensors, stage: None, raising=False)
    with pytest.raises(DeepSpeedMismatch) as error:
        check_deepspeed_internals()
    assert str(error.value) == (f"deepspeed {VERSION} has _send_async in deepspeed.runtime.pipe.engine."
                                f"PipelineEngine, a name which the zero-bubble engine adds; {FIX}")
    monkeypatch.undo()
    source = inspect.getsource(PipelineEngine).replace("self.pipe_buffers = {", "self._sends = []\n self.pb = {")
    with pytest.raises(DeepSpeedMismatch, match="has _sends in deepspeed.runtime.pipe.engine.PipelineEngine"):
        Unused(PIPELINE_ENGINE, "_sends", "which the zero-bubble engine adds").check(
            {PipelineEngine: source})


def test_an_attribute_the_engine_no_longer_sets_is_named(monkeypatch):
    class PipelineEngineWithoutItsState(PipelineEngine):
        pass
    monkeypatch.setattr(deepspeed.runtime.pipe.engine, "PipelineEngine", PipelineEngineWithoutItsState)
    with pytest.raises(DeepSpeedMismatch) as error:
        check_deepspeed_internals()
    assert str(error.value) == (f"deepspeed {VERSION} lacks self.pipeline_enable_backward_allreduce in "
                                f"deepspeed.runtime.pipe.engine.PipelineEngine, which the trainer turns off for a "
                                f"data-parallel group of one; {FIX}")


@pytest.mark.parametrize("module, owner, name, line", [
    # found by run()'s start-up check
    ("deepspeed.runtime.pipe.engine", "deepspeed.runtime.pipe.engine.PipelineEngine", "_exec_send_grads",
     "lacks deepspeed.runtime.pipe.engine.PipelineEngine._exec_send_grads(self, buffer_id), which the zero-bubble "
     "engine overrides"),
    # found when the planner imports it, before run() starts
    ("deepspeed.runtime.engine", "deepspeed.runtime.engine", "MEMORY_OPT_ALLREDUCE_SIZE",
     "lacks deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE, the gradient all-reduce bucket the memory plan "
     "counts")])
def test_the_trainer_says_it_in_one_line(module, owner, name, line):
    script = (f"import runpy, sys, {module}; delattr({owner}, {name!r}); "
              f"sys.argv = ['trainer_pipe.py', '-cp', 'conf', '-cn', 'tiny', 'plan_only=true']; "
              f"runpy.run_path('trainer_pipe.py', run_name='__main__')")
    result = run_python(["-c", script], timeout=120)
    assert result.returncode == CONFIG_ERROR, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == f"trainer_pipe: error: deepspeed {VERSION} {line}; {FIX}"
    assert "Traceback" not in result.stderr
