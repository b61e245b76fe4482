"""The one door to DeepSpeed's internals: every DeepSpeed name the project uses that DeepSpeed's API documentation
does not cover goes through this module, and `check_deepspeed_internals` verifies them all at a run's start.

A leaf at the top level: it imports only DeepSpeed and the standard library, so models/, checkpoints/, planner/,
training/ and bench/ all import it without an upward arrow (inside any one of them, the others would reach up).

Used directly, as documented (deepspeed.readthedocs.io): deepspeed.initialize / init_distributed, deepspeed.pipe
(PipelineModule and its documented methods: topology(), ckpt_layer_path(_list); LayerSpec, TiedLayerSpec),
deepspeed.runtime.pipe.engine's PipelineEngine and its public methods, deepspeed.runtime.pipe.schedule (documented
as the way to extend pipeline parallelism: TrainSchedule, the instructions), deepspeed.checkpointing.checkpoint,
deepspeed.accelerator, deepspeed.ops.adam, deepspeed.utils.safe_*, the ds_to_universal converter. The public-named
attributes that describe the run and that the project only reads (the engine's stage_id, num_stages, micro_batches,
prev_stage / next_stage, grid and its rank and group getters, mpu, module, optimizer, lr_scheduler; the
PipelineModule's forward_funcs, tied_modules, num_stages, global_rank) are read where used: a rename there fails at
first use, naming the attribute.

Through this module, checked against DeepSpeed 0.19.8 (CHECKED_VERSION), with why:
- Names from modules the documentation does not cover (re-exported, resolved on first import: EXPORTED):
  TorchCheckpointEngine (its save and load): the checkpoint engine the trainer subclasses to load state files
  weights-only, and whose saves it hashes; LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address: the
  non-tensor types DeepSpeed's state files pickle, allowed for weights-only loading; PipeDataParallelTopology,
  PipeModelDataParallelTopology: the pipeline x data (x tensor) rank layout; partition_balanced, partition_uniform:
  DeepSpeed's own 'parameters', 'type:' and 'uniform' partitions; non_reentrant_checkpoint: activation
  checkpointing under LoRA; MEMORY_OPT_ALLREDUCE_SIZE: the flat-copy bucket of ZeRO-0's gradient all-reduce the
  memory plan counts; DeepSpeedZeroOptimizer: telling ZeRO's master weights from the parameters themselves;
  get_monitor_config, MonitorMaster (write_events): the run's metrics to TensorBoard, W&B, CSV, Comet.
- Engine state the trainer writes or replaces (a rename would fail silently: DeepSpeed would just stop reading it):
  DeepSpeedEngine.clip_fp32_gradients (one clipping norm over all stages), _global_grad_norm (the norm it reports),
  checkpoint_engine built from _config (weights-only loads), save_zero_checkpoint and _common_checkpoint_state (no
  per-rank optimizer copies: the state is saved per layer), global_steps / global_samples / skipped_steps (restored
  on resume); PipelineEngine.pipeline_enable_backward_allreduce (no all-reduce over a data-parallel group of one),
  is_data_parallel (bench/pipeline_efficiency.py's own-replica baseline), _INSTRUCTION_MAP (the zero-bubble
  instructions; profiling's timers); deepspeed.ops.__compatible_ops__ (no shared-memory op built on CPUs).
- The pipeline engine's instruction state the zero-bubble handlers share with DeepSpeed's: pipe_buffers,
  pipe_recv_buf and _recv_tensor_meta, first_output_send and _send_tensor_meta, grad_layer, _exec_backward_pass,
  dynamic_shape / has_bool_tensors / is_pipe_partitioned (paths it refuses), using_bf16_optimizer with
  BF16_Optimizer.clear_lp_grads / update_hp_grads (the bf16 optimizer's per-backward gradient hand-off);
  TrainSchedule._buffer_idx (a micro-batch's pipe buffer).
- PipelineModule internals: _grid (the tensor-parallel group), parts and _set_bounds (the partition), _local_start
  (a stage's first layer index), _layer_specs (where a tied layer first appears), _synchronize_tied_weights.
- ZeRO's fragment bookkeeping, for the per-layer optimizer state: DeepSpeedZeroOptimizer.single_partition_of_fp32_groups
  and .optimizer, BF16_Optimizer.fp32_groups_flat_partition and .optimizer (bf16 with fp32 gradient accumulation:
  ZeRO-1's partitions in another class), param._hp_mapping (param_group_index, hp_fragment_address, lp_fragment_address); the fp16 loss
  scaler (optimizer.loss_scaler: cur_scale, cur_iter, last_overflow_iter, cur_hysteresis), restored on resume.
  Why not DeepSpeed's public safe_get_full_* / safe_set_full_*: checkpoints/optimizer_state.py's docstring.
- The launcher's per-node module name (LAUNCHER_MODULE): preemption recognises the launcher as its parent process.
- Subclass overrides, checked for their parameters: PipelineEngine._train_schedule, _exec_send_activations,
  _exec_send_grads, _exec_recv_grads, _exec_reduce_tied_grads (training/pipeline_engine.py);
  PipelineModule._partition_layers, load_state_dir (models/pipeline.py); TorchCheckpointEngine.load
  (checkpoints/state_files.py). ZeroBubbleSchedule overrides PipeSchedule's documented steps(): no entry.

The start-up check reads the source of the class that sets an instance attribute (`self.<name>` must appear in it)
instead of building an engine: an engine exists only after the process groups, the model and the optimizer do, and a
run must fail before any of that, on every rank alike. It checks that each name is there with its parameters, not
what it does: the tests do (docs/architecture.md#the-door-to-deepspeed lists them).
"""
import dataclasses
import importlib
import inspect
import re
from typing import NamedTuple

import deepspeed

CHECKED_VERSION = "0.19.8"
ADVICE = (f"install deepspeed=={CHECKED_VERSION} (requirements.txt) or see deepspeed_internals.py for what to "
          f"check")
LAUNCHER_MODULE = "deepspeed.launcher.launch"
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
PIPELINE_ENGINE = "deepspeed.runtime.pipe.engine:PipelineEngine"
PIPELINE_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
ZERO_OPTIMIZER = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
BF16_OPTIMIZER = "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"
TORCH_CHECKPOINT_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine"


class DeepSpeedMismatch(ImportError):
    """The installed DeepSpeed lacks an internal the project uses, or has it with other parameters."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """One DeepSpeed internal: `path` is 'module:qualified.name' (or a module); `use` says why the project needs
    it; `parameters`: the names its signature must have; `mentions`: a name its source must contain."""
    path: str
    use: str
    parameters: tuple = None
    mentions: str = None

    @property
    def dotted(self):
        return self.path.replace(":", ".")

    def resolve(self):
        module_name, _, qualname = self.path.partition(":")
        try:
            found = importlib.import_module(module_name)
            for name in qualname.split(".") if qualname else ():
                found = getattr(found, name)
        except (ImportError, AttributeError):
            raise self.mismatch(f"lacks {self.dotted}{self.signature(self.parameters)}") from None
        return found

    def check(self, sources):
        found = self.resolve()
        if self.parameters is not None:
            parameters = tuple(inspect.signature(found).parameters)
            if parameters != self.parameters:
                raise self.mismatch(f"has {self.dotted}{self.signature(parameters)}, not "
                                    f"{self.signature(self.parameters)}")
        if self.mentions is not None:
            if self.path not in sources:
                try:
                    sources[self.path] = inspect.getsource(found)
                except (OSError, TypeError):  # no source to read (a bytecode-only install): reported as missing
                    sources[self.path] = ""
            whole_name = r"(?!\w)" if self.mentions[-1].isidentifier() else ""  # self.grad_layer, not ..._layers
            if not re.search(re.escape(self.mentions) + whole_name, sources[self.path]):
                raise self.mismatch(f"lacks {self.mentions} in {self.dotted}")

    def mismatch(self, what):
        return DeepSpeedMismatch(f"deepspeed {deepspeed.__version__} {what}, {self.use}; {ADVICE}")

    @staticmethod
    def signature(parameters):
        return "" if parameters is None else f"({', '.join(parameters)})"


# Names other modules import from here, resolved on first import (module __getattr__ below): this module itself
# always imports, so a DeepSpeed without one of them fails with the check's one line, not a traceback.
EXPORTED = {
    "TorchCheckpointEngine": Internal(TORCH_CHECKPOINT_ENGINE, "which checkpoints/state_files.py subclasses to "
                                      "load state files weights-only", ("config_params",)),
    "LossScaler": Internal("deepspeed.runtime.fp16.loss_scaler:LossScaler",
                           "which fp16 state files pickle (allowed for weights-only loading)"),
    "DynamicLossScaler": Internal("deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
                                  "which fp16 state files pickle (allowed for weights-only loading)"),
    "ZeroStageEnum": Internal("deepspeed.runtime.zero.config:ZeroStageEnum",
                              "which state files pickle (allowed for weights-only loading)"),
    "fragment_address": Internal("deepspeed.utils.tensor_fragment:fragment_address", "which ZeRO state files pickle "
                                 "and the per-layer optimizer state reads", ("numel", "start")),
    "PipeDataParallelTopology": Internal("deepspeed.runtime.pipe.topology:PipeDataParallelTopology",
                                         "the pipeline x data rank layout", ("num_pp", "num_dp")),
    "PipeModelDataParallelTopology": Internal("deepspeed.runtime.pipe.topology:PipeModelDataParallelTopology",
                                              "the pipeline x tensor x data rank layout",
                                              ("num_pp", "num_mp", "num_dp")),
    "partition_balanced": Internal("deepspeed.runtime.utils:partition_balanced",
                                   "the 'parameters' and 'type:' partitions", ("weights", "num_parts")),
    "partition_uniform": Internal("deepspeed.runtime.utils:partition_uniform", "the 'uniform' partition",
                                  ("num_items", "num_parts")),
    "non_reentrant_checkpoint": Internal("deepspeed.runtime.activation_checkpointing.checkpointing:"
                                         "non_reentrant_checkpoint", "activation checkpointing under LoRA",
                                         ("function", "args")),
    "MEMORY_OPT_ALLREDUCE_SIZE": Internal("deepspeed.runtime.engine:MEMORY_OPT_ALLREDUCE_SIZE",
                                          "the gradient all-reduce bucket the memory plan counts"),
    "DeepSpeedZeroOptimizer": Internal(ZERO_OPTIMIZER, "whose master weights the per-layer optimizer state reads"),
    "BF16_Optimizer": Internal(BF16_OPTIMIZER, "whose master weights the per-layer optimizer state reads (bf16 with "
                                               "fp32 gradient accumulation)"),
    "get_monitor_config": Internal("deepspeed.monitor.config:get_monitor_config",
                                   "which reads the config's monitors (tensorboard, wandb, csv, comet)",
                                   ("param_dict",)),
    "MonitorMaster": Internal("deepspeed.monitor.monitor:MonitorMaster", "which writes the run's metrics to them",
                              ("monitor_config",)),
}


def __getattr__(name):
    if name not in EXPORTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = EXPORTED[name].resolve()
    return value


def zero_bubble(name, parameters):
    return Internal(f"{PIPELINE_ENGINE}.{name}", "which the zero-bubble engine overrides", parameters)


def self_use(owner, text, use):
    """`owner`'s source must contain self.<text> (an attribute it sets or reads, a method it calls)."""
    return Internal(owner, use, mentions=f"self.{text}")


INTERNALS = (
    *EXPORTED.values(),
    Internal(f"{TORCH_CHECKPOINT_ENGINE}.save", "whose saves checkpoints/saving.py hashes as written",
             ("self", "state_dict", "path")),
    Internal(f"{TORCH_CHECKPOINT_ENGINE}.load", "which the weights-only checkpoint engine overrides",
             ("self", "path", "map_location")),
    Internal("deepspeed.monitor.monitor:MonitorMaster.write_events", "which writes the run's metrics to monitors",
             ("self", "event_list")),
    # The trainer's engine set-up (training/loop.py).
    self_use(ENGINE, "clip_fp32_gradients()", "which the trainer replaces to clip by one norm over all stages"),
    self_use(ENGINE, "_global_grad_norm", "which the trainer's clipping sets"),
    self_use(ENGINE, "checkpoint_engine", "which the trainer replaces with a weights-only one"),
    self_use(ENGINE, "_config", "which the trainer's checkpoint engine is built from"),
    self_use(ENGINE, "save_zero_checkpoint", "which the trainer turns off (optimizer state saved per layer)"),
    self_use(ENGINE, "_common_checkpoint_state(", "which the trainer wraps to leave the optimizer out"),
    Internal(f"{ENGINE}._common_checkpoint_state", "which the trainer wraps to leave the optimizer out",
             ("self", "module_state_dict", "zero_optimizer_state", "save_frozen_param")),
    *(self_use(ENGINE, counter, "which a resume restores") for counter in ENGINE_COUNTERS),
    self_use(PIPELINE_ENGINE, "pipeline_enable_backward_allreduce",
             "which the trainer turns off for a data-parallel group of one"),
    self_use(PIPELINE_ENGINE, "is_data_parallel", "which bench/pipeline_efficiency.py turns off"),
    Internal("deepspeed.comm.torch:build_shm_op", "which the trainer turns off on CPUs",
             mentions="deepspeed.ops.__compatible_ops__"),
    Internal("deepspeed.ops.op_builder.cpu.comm:ShareMemCommBuilder", "which the trainer turns off on CPUs",
             mentions='NAME = "deepspeed_shm_comm"'),
    Internal("deepspeed.launcher.runner", "which preemption recognises as its parent process",
             mentions=f'"{LAUNCHER_MODULE}"'),
    # The zero-bubble engine (training/pipeline_engine.py) and profiling.
    Internal(f"{PIPELINE_ENGINE}._INSTRUCTION_MAP", "which the zero-bubble engine extends and profiling wraps"),
    self_use(PIPELINE_ENGINE, "_INSTRUCTION_MAP[", "which the zero-bubble engine extends and profiling wraps"),
    zero_bubble("_train_schedule", ("self",)),
    self_use(PIPELINE_ENGINE, "_train_schedule()", "which the zero-bubble engine overrides"),
    zero_bubble("_exec_send_activations", ("self", "buffer_id")),
    zero_bubble("_exec_send_grads", ("self", "buffer_id")),
    zero_bubble("_exec_recv_grads", ("self", "buffer_id")),
    zero_bubble("_exec_reduce_tied_grads", ("self",)),
    Internal(f"{PIPELINE_ENGINE}._exec_backward_pass", "which the zero-bubble B runs", ("self", "buffer_id")),
    Internal(f"{PIPELINE_ENGINE}._send_tensor_meta", "which the zero-bubble sends use",
             ("self", "buffer", "recv_stage")),
    Internal(f"{PIPELINE_ENGINE}._recv_tensor_meta", "which the zero-bubble receives use", ("self", "send_stage")),
    *(self_use(PIPELINE_ENGINE, name, "which the zero-bubble handlers share with DeepSpeed's")
      for name in ("pipe_buffers", "pipe_recv_buf", "first_output_send", "grad_layer", "using_bf16_optimizer",
                   "dynamic_shape", "has_bool_tensors", "is_pipe_partitioned")),
    Internal(f"{BF16_OPTIMIZER}.clear_lp_grads", "which the zero-bubble W calls", ("self", "set_to_none")),
    Internal(f"{BF16_OPTIMIZER}.update_hp_grads", "which the zero-bubble W calls", ("self", "clear_lp_grads")),
    Internal("deepspeed.runtime.pipe.schedule:TrainSchedule._buffer_idx", "which the zero-bubble schedule calls",
             ("self", "micro_batch_id")),
    # The pipeline module (models/pipeline.py) and the per-layer optimizer state (checkpoints/optimizer_state.py).
    Internal(f"{PIPELINE_MODULE}._partition_layers", "which the project's pipeline overrides", ("self", "method")),
    self_use(PIPELINE_MODULE, "_partition_layers(", "which the project's pipeline overrides"),
    Internal(f"{PIPELINE_MODULE}.load_state_dir", "which the project's pipeline overrides",
             ("self", "load_dir", "checkpoint_engine", "strict")),
    Internal(PIPELINE_ENGINE, "which the project's pipeline overrides", mentions="self.module.load_state_dir("),
    Internal(f"{PIPELINE_MODULE}._set_bounds", "which the project's pipeline calls", ("self", "start", "stop")),
    Internal(f"{PIPELINE_MODULE}._synchronize_tied_weights", "which the project's pipeline calls", ("self",)),
    *(self_use(PIPELINE_MODULE, name, "which the project's pipeline uses")
      for name in ("_grid", "parts", "_local_start", "_layer_specs")),
    *(self_use(ZERO_OPTIMIZER, name, "which the per-layer optimizer state reads")
      for name in ("single_partition_of_fp32_groups", "optimizer", "loss_scaler")),
    *(self_use(BF16_OPTIMIZER, name, "which the per-layer optimizer state reads")
      for name in ("fp32_groups_flat_partition", "optimizer")),
    Internal("deepspeed.utils.mixed_precision_linkage:link_hp_params", "which the per-layer optimizer state reads",
             mentions="lp_param._hp_mapping"),
    *(Internal("deepspeed.utils.tensor_fragment:tensor_fragment", "which the per-layer optimizer state reads",
               mentions=field) for field in ("param_group_index", "hp_fragment_address", "lp_fragment_address")),
    *(self_use("deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler", field, "which a resume restores")
      for field in LOSS_SCALER_FIELDS),
)


def check_deepspeed_internals():
    """Raise DeepSpeedMismatch (one line: the installed version, the missing piece, what to do) unless every
    internal above is in the installed DeepSpeed with its parameters. Checks them all, whatever the config: one
    DeepSpeed either runs every configuration the tests cover or is not the one they ran."""
    sources = {}
    for internal in INTERNALS:
        internal.check(sources)


# The training engine (DeepSpeedEngine and PipelineEngine).

def replace_fp32_gradient_clipping(engine, clip):
    """clip() runs where DeepSpeed clips fp32 gradients (without ZeRO, fp16 or bf16)."""
    engine.clip_fp32_gradients = clip


def set_global_grad_norm(engine, norm):
    """The norm engine.get_global_grad_norm() reports."""
    engine._global_grad_norm = norm


def replace_checkpoint_engine(engine, checkpoint_engine_class):
    engine.checkpoint_engine = checkpoint_engine_class(engine._config)


def checkpoint_engine_of(engine):
    """The engine's checkpoint engine: what writes and reads its files (save(state, path), load(path))."""
    return engine.checkpoint_engine


def skip_optimizer_files(engine):
    """DeepSpeed's checkpoints hold no optimizer state of their own: no ZeRO *_optim_states.pt, and none in
    mp_rank_*_model_states.pt."""
    engine.save_zero_checkpoint = False
    common_checkpoint_state = engine._common_checkpoint_state
    engine._common_checkpoint_state = lambda *args: {**common_checkpoint_state(*args), "optimizer": None}


def skip_gradient_allreduce(engine):
    """The pipeline engine's gradient all-reduce over the data-parallel group is not run."""
    engine.pipeline_enable_backward_allreduce = False


def skip_data_parallel_reductions(engine):
    """Neither gradients nor the loss are all-reduced over the data-parallel group: each process steps its own copy."""
    skip_gradient_allreduce(engine)
    engine.is_data_parallel = False


def engine_counters(engine):
    return {counter: getattr(engine, counter) for counter in ENGINE_COUNTERS}


def restore_engine_counters(engine, counters):
    for counter, value in counters.items():
        setattr(engine, counter, value)


def fp16_loss_scaler(engine):
    return getattr(engine.optimizer, "loss_scaler", None) if engine.fp16_enabled() else None


def loss_scaler_state(engine):
    """fp16's loss scaler fields ({} for a static scaler's missing ones), or None without fp16."""
    scaler = fp16_loss_scaler(engine)
    if scaler is None:
        return None
    return {field: getattr(scaler, field) for field in LOSS_SCALER_FIELDS if hasattr(scaler, field)}


def restore_loss_scaler_state(engine, state):
    scaler = fp16_loss_scaler(engine)
    for field, value in (state or {}).items():
        if scaler is not None:
            setattr(scaler, field, value)


def skip_shm_comm_build():
    """DeepSpeed's distributed init does not JIT-build its shared-memory op (gloo does the CPU collectives)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# The pipeline engine's instructions and their state.

def instruction_handlers(engine):
    """{instruction class: handler(engine, ...)} the engine runs its schedule with."""
    return engine._INSTRUCTION_MAP


def replace_instruction_handlers(engine, handlers):
    """For this engine only: an instance attribute shadows the class's map."""
    engine._INSTRUCTION_MAP = handlers


def add_instruction_handlers(engine_class, handlers):
    """A PipelineEngine subclass runs `handlers` ({instruction class: function}) besides its base's."""
    engine_class._INSTRUCTION_MAP = {**engine_class._INSTRUCTION_MAP, **handlers}


def run_backward_pass(engine, buffer_id):
    """DeepSpeed's BackwardPass of a buffer's micro-batch."""
    engine._exec_backward_pass(buffer_id)


def send_activation_shapes_once(engine, outputs):
    """Before the first activation send, the shapes, blocking: the next stage's first receive reads them."""
    if engine.first_output_send:
        engine.first_output_send = False
        engine._send_tensor_meta(outputs, engine.next_stage)


def receive_activation_shapes_once(engine):
    """Before the first activation receive, the shapes, blocking (the previous stage sends them first): DeepSpeed
    allocates its activation buffer from them."""
    if engine.pipe_recv_buf is None:
        engine.pipe_recv_buf = engine._recv_tensor_meta(engine.prev_stage)


def activation_buffer(engine):
    """The activation buffer DeepSpeed allocated from the received shapes: a tensor or a tuple of them."""
    return engine.pipe_recv_buf


def pipe_buffer(engine, kind, buffer_id):
    """A micro-batch's 'inputs' or 'outputs' in the engine's pipe buffers."""
    return engine.pipe_buffers[kind][buffer_id]


def set_pipe_buffer(engine, kind, buffer_id, value):
    engine.pipe_buffers[kind][buffer_id] = value


def set_received_gradients(engine, grads):
    """The output gradients DeepSpeed's BackwardPass starts from."""
    engine.grad_layer = grads


def sends_need_deepspeed_handlers(engine):
    """Whether the engine's sends take its dynamic-shape, bool-tensor or partitioned paths."""
    return engine.dynamic_shape or engine.has_bool_tensors or engine.is_pipe_partitioned


def uses_bf16_optimizer(engine):
    return engine.using_bf16_optimizer


def clear_bf16_optimizer_grads(optimizer):
    """The bf16 optimizer clears the parameters' .grad (already added into its fp32 gradients)."""
    optimizer.clear_lp_grads()


def add_grads_to_bf16_optimizer(optimizer):
    """The bf16 optimizer adds the parameters' .grad into its fp32 gradients."""
    optimizer.update_hp_grads()


def buffer_of_micro_batch(schedule, micro_batch):
    """The pipe buffer a TrainSchedule gives a micro-batch."""
    return schedule._buffer_idx(micro_batch)


# The pipeline module.

def pipeline_grid(module):
    """The PipelineModule's process grid (groups and ranks), made before its layers are built."""
    return module._grid


def set_partition(module, bounds, stage):
    """The PipelineModule's partition, as its _partition_layers leaves it: every stage's first layer and the layer
    count (parts), and this stage's layers."""
    module.parts = bounds
    module._set_bounds(start=bounds[stage], stop=bounds[stage + 1])


def stage_first_layer(module):
    """The pipeline index of the stage's first layer."""
    return module._local_start


def layer_specs(module):
    """All pipeline layers' specs, in index order."""
    return module._layer_specs


def synchronize_tied_weights(module):
    """Tied layers take the first stage's copy of their weights."""
    module._synchronize_tied_weights()


# ZeRO's master weights.

class ZeroFragment(NamedTuple):
    """The piece of a parameter that one rank's ZeRO partition holds."""
    partition: int  # index of the flat fp32 partition (one per parameter group)
    partition_start: int
    numel: int
    param_start: int  # offset in the flattened parameter


def is_zero_optimizer(optimizer):
    """ZeRO's optimizer, or the bf16 optimizer DeepSpeed picks for fp32 gradient accumulation (ZeRO-1's partitions,
    the same fragment bookkeeping)."""
    return isinstance(optimizer, (EXPORTED["DeepSpeedZeroOptimizer"].resolve(), EXPORTED["BF16_Optimizer"].resolve()))


def zero_wrapped_optimizer(optimizer):
    """The torch optimizer ZeRO steps its flat partitions with."""
    return optimizer.optimizer


def zero_fp32_partitions(optimizer):
    """This rank's flat fp32 master-weight partitions, one per parameter group."""
    if isinstance(optimizer, EXPORTED["BF16_Optimizer"].resolve()):
        return optimizer.fp32_groups_flat_partition
    return optimizer.single_partition_of_fp32_groups


def zero_fragment(param):
    """The ZeroFragment of `param` in this rank's partition, or None when the partition holds none of it."""
    mapping = param._hp_mapping
    if mapping is None:
        return None
    return ZeroFragment(mapping.param_group_index, mapping.hp_fragment_address.start,
                        mapping.hp_fragment_address.numel, mapping.lp_fragment_address.start)
