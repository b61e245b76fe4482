"""The accessors through which the rooms read and replace DeepSpeed's internals (listed, with why, in
deepspeed_internals/__init__.py; checked by registry.py)."""
import contextlib
import functools
import math
import types
from typing import NamedTuple

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.pipe.engine import PipelineEngine

from deepspeed_internals.registry import ENGINE_COUNTERS, EXPORTED, LOSS_SCALER_FIELDS

# The training engine (DeepSpeedEngine and PipelineEngine).

def replace_fp32_gradient_clipping(engine, clip):
    """clip() runs where DeepSpeed clips fp32 gradients (without ZeRO, fp16 or bf16)."""
    engine.clip_fp32_gradients = clip


@contextlib.contextmanager
def parameters_kept_in_fp32(params):
    """Inside, the engines deepspeed.initialize builds leave `params` in fp32 where they cast the model to the
    training dtype (bf16, fp16): DeepSpeed casts every parameter, and its keep_in_fp32_modules keeps buffers only."""
    engine_class = deepspeed.runtime.engine.DeepSpeedEngine
    cast = engine_class._cast_module_mixed_precision

    def cast_keeping(self, *args, **kwargs):
        kept = [(param, param.data) for param in params]
        cast(self, *args, **kwargs)
        for param, data in kept:
            param.data = data
    engine_class._cast_module_mixed_precision = cast_keeping
    try:
        yield
    finally:
        engine_class._cast_module_mixed_precision = cast


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


def clear_total_loss(engine):
    """The pipeline engine's sum of its micro-batches' outputs, which eval_batch adds to and only train_batch clears:
    an output of another shape than the last step's loss (one per row) cannot be added to it."""
    engine.total_loss = None


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


def ask_cpuinfo_once():
    """py-cpuinfo's answer, asked once per process: DeepSpeed's CPU Adam asks it three times as it starts (its op
    builder's -march and SIMD width, the optimizer's CPU vendor), each in a new Python interpreter (~0.7 CPU s)."""
    import cpuinfo  # its import runs subprocesses too: only where CPU Adam will
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


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


def load_micro_batch(engine, buffer_id):
    """DeepSpeed's LoadMicroBatch: the next micro-batch's inputs (first stage) and labels (last stage)."""
    engine._exec_load_micro_batch(buffer_id)


def run_forward_pass(engine, buffer_id):
    """DeepSpeed's ForwardPass of a buffer's micro-batch (the loss on the last stage)."""
    engine._exec_forward_pass(buffer_id)


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


def received_gradients(engine):
    return engine.grad_layer


def sends_need_deepspeed_handlers(engine):
    """Whether the engine's sends take its dynamic-shape, bool-tensor or partitioned paths."""
    return engine.dynamic_shape or engine.has_bool_tensors or engine.is_pipe_partitioned


def uses_bf16_optimizer(engine):
    return engine.using_bf16_optimizer


def accumulated_gradient(engine, param):
    """The tensor holding a parameter's gradient summed over the step's micro-batches: the bf16 optimizer's fp32
    one (it adds each backward's .grad into it), ZeRO-1's (.grad, or where it sums in another dtype than the
    weights', fp16 or offloaded with fp32 sums, its grad_accum), else .grad."""
    if engine.using_bf16_optimizer:
        return getattr(param, "_hp_grad", None)
    if isinstance(engine.optimizer, EXPORTED["DeepSpeedZeroOptimizer"].resolve()):
        return engine.optimizer.get_param_gradient_attribute(param)
    return param.grad


def clear_bf16_optimizer_grads(optimizer):
    """The bf16 optimizer clears the parameters' .grad (already added into its fp32 gradients)."""
    optimizer.clear_lp_grads()


def add_grads_to_bf16_optimizer(optimizer):
    """The bf16 optimizer adds the parameters' .grad into its fp32 gradients."""
    optimizer.update_hp_grads()


def run_schedule(engine, pipe_schedule):
    """DeepSpeed's loop of train_batch and eval_batch: each step's instructions to the engine's handlers."""
    engine._exec_schedule(pipe_schedule)


def train_schedule(engine):
    """The schedule train_batch runs (the zero-bubble engine's own)."""
    return engine._train_schedule()


def inference_schedule(engine, micro_batches):
    """The schedule eval_batch runs."""
    return engine._inference_schedule(micro_batches)


def pipe_p2p():
    """The module whose send(tensor, dest_stage) and recv(tensor, src_stage) DeepSpeed's handlers call."""
    return EXPORTED["pipe_p2p"].resolve()


def handlers_only_pipeline_engine(grid, module, micro_batches, device):
    """A PipelineEngine holding only what its instruction handlers read, as DeepSpeed's __init__ sets it for this
    project's runs (no dynamic shapes, bool tensors, partitioned activations, timers or ZeRO-2 gradients), without
    a model, optimizer or process group: tests/test_p2p_order.py drives its handlers. grid: stage_to_global,
    get_stage_id and pipe_parallel_size; module: what the handlers reach through engine.module."""
    engine = object.__new__(PipelineEngine)
    torch.nn.Module.__init__(engine)
    engine.grid, engine.module, engine.device, engine.micro_batches = grid, module, device, micro_batches
    engine.num_stages, engine.stage_id = grid.pipe_parallel_size, grid.get_stage_id()
    engine.prev_stage, engine.next_stage = engine.stage_id - 1, engine.stage_id + 1
    engine.num_pipe_buffers = 0
    engine.pipe_buffers = {"inputs": [], "labels": [], "outputs": [], "output_tensors": []}
    engine.has_attention_mask = engine.has_bool_tensors = engine.dynamic_shape = False
    engine.is_pipe_partitioned = engine.is_grad_partitioned = engine.using_bf16_optimizer = False
    engine._config = types.SimpleNamespace(wall_clock_breakdown=False, zero_optimization_stage=0)
    engine.reset_activation_shape()
    return engine


def replace_passes(engine, forward, backward, load):
    """For this engine only: what run_forward_pass, run_backward_pass and load_micro_batch run, each f(buffer_id)
    (tests/test_p2p_order.py's stand-ins under the chunked engine, which runs them per chunk)."""
    engine._exec_forward_pass, engine._exec_backward_pass, engine._exec_load_micro_batch = forward, backward, load


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


def set_layer_range(module, layers):
    """The range of pipeline layers DeepSpeed's _build builds next and its per-layer paths count from."""
    module._set_bounds(start=layers.start, stop=layers.stop)


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


def replay_cpu_adam_steps(optimizer, steps):
    """DeepSpeed's CPU Adam (offload) keeps beta1^t and beta2^t in its C++ state as products, one multiplication a
    step; a step count that jumps (a resume) recomputes them with pow, whose last bits differ, and the resumed run's
    weights drift an ulp from the uninterrupted run's. Its update of one-element scratch tensors at each step (lr 0)
    takes the products as training did, up to the step where both powers are below 2**-30: from there on 1 - beta^t
    is 1.0 in float however beta^t was taken (about 400 steps for betas (0.9, 0.95)). Nothing for another
    optimizer."""
    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return
    group = optimizer.param_groups[0]  # one C++ optimizer serves every group
    beta1, beta2 = group["betas"]
    settled = max(math.ceil(-30 * math.log(2) / math.log(beta)) if 0 < beta < 1 else steps for beta in (beta1, beta2))
    scratch = [torch.zeros(1) for _ in range(4)]  # weight, gradient and the two moments
    for step in [*range(1, min(steps, settled) + 1), *([steps] if steps > settled else [])]:
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, 0.0, beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], *scratch)


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


# Expert parallelism (models/expert_parallel.py): DeepSpeed's own support for expert parameters.

def use_deepspeed_expert_groups(module, params, name, num_experts, group, ranks, replica_group, replica_ranks):
    """DeepSpeed's engine, built next on `module`, treats `params` as expert parameters of the groups `name`: this
    rank's expert-parallel group (group, ranks) and the ranks holding the same experts (replica_group,
    replica_ranks). Its gradient reduction then sums their gradients over the replica group only (divided by the
    whole data-parallel group's size, as every gradient is), its ZeRO-1 and bf16 optimizers partition them over it,
    and its start-up broadcast keeps each slice's own values. The engine switches this on for a model holding a
    deepspeed.moe MoE layer: `module` gets a stand-in (no parameters, no state) that only counts the experts."""
    groups = EXPORTED["deepspeed_groups"].resolve()
    groups._EXPERT_PARALLEL_GROUP[name], groups._EXPERT_PARALLEL_GROUP_RANKS[name] = group, list(ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = replica_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(replica_ranks)
    for param in params:
        param.allreduce, param.group_name = False, name
    module.add_module("deepspeed_expert_layers", expert_layers_stand_in(num_experts))


def expert_layers_stand_in(num_experts):
    class ExpertLayers(EXPORTED["MoE"].resolve()):
        """What DeepSpeed's engine looks for to switch its expert support on (deepspeed.moe's MoE layer); the
        experts are the project's, their groups registered already."""

        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_experts = num_experts

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
            """DeepSpeed's engine asks a MoE layer to make its groups: made already."""

    return ExpertLayers()


def checkpoints_without_expert_files(engine):
    """The engine's save_checkpoint and load_checkpoint as for a model without experts: with experts DeepSpeed
    writes and expects its MoE layout (a file per expert, 'num_experts' in the model states), where the project
    writes each expert-parallel rank's slice of the experts beside its layer files (models/pipeline.py
    LlamaPipeline.saved_parts). Nothing without."""
    if not engine.has_moe_layers:
        return
    for name in ("save_checkpoint", "load_checkpoint"):
        method = getattr(engine, name)

        def without_expert_files(*args, _method=method, **kwargs):
            engine.has_moe_layers = False
            try:
                return _method(*args, **kwargs)
            finally:
                engine.has_moe_layers = True
        setattr(engine, name, without_expert_files)


def replace_zero_grad_norm(optimizer, norm):
    """ZeRO-1's clipping norm (also the one it reports): norm(squares), squares this rank's share of the squared
    gradients (zero_partition_squares), norm summing them over the ranks."""
    optimizer.scaled_global_norm = lambda norm_type=2: norm(zero_partition_squares(optimizer))


def zero_partition_squares(optimizer):
    """The squared gradients of this rank's ZeRO partitions (fp32, on the device), counted as DeepSpeed's own norm
    counts them: a weight the pipeline holds twice (a tied copy) once, one every tensor-parallel rank holds whole on
    rank 0 only."""
    total = torch.zeros((), dtype=torch.float32, device=get_accelerator().current_device_name())
    for group, params in enumerate(optimizer.params_in_partition):
        grads = [g for g in optimizer.averaged_gradients[group] if not getattr(g, "_zero_padding", False)]
        for grad, param in zip(grads, params):
            if counted_once(param, optimizer.model_parallel_rank):
                total += grad.float().pow(2).sum()
    return total


def replace_bf16_grad_norm(optimizer, squares_of):
    """The bf16 optimizer's clipping norm (also the one it reports) from squares_of([(param, fp32 gradient)]), this
    rank's share of the squared gradients with what other ranks must add already added, summed by DeepSpeed over
    the model-parallel group (pipeline x tensor-parallel ranks), as it sums its own."""
    own = optimizer.get_grads_for_norm

    def grads_for_norm(for_clipping=False):
        if for_clipping:
            return own(for_clipping=True)
        pairs = [(param, optimizer.fp32_groups_gradients[i][j])
                 for i, group in enumerate(optimizer.bf16_groups) for j, param in enumerate(group)
                 if optimizer.fp32_groups_has_gradients[i][j]]
        return [squares_of(pairs).sqrt().reshape(1)], {}
    optimizer.get_grads_for_norm = grads_for_norm


def counted_once(param, tensor_parallel_rank):
    """Whether a norm over the model counts this rank's gradient of param: not a tied weight's pipeline copy
    (DeepSpeed's ds_pipe_replicated), and a weight every tensor-parallel rank holds whole on rank 0 only."""
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return tensor_parallel_rank == 0 or EXPORTED["is_model_parallel_parameter"].resolve()(param)
