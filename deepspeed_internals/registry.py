"""What of DeepSpeed's non-public surface the project uses (INTERNALS, EXPORTED), why, and the start-up check of
it (check_deepspeed_internals). The list, with the reasons, is the package's docstring (__init__.py)."""
import dataclasses
import importlib
import inspect
import re

import deepspeed

from deepspeed_internals import LAUNCHER_MODULE

CHECKED_VERSION = "0.19.8"
ADVICE = (f"install deepspeed=={CHECKED_VERSION} (requirements.txt) or see deepspeed_internals/ for what to "
          f"check")
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
PIPELINE_ENGINE = "deepspeed.runtime.pipe.engine:PipelineEngine"
PIPELINE_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
ZERO_OPTIMIZER = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
CPU_ADAM = "deepspeed.ops.adam.cpu_adam:DeepSpeedCPUAdam"
BF16_OPTIMIZER = "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"
TORCH_CHECKPOINT_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine"


# The source text the check has read, keyed by the object read (a class, module or function, not its path: a path may
# name a replacement). Reading it is most of the check's cost (~1 s); kept for the process, so a rank forked from a
# process that ran the check (tests/zygote_imports.py) reads nothing: a class's source is fixed once it is loaded.
SOURCES = {}


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
            whole_name = r"(?!\w)" if self.mentions[-1].isidentifier() else ""  # self.grad_layer, not ..._layers
            if not re.search(re.escape(self.mentions) + whole_name, source_of(found, sources)):
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
    "WandbMonitor": Internal("deepspeed.monitor.wandb:WandbMonitor", "which writes them to W&B (a resumed run's "
                             "steps past those it logged)", ("wandb_config",)),
    "deepspeed_groups": Internal("deepspeed.utils.groups", "whose expert groups expert parallelism registers"),
    "MoE": Internal("deepspeed.moe.layer:MoE", "whose presence switches the engine's expert support on (expert "
                    "parallelism adds a stand-in)"),
    "is_model_parallel_parameter": Internal("deepspeed.runtime.utils:is_model_parallel_parameter",
                                            "which tells a tensor-parallel split weight in the clipping norm",
                                            ("p",)),
    "pipe_p2p": Internal("deepspeed.runtime.pipe.p2p", "whose send and recv the pipeline engine's handlers call "
                         "(tests/test_p2p_order.py records them)"),
}


def __getattr__(name):
    if name not in EXPORTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = EXPORTED[name].resolve()
    return value


def zero_bubble(name, parameters):
    return Internal(f"{PIPELINE_ENGINE}.{name}", "which the zero-bubble engine overrides", parameters)


@dataclasses.dataclass(frozen=True)
class Unused:
    """A name the project adds to a DeepSpeed class or its instances: no class of its DeepSpeed lineage may have
    it, as an attribute or as self.<name> in its source, or one of the two would silently overwrite the other."""
    path: str
    name: str
    use: str

    def check(self, sources):
        owner = Internal(self.path, self.use).resolve()
        for cls in (c for c in owner.__mro__ if c.__module__.startswith("deepspeed")):
            uses = re.search(rf"self\.{re.escape(self.name)}(?!\w)", source_of(cls, sources))
            if self.name in vars(cls) or uses:
                raise DeepSpeedMismatch(f"deepspeed {deepspeed.__version__} has {self.name} in "
                                        f"{cls.__module__}.{cls.__qualname__}, a name {self.use}; {ADVICE}")


def source_of(found, sources):
    if found not in sources:
        try:
            sources[found] = inspect.getsource(found)
        except (OSError, TypeError):  # no source to read (a bytecode-only install): reported as missing
            sources[found] = ""
    return sources[found]


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
    Internal("deepspeed.monitor.monitor:MonitorMaster", "whose CSV monitor a resume's replay rewrites",
             mentions="self.csv_monitor = csvMonitor("),
    Internal("deepspeed.monitor.csv_monitor:csvMonitor", "whose files a replay rewrites, named in filenames (it "
             "writes a header into a file not named there)", mentions="if filename not in self.filenames:"),
    # The trainer's engine set-up (training/loop.py).
    self_use(CPU_ADAM, "ds_opt_adam.adam_update(self.opt_id, state['step'], group['lr'], beta1, beta2",
             "whose C++ step bookkeeping a resume with offload replays"),
    self_use(ENGINE, "clip_fp32_gradients()", "which the trainer replaces to clip by one norm over all stages"),
    self_use(ENGINE, "_global_grad_norm", "which the trainer's clipping sets"),
    Internal(f"{ENGINE}._cast_module_mixed_precision", "which casts every parameter to the training dtype: the "
             "trainer keeps the ones transformers keeps in fp32 (DeepSeek-V3's router) out of it",
             ("self", "param_dtype", "buffer_dtype", "is_zero_init_model", "keep_pattern")),
    self_use(ENGINE, "_cast_module_mixed_precision(", "which the trainer keeps DeepSeek-V3's router out of"),
    self_use(ENGINE, "checkpoint_engine", "which the trainer replaces with a weights-only one"),
    self_use(ENGINE, "_config", "which the trainer's checkpoint engine is built from"),
    self_use(ENGINE, "save_zero_checkpoint", "which the trainer turns off (optimizer state saved per layer)"),
    self_use(ENGINE, "_common_checkpoint_state(", "which the trainer wraps to leave the optimizer out"),
    Internal(f"{ENGINE}._common_checkpoint_state", "which the trainer wraps to leave the optimizer out",
             ("self", "module_state_dict", "zero_optimizer_state", "save_frozen_param")),
    *(self_use(ENGINE, counter, "which a resume restores") for counter in ENGINE_COUNTERS),
    *(Unused(PIPELINE_ENGINE, name, "which the zero-bubble engine adds") for name in (
        "_exec_backward_input_pass", "_exec_backward_weight_pass", "_exec_post_recv_activations",
        "_exec_wait_recv_activations", "_send_async", "_sends", "_posted_receives", "zero_bubble_max_waiting")),
    self_use(PIPELINE_ENGINE, "pipeline_enable_backward_allreduce",
             "which the trainer turns off for a data-parallel group of one"),
    self_use(PIPELINE_ENGINE, "is_data_parallel", "which bench/pipeline_efficiency.py turns off"),
    self_use(PIPELINE_ENGINE, "total_loss", "which eval_batch adds each output to and only train_batch clears: "
             "cleared before a pass whose outputs are per row (evaluation/eval_set.py score_examples)"),
    Internal("deepspeed.comm.torch:build_shm_op", "which the trainer turns off on CPUs",
             mentions="deepspeed.ops.__compatible_ops__"),
    Internal("deepspeed.ops.op_builder.cpu.comm:ShareMemCommBuilder", "which the trainer turns off on CPUs",
             mentions='NAME = "deepspeed_shm_comm"'),
    *(Internal(path, "which asks py-cpuinfo at each call, a Python interpreter each: asked once per process "
                     "(access.ask_cpuinfo_once)", mentions="from cpuinfo import get_cpu_info")
      for path in ("deepspeed.ops.adam.cpu_adam:DeepSpeedCPUAdam.__init__",
                   "deepspeed.ops.op_builder.builder:OpBuilder.cpu_arch",
                   "deepspeed.ops.op_builder.builder:OpBuilder.simd_width")),
    Internal("deepspeed.launcher.runner", "which preemption recognises as its parent process",
             mentions=f'"{LAUNCHER_MODULE}"'),
    Internal(f"{LAUNCHER_MODULE}:main", "whose SIGTERM handler (ending the ranks) the supervisor runs at a failure",
             mentions="signal.signal(signal.SIGTERM, sigkill_handler)"),
    # The zero-bubble engine (engines/pipeline_engine.py) and profiling.
    Internal(f"{PIPELINE_ENGINE}._INSTRUCTION_MAP", "which the zero-bubble engine extends and profiling wraps"),
    self_use(PIPELINE_ENGINE, "_INSTRUCTION_MAP[", "which the zero-bubble engine extends and profiling wraps"),
    zero_bubble("_train_schedule", ("self",)),
    self_use(PIPELINE_ENGINE, "_train_schedule()", "which the zero-bubble engine overrides"),
    zero_bubble("_exec_send_activations", ("self", "buffer_id")),
    zero_bubble("_exec_send_grads", ("self", "buffer_id")),
    zero_bubble("_exec_recv_grads", ("self", "buffer_id")),
    zero_bubble("_exec_reduce_tied_grads", ("self",)),
    Internal(f"{PIPELINE_ENGINE}._exec_backward_pass", "which the zero-bubble B runs and every schedule's engine "
             "overrides (one pass from all of a stage's outputs)", ("self", "buffer_id")),
    Internal(f"{PIPELINE_ENGINE}._send_tensor_meta", "which the zero-bubble sends use",
             ("self", "buffer", "recv_stage")),
    Internal(f"{PIPELINE_ENGINE}._recv_tensor_meta", "which the zero-bubble receives use", ("self", "send_stage")),
    # The chunked engine (engines/chunked_engine.py).
    *(Unused(PIPELINE_ENGINE, name, "which the chunked engine adds") for name in (
        "_exec_chunk_forward_pass", "_exec_chunk_backward_pass", "_received_shapes", "_exec_post_transfer",
        "_exec_wait_transfer", "_runs_or_holds", "_buffer", "_run_chunk", "_give", "pipeline_schedule", "local_chunks",
        "chunk_owner", "last_chunk", "chunk_program", "running_chunk", "_shapes_sent", "_input_shapes", "_arrived",
        "_made", "_posted", "_losses", "chunk_ids", "_buffers_per_chunk")),
    *(Internal(f"{PIPELINE_ENGINE}.{name}", "which the chunked engine overrides (a chunk's first and last stage)",
               ("self",)) for name in ("is_first_stage", "is_last_stage", "_loss_stage_global_rank")),
    self_use(PIPELINE_ENGINE, "_loss_stage_global_rank()", "which the chunked engine overrides"),
    # A sequence length that changes between steps (engines/sequence_length.py).
    *(Internal(f"{PIPELINE_ENGINE}.reset_activation_shape", "which a change of sequence length calls (the chunked "
               "engine extends it) to send the shapes between stages again", ("self",), mentions=name)
      for name in ("self.first_output_send = True", "self.pipe_recv_buf = None", "self.grad_layer = None")),
    Unused(PIPELINE_ENGINE, "sequence_length", "which engines/sequence_length.py adds"),
    self_use(PIPELINE_ENGINE, "_inference_schedule(", "which the chunked engine overrides (evaluation)"),
    *(Internal(f"{PIPELINE_ENGINE}.{name}", "which the chunked engine runs for each chunk", ("self", "buffer_id"))
      for name in ("_exec_forward_pass", "_exec_load_micro_batch")),
    # The point-to-point test's engines (tests/test_p2p_order.py): DeepSpeed's handlers, driven by its own loop.
    Internal(f"{PIPELINE_ENGINE}._exec_schedule", "which the point-to-point test runs schedules with",
             ("self", "pipe_schedule")),
    Internal(f"{PIPELINE_ENGINE}._inference_schedule", "which the point-to-point test evaluates with",
             ("self", "micro_batches")),
    Internal("deepspeed.runtime.pipe.p2p:send", "which the point-to-point test records",
             ("tensor", "dest_stage", "async_op")),
    Internal("deepspeed.runtime.pipe.p2p:recv", "which the point-to-point test records",
             ("tensor", "src_stage", "async_op")),
    *(Internal(PIPELINE_ENGINE, "through which the point-to-point test records the handlers' transfers",
               mentions=call) for call in ("p2p.send(", "p2p.recv(")),
    *(self_use(PIPELINE_ENGINE, name, "which the point-to-point test's engines set")
      for name in ("num_pipe_buffers", "has_attention_mask", "is_grad_partitioned")),
    *(self_use(PIPELINE_ENGINE, name, "which the zero-bubble handlers share with DeepSpeed's")
      for name in ("pipe_buffers", "pipe_recv_buf", "first_output_send", "grad_layer", "using_bf16_optimizer",
                   "dynamic_shape", "has_bool_tensors", "is_pipe_partitioned")),
    Internal(f"{BF16_OPTIMIZER}.clear_lp_grads", "which the zero-bubble W calls", ("self", "set_to_none")),
    Internal(f"{BF16_OPTIMIZER}.update_hp_grads", "which the zero-bubble W calls", ("self", "clear_lp_grads")),
    # Where a step's accumulated gradient is, for the tensor-parallel sums left to the step (engines/pipeline_engine.py)
    Internal(BF16_OPTIMIZER, "whose fp32 gradient sums the tensor-parallel sums at the step read",
             mentions="lp._hp_grad = hp_grad"),
    Internal(f"{ZERO_OPTIMIZER}.get_param_gradient_attribute", "where ZeRO-1 accumulates a gradient (.grad, or its "
             "grad_accum in another dtype), which the tensor-parallel sums at the step read", ("self", "param")),
    Internal("deepspeed.runtime.pipe.schedule:TrainSchedule._buffer_idx", "which the zero-bubble schedule calls",
             ("self", "micro_batch_id")),
    # The pipeline module (models/pipeline.py) and the per-layer optimizer state (checkpoints/optimizer_state.py).
    Internal(f"{PIPELINE_MODULE}._partition_layers", "which the project's pipeline overrides", ("self", "method")),
    self_use(PIPELINE_MODULE, "_partition_layers(", "which the project's pipeline overrides"),
    Internal(f"{PIPELINE_MODULE}.load_state_dir", "which the project's pipeline overrides",
             ("self", "load_dir", "checkpoint_engine", "strict")),
    Internal(PIPELINE_ENGINE, "which the project's pipeline overrides", mentions="self.module.load_state_dir("),
    Internal(f"{PIPELINE_MODULE}.save_state_dict", "which the project's pipeline overrides (its experts' shards)",
             ("self", "save_dir", "checkpoint_engine", "exclude_frozen_params")),
    Internal(PIPELINE_ENGINE, "which the project's pipeline overrides", mentions="self.module.save_state_dict("),
    Internal(f"{PIPELINE_MODULE}._set_bounds", "which the project's pipeline calls", ("self", "start", "stop")),
    Internal(f"{PIPELINE_MODULE}._build", "which the project's pipeline runs once per chunk", ("self",)),
    self_use(PIPELINE_MODULE, "_build()", "which the project's pipeline runs once per chunk"),
    Internal(f"{PIPELINE_MODULE}.stage_owner", "which the project's pipeline overrides (chunks)",
             ("self", "layer_idx")),
    self_use(PIPELINE_MODULE, "stage_owner(", "which the project's pipeline overrides (chunks)"),
    Internal(f"{PIPELINE_MODULE}._index_tied_modules", "which the project's pipeline narrows to tied weights on "
             "several ranks", ("self",)),
    self_use(PIPELINE_MODULE, "tied_comms = self._index_tied_modules()", "which the project's pipeline narrows"),
    *(Internal(f"{PIPELINE_MODULE}.{name}", "which the project's pipeline overrides (chunks)",
               ("self", "ckpt_dir", "local_layer_idx")) for name in ("ckpt_layer_path", "ckpt_layer_path_list")),
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
    # Expert parallelism (models/expert_parallel.py, deepspeed_internals.access.use_deepspeed_expert_groups).
    *(Internal("deepspeed.utils.groups", "which expert parallelism fills with its groups", mentions=f"{name} = {{}}")
      for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                   "_EXPERT_DATA_PARALLEL_GROUP_RANKS")),
    Internal(f"{ENGINE}._configure_distributed_model", "which switches the engine's expert support on for a MoE "
             "layer and asks it to make its groups", mentions="module.set_deepspeed_parallelism("),
    Internal(ENGINE, "whose expert support expert parallelism uses", mentions="isinstance(module, MoE)"),
    self_use(ENGINE, "has_moe_layers", "which expert parallelism's checkpoint I/O turns off (the experts are in the "
             "layer files)"),
    Internal("deepspeed.moe.utils:is_moe_param", "which tells expert parameters by their allreduce attribute",
             mentions="param.allreduce"),
    Internal(f"{ENGINE}._get_gradients_for_reduction", "which groups expert gradients by their group_name",
             mentions="param.group_name"),
    self_use(ZERO_OPTIMIZER, "scaled_global_norm()", "which expert parallelism replaces with its clipping norm"),
    *(self_use(ZERO_OPTIMIZER, name, "which expert parallelism's clipping norm reads")
      for name in ("averaged_gradients", "params_in_partition", "model_parallel_rank")),
    self_use(BF16_OPTIMIZER, "get_grads_for_norm()", "which expert parallelism replaces with its clipping norm's"),
    Internal(f"{BF16_OPTIMIZER}.get_grads_for_norm", "which expert parallelism wraps", ("self", "for_clipping")),
    *(self_use(BF16_OPTIMIZER, name, "which expert parallelism's clipping norm reads")
      for name in ("fp32_groups_gradients", "fp32_groups_has_gradients", "bf16_groups")),
)


def check_deepspeed_internals():
    """Raise DeepSpeedMismatch (one line: the installed version, the missing piece, what to do) unless every
    internal above is in the installed DeepSpeed with its parameters. Checks them all, whatever the config: one
    DeepSpeed either runs every configuration the tests cover or is not the one they ran."""
    for internal in INTERNALS:
        internal.check(SOURCES)
