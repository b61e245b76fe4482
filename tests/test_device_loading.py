"""Loading into parameters that do not live in host memory, as on a GPU: the stage's parameters, the optimizer's
master weights and moments are moved to the meta device (a copy into it is a no-op, and like a CUDA tensor it has
no host address: .numpy() and raw reads into its storage raise), then the trainer's own resume runs on them: the
layer files, the per-layer optimizer state (resharded: 2 stages x 2 data-parallel ranks -> 1 process, ZeRO-1) and
the resume's state files. A host-only step anywhere on that path fails here."""
import collections
import json

import pytest
import torch

from tests.distributed import spawn
from tests.launch import REFERENCE, demo_overrides


def on_meta(tensor):
    """A meta tensor standing for `tensor` (a parameter keeps its class, requires_grad and attributes, such as
    DeepSpeed's _hp_mapping)."""
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
        meta.__dict__.update(tensor.__dict__)
    return meta


def move_to_meta(engine, state):
    """The stage's parameters, the optimizer's master weights (ZeRO's partitions or the parameters) and moments on
    the meta device, every holder of them (modules, ZeRO's partition list, the optimizer's groups and state)
    pointing at the meta tensors: DeepSpeed keeps weak references to some, so they are replaced, not swapped."""
    moved = {}

    def meta_of(tensor):
        if id(tensor) not in moved:
            moved[id(tensor)] = on_meta(tensor)
        return moved[id(tensor)]

    for module in engine.module.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = meta_of(param)
    if state.zero:
        partitions = engine.optimizer.single_partition_of_fp32_groups
        partitions[:] = [meta_of(p) for p in partitions]
    optimizer = state.optimizer
    for group in optimizer.param_groups:
        group["params"] = [meta_of(p) for p in group["params"]]
    optimizer.state = collections.defaultdict(dict, {
        meta_of(holder): {k: meta_of(v) if torch.is_tensor(v) and v.dim() else v for k, v in values.items()}
        for holder, values in optimizer.state.items()})


def resume_on_meta(rank, overrides, result_path):
    from tests.helpers import compose_config
    from training import loop
    from checkpoints.optimizer_state import MasterState

    build_engine = loop.build_engine

    def build_engine_on_meta(spec, total_steps, **kwargs):
        engine, monitors = build_engine(spec, total_steps, **kwargs)
        move_to_meta(engine, MasterState(engine))  # the optimizer's state exists, as after a step
        return engine, monitors

    def record_instead_of_training(engine, spec, *args):
        state = MasterState(engine)
        moments = [v for holder in state.holders() for v in state.optimizer.state[holder].values()
                   if torch.is_tensor(v) and v.dim()]
        devices = {str(t.device) for t in [*engine.module.parameters(), *state.holders(), *moments]}
        with open(result_path, "w") as f:
            json.dump({"devices": sorted(devices), "optimizer_step": state.step}, f)

    loop.build_engine, loop.train = build_engine_on_meta, record_instead_of_training
    loop.run(compose_config(overrides))


@pytest.mark.slow
def test_resume_loads_into_parameters_off_the_host(demo_model, reference_run, tmp_path):
    overrides = demo_overrides(demo_model, tmp_path / "run", **{
        **REFERENCE, "num_stages": 1, "gradient_accumulation_steps": 4, "zero_stage": 1,
        "resume": str(reference_run / "global_step4")})
    spawn(resume_on_meta, 1, overrides, str(tmp_path / "result.json"))
    result = json.load(open(tmp_path / "result.json"))
    assert result == {"devices": ["meta"], "optimizer_step": 4}
