"""Which pipeline layers each stage owns, and what each stage costs in compute and memory.

The cost model works from the model config and the workload alone (nothing is built), per layer kind:
- compute: training FLOPs per micro-batch (forward, backward = 2x forward, and the forward again when the layer is
  recomputed by activation checkpointing). Decoder layers count their attention at seq_length, the LM head its
  matmul over the whole vocabulary; the embedding (a gather) and the final norm are free.
- memory: weights, gradients and optimizer state for the precision, ZeRO stage and data-parallel degree; what
  autograd and the engine keep per micro-batch in flight (1F1B keeps up to num_stages - stage micro-batches on a
  stage; the last stage also keeps two micro-batches of logits; under the zero-bubble schedule stage s also keeps up
  to s micro-batches waiting for their weight gradients); the largest short-lived peak of one backward
  pass (a recomputed chunk, the LM head's fp32 loss gradients); ZeRO-1's reduce buckets; and the optimizer step's
  peak (with ZeRO-0 and data parallelism, the gradient all-reduce's flat copy before it), which replaces the
  activations' once they are freed.

Tensor parallelism (Megatron's layout, models/tensor_parallel.py) over t ranks: every figure is one rank's. The
projections, the embedding and the LM head hold 1/t of their weights (norms and row-parallel biases stay whole),
so do their gradients and optimizer state, and the matmuls do 1/t of the FLOPs; attention heads, MLP columns and
logits split by t. With sequence parallelism the residual stream, the norms and the stage-boundary hidden states
hold 1/t of the tokens; each column-parallel group (q/k/v, gate/up, LM head) all-gathers its input, which backward
keeps (full tokens, per layer and micro-batch in flight) unless recompute_sequence_gather gathers it again into one
pooled buffer; its input gradient over all tokens is summed into another before the reduce-scatter. Without
sequence parallelism the residual stream is whole on every rank.

A stage's cost is the mean of its compute and its memory, each in units of one decoder layer, so an embedding
that holds 2.4 decoder layers of memory and does no compute weighs 1.2 decoder layers. The balanced partition
minimises the largest stage cost.
"""
import re
from dataclasses import dataclass

from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

from models.layout import num_pipeline_layers
from models.llama import head_dim_of
from models.tensor_parallel import check_tensor_parallel_split

EMBEDDING, DECODER, NORM, HEAD = "embedding", "decoder", "norm", "head"
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32_BYTES = 4
FP64_BYTES = 8
ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq in fp32
INT64_BYTES = 8


@dataclass(frozen=True)
class Workload:
    """What one training step runs, as far as compute and memory depend on it (conf/base.yaml's defaults)."""
    seq_length: int = 512
    micro_batch_size: int = 1
    micro_batches: int = 8  # gradient_accumulation_steps: the pipeline's m
    precision: str = "bf16"
    zero_stage: int = 1
    data_parallel: int = 1
    activation_checkpoint_interval: int = 0
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default
    torch_adam: bool = True  # torch's Adam (conf/base.yaml) rather than DeepSpeed's fused one
    tensor_parallel: int = 1  # ranks splitting each layer (conf/base.yaml's tensor_parallel_size)
    sequence_parallel: bool = True  # with tensor_parallel > 1: residual stream on 1/t of the tokens
    recompute_sequence_gather: bool = False  # sequence parallel: gather again in backward rather than keep
    offload_optimizer: bool = False  # ZeRO-1's fp32 partition, its gradient and Adam's moments in host memory
    pipeline_schedule: str = "1f1b"  # zero_bubble: micro-batches also wait for their weight gradients (W)
    zero_bubble_max_waiting: int | None = None  # zero_bubble: cap on those per stage (None: ZB-H1's s on stage s)

    @property
    def tokens(self):
        return self.seq_length * self.micro_batch_size

    @property
    def splits_sequence(self):
        """Whether the residual stream holds 1/tensor_parallel of the tokens on each rank."""
        return self.sequence_parallel and self.tensor_parallel > 1

    @property
    def residual_tokens(self):
        """Tokens of the residual stream, norms and stage-boundary hidden states on one rank."""
        return self.tokens // self.tensor_parallel if self.splits_sequence else self.tokens

    @property
    def gathered_input_tokens(self):
        """Tokens of the input a column-parallel group keeps for its backward: all of them, or this rank's share
        when recompute_sequence_gather gathers them again."""
        return self.residual_tokens if self.splits_sequence and self.recompute_sequence_gather else self.tokens

    @property
    def activation_bytes(self):
        return PRECISION_BYTES[self.precision]


def describe_workload(workload):
    checkpointing = (f"checkpoint every {workload.activation_checkpoint_interval} layers"
                     if workload.activation_checkpoint_interval else "no activation checkpointing")
    tensor = ""
    if workload.tensor_parallel > 1:
        sequence = ("sequence parallel, sequence gather recomputed in backward"
                    if workload.splits_sequence and workload.recompute_sequence_gather
                    else "sequence parallel" if workload.splits_sequence else "no sequence parallel")
        tensor = f"tensor-parallel {workload.tensor_parallel} ({sequence}), "
    return (f"seq_length={workload.seq_length}, micro_batch_size={workload.micro_batch_size}, "
            f"{workload.micro_batches} micro-batches, {workload.precision}, ZeRO-{workload.zero_stage}"
            f"{' with optimizer offloaded to CPU' if workload.offload_optimizer else ''}, "
            f"{tensor}data-parallel {workload.data_parallel}, {checkpointing}"
            f"{zero_bubble_description(workload) if workload.pipeline_schedule == 'zero_bubble' else ''}")


def zero_bubble_description(workload):
    cap = workload.zero_bubble_max_waiting
    return ", zero-bubble schedule" + ("" if cap is None else f" (at most {cap} micro-batches waiting for W)")


def layer_kinds(num_hidden_layers):
    """Layer kind of every pipeline index (models/layout.py's map)."""
    return [EMBEDDING] + [DECODER] * num_hidden_layers + [NORM, HEAD]


def decoder_parameter_split(config):
    """A decoder layer's parameters as (sharded, replicated) under tensor parallelism: the projections' weights
    and the column-parallel biases (q, k, v, gate, up) split over the ranks; the two norms and the row-parallel
    biases (o, down) are whole on every rank."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = head_dim_of(config)
    inter = config.intermediate_size
    sharded = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    replicated = 2 * hidden
    if getattr(config, "attention_bias", False) or config.model_type == "qwen2":
        sharded += head_dim * (heads + 2 * kv_heads)
    if getattr(config, "attention_bias", False) and config.model_type != "qwen2":
        replicated += hidden
    if getattr(config, "mlp_bias", False):
        sharded += 2 * inter
        replicated += hidden
    return sharded, replicated


def decoder_parameter_count(config):
    return sum(decoder_parameter_split(config))


def training_flops_per_token(config, seq_length):
    """Model FLOPs of one training token (forward + backward = 3 x forward, recomputation not counted), the figure
    MFU divides by the device's peak: 2 per weight per token for every decoder weight and the LM head (the
    embedding is a gather), plus attention's QK^T and PV, 2 x 2 x seq_length x heads x head_dim per token and
    layer over all seq_length x seq_length scores (PaLM's convention, as published MFU figures and
    torch.utils.flop_counter count it; the planner's cost model instead counts only the causal half)."""
    matmul_weights = config.num_hidden_layers * decoder_parameter_count(config) + config.vocab_size * config.hidden_size
    attention = config.num_hidden_layers * 4 * seq_length * config.num_attention_heads * head_dim_of(config)
    return 3 * (2 * matmul_weights + attention)


def check_tensor_parallel(config, workload):
    """check_tensor_parallel_split for a workload: ValueError naming what its tensor-parallel size does not split."""
    check_tensor_parallel_split(config, workload.tensor_parallel, workload.tokens if workload.splits_sequence else None)


def layer_parameter_counts(config):
    """Parameters of each pipeline layer, from the config alone (a tied LM head counts 0: the embedding owns it)."""
    embedding = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embedding
    return [embedding] + [decoder_parameter_count(config)] * config.num_hidden_layers + [config.hidden_size, head]


def state_bytes_per_parameter(workload):
    """Bytes per parameter held through the whole run: weights, gradients, optimizer state.

    DeepSpeed accumulates gradients in the model's dtype (data_types.grad_accum_dtype unset). The optimizer keeps
    fp32 master weights (ZeRO-1 keeps its fp32 partition even for fp32 models) and Adam's two fp32 moments, sharded
    over data-parallel ranks by ZeRO-1.
    """
    weight = PRECISION_BYTES[workload.precision]
    if workload.offload_optimizer:  # on the host: host_state_bytes_per_parameter
        return {"weights": weight, "gradients": weight, "optimizer": 0}
    keeps_master = workload.precision != "fp32" or workload.zero_stage >= 1
    return {"weights": weight, "gradients": weight,
            "optimizer": ((FP32_BYTES if keeps_master else 0) + ADAM_STATE_BYTES) / optimizer_shards(workload)}


def host_state_bytes_per_parameter(workload):
    """Host bytes per parameter of a stage with offload_optimizer=cpu (DeepSpeed 0.19.8, zero/stage_1_and_2.py),
    all pinned: the fp32 master partition, its fp32 gradient, Adam's two moments, and a weight-dtype copy of the
    partition the updated weights go back to the device through; each 1/data-parallel of the stage."""
    if not workload.offload_optimizer:
        return 0
    return (FP32_BYTES + FP32_BYTES + ADAM_STATE_BYTES + PRECISION_BYTES[workload.precision]) / optimizer_shards(
        workload)


def optimizer_shards(workload):
    return workload.data_parallel if workload.zero_stage >= 1 else 1


class LayerCosts:
    """Compute and memory of each layer kind for one micro-batch of a workload, and of stages built from them.

    The activation figures follow what this project's layers and DeepSpeed's pipeline engine keep alive; they were
    checked against saved-tensor hooks (tests/test_partition.py) and against torch's memory profiler and peak RSS
    on the CPU (bench/memory_plan_check.py).
    """

    def __init__(self, config, workload):
        self.config, self.workload = config, workload
        check_tensor_parallel(config, workload)
        t = workload.tensor_parallel  # every split count below divides by t (check_tensor_parallel)
        tokens, hidden, vocab = workload.tokens, config.hidden_size, config.vocab_size // t
        residual, gathered = workload.residual_tokens, workload.gathered_input_tokens
        inter = config.intermediate_size // t
        act = workload.activation_bytes
        q_width = config.num_attention_heads * head_dim_of(config) // t
        heads = config.num_attention_heads // t
        sharded, replicated = decoder_parameter_split(config)
        # vocab, inter, q_width and heads are this rank's share; parameters are this rank's too.
        self.parameters = {EMBEDDING: vocab * hidden, DECODER: sharded // t + replicated, NORM: hidden,
                           HEAD: vocab * hidden}  # a tied head is a second copy of the embedding on its stage
        self.largest_tensor = {EMBEDDING: vocab * hidden, DECODER: hidden * max(inter, q_width), NORM: hidden,
                               HEAD: vocab * hidden}
        # Matmuls: 2 FLOPs per weight per token; causal attention: QK^T and PV over half the seq x seq scores.
        # Norms and row-parallel biases (counted the same way) run on the residual stream's tokens.
        self.forward_flops = {EMBEDDING: 0, NORM: 0, HEAD: 2 * tokens * hidden * vocab,
                              DECODER: 2 * tokens * (sharded // t) + 2 * residual * replicated
                              + 2 * tokens * workload.seq_length * q_width}
        self.saved_bytes = {
            # Vocabulary-parallel: this rank's local ids and the mask of ids outside its rows.
            EMBEDDING: tokens * (INT64_BYTES + 1) if t > 1 else 0,
            # 8 hidden-sized and 4 intermediate-sized tensors in the activation dtype, the two norms' fp32 inputs
            # and inverse RMS, and attention's log-sum-exp per head. Of the hidden-sized ones, the norms' normalised
            # outputs are on the residual stream's tokens, the inputs of the column-parallel groups (q/k/v,
            # gate/up) on the gathered tokens, and q, k, v and attention's output on this rank's heads (counted
            # hidden-sized: heads x head_dim = hidden in LLaMA-family configs).
            DECODER: act * (2 * residual * hidden + 2 * gathered * hidden + 4 * tokens * hidden // t
                            + 4 * tokens * inter)
                     + FP32_BYTES * (residual * (2 * hidden + 2) + tokens * heads),
            # The norm's fp32 input and inverse RMS, its normalised output, and its scaled output as the LM head's
            # input (gathered under sequence parallelism).
            NORM: residual * (FP32_BYTES * (hidden + 1) + act * hidden) + gathered * act * hidden,
            # The loss's fp32 log-softmax and its shifted labels (the logits themselves: see logits_bytes);
            # vocabulary-parallel, the labels as local ids and two boolean token masks (models/tensor_parallel.py).
            HEAD: tokens * (vocab * FP32_BYTES + INT64_BYTES + (2 if t > 1 else 0)),
        }
        # Gradients alive at once while a layer runs backward: a decoder's MLP and residual stream (two on this
        # rank's residual tokens, two on all tokens: a column group's input gradient, in the pool under sequence
        # parallelism, and a row-parallel output's gathered gradient); the loss's two fp32 logits-sized gradients.
        pooled = 1 if workload.splits_sequence else 0
        self.backward_bytes = {EMBEDDING: 0, NORM: 0,
                               DECODER: act * (2 * tokens * inter + 2 * residual * hidden
                                               + (2 - pooled) * tokens * hidden),
                               HEAD: 2 * tokens * vocab * FP32_BYTES}
        self.logits_bytes = tokens * vocab * act
        # A micro-batch waiting for its W (zero-bubble schedule) keeps each deferred linear layer's input and output
        # gradient (models/weight_grads.py), checkpointed or not: a decoder's q/k/v and gate/up inputs (gathered),
        # o_proj's and down_proj's inputs, q, k, v, gate and up's output gradients, and o_proj's and down_proj's
        # (all tokens, before the row-parallel reduction); the LM head's input and its logits-sized gradient.
        kv_width = config.num_key_value_heads * head_dim_of(config) // t
        self.weight_grad_bytes = {
            EMBEDDING: 0, NORM: 0,
            DECODER: act * (2 * gathered * hidden + tokens * (2 * q_width + 2 * kv_width + 3 * inter + 2 * hidden)),
            HEAD: act * (gathered * hidden + tokens * vocab)}
        # One hidden-states tensor: a stage boundary, a checkpoint input.
        self.hidden_bytes = residual * hidden * act
        # Sequence parallelism's pool, once per stage: the buffer every column group sums its input gradient into,
        # and with recompute_sequence_gather the one it gathers its input into.
        self.pool_bytes = tokens * hidden * act * pooled * (2 if workload.recompute_sequence_gather else 1)

    def chunks(self, kinds):
        """DeepSpeed's activation checkpointing: consecutive runs of `interval` layers from the stage's first layer,
        each checkpointed when it holds decoder layers only (the project's checkpointable_layers)."""
        interval = self.workload.activation_checkpoint_interval
        if interval == 0:
            return [(kinds, False)]
        runs = [kinds[i:i + interval] for i in range(0, len(kinds), interval)]
        return [(run, all(kind == DECODER for kind in run)) for run in runs]

    def stage_flops(self, kinds):
        flops = 0
        for run, checkpointed in self.chunks(kinds):
            forward = sum(self.forward_flops[kind] for kind in run)
            flops += forward * (4 if checkpointed else 3)
        return flops

    def stage_activation_bytes(self, kinds, in_flight, waiting=0):
        """Peak activation memory: what in_flight micro-batches keep for their backward and `waiting` ones for
        their weight gradients, the engine's buffers, and the largest short-lived peak of one layer's backward
        (after recomputing its checkpointed chunk)."""
        per_micro_batch, transient = 0, 0
        for run, checkpointed in self.chunks(kinds):
            saved = sum(self.saved_bytes[kind] for kind in run)
            workspace = max(self.backward_bytes[kind] for kind in run)
            if checkpointed:
                per_micro_batch += self.hidden_bytes
                transient = max(transient, saved + workspace)
            else:
                per_micro_batch += saved
                transient = max(transient, workspace)
        persistent = 0
        if kinds[0] != EMBEDDING:  # the received input stays until its gradient is sent; a receive buffer and copy
            per_micro_batch += self.hidden_bytes
            persistent += 2 * self.hidden_bytes
        if kinds[-1] != HEAD:  # the output stays until its backward; a receive buffer for its gradient
            per_micro_batch += self.hidden_bytes
            persistent += self.hidden_bytes
        else:  # DeepSpeed never frees the last stage's outputs: each of its two buffers keeps logits until reused
            persistent += min(2, self.workload.micro_batches) * self.logits_bytes
        if DECODER in kinds or HEAD in kinds:  # column-parallel groups use the stage's pool
            persistent += self.pool_bytes
        waiting_bytes = waiting * sum(self.weight_grad_bytes[kind] for kind in kinds)
        return in_flight * per_micro_batch + waiting_bytes + persistent + transient

    def stage_parameters(self, kinds):
        return sum(self.parameters[kind] for kind in kinds)

    def stage_state_bytes(self, kinds):
        """Weights, gradients and optimizer state of a stage, in bytes."""
        parameters = self.stage_parameters(kinds)
        return {name: parameters * size for name, size in state_bytes_per_parameter(self.workload).items()}

    def stage_buffer_bytes(self):
        """ZeRO-1's two gradient reduce buckets in the pipeline path (allocated in full on GPUs); with offload, the
        staging buffer of the largest tensor that gradients cross to the host through."""
        if self.workload.zero_stage == 0:
            return 0
        staging = self.largest_tensor_bytes() if self.workload.offload_optimizer else 0
        return 2 * self.workload.reduce_bucket_size * self.workload.activation_bytes + staging

    def largest_tensor_bytes(self):
        return max(self.largest_tensor.values()) * self.workload.activation_bytes

    def stage_host_bytes(self, kinds):
        """Host memory of one rank of a stage for the offloaded optimizer: its state (host_state_bytes_per_parameter)
        and the pinned staging buffer of the largest tensor; 0 without offload."""
        if not self.workload.offload_optimizer:
            return 0
        return (self.stage_parameters(kinds) * host_state_bytes_per_parameter(self.workload)
                + self.largest_tensor_bytes())

    def stage_step_bytes(self, kinds):
        """The optimizer step's peak beyond weights and optimizer state, gradients included (activations are freed
        by then). ZeRO-1 copies its gradient partition flat and casts it to fp32, frees the gradients, then runs
        Adam on the flat partition; without ZeRO the gradients are first all-reduced over data-parallel ranks
        (allreduce_bucket_bytes), a 16-bit model's optimizer builds fp32 gradients, and Adam runs one parameter at
        a time. torch's Adam allocates two fp32 temporaries (sqrt and division) per tensor."""
        work = self.workload
        parameters = self.stage_parameters(kinds)
        grad = PRECISION_BYTES[work.precision]
        if work.offload_optimizer:
            # Gradients go to the host partition one tensor at a time (the updated weights come back in place);
            # DeepSpeed 0.19.8 takes each one's norm on an fp64 copy first (zero/utils.py get_norm_dtype).
            return parameters * grad + max(self.largest_tensor[kind] for kind in kinds) * FP64_BYTES
        cast = FP32_BYTES if work.precision != "fp32" else 0
        temporaries = 2 * FP32_BYTES if work.torch_adam else 0
        if work.zero_stage >= 1:
            shards = optimizer_shards(work)
            flatten = parameters * (grad + (grad + cast) / shards)
            adam = parameters * (FP32_BYTES + temporaries) / shards
            return max(flatten, adam)
        largest = max(self.largest_tensor[kind] for kind in kinds)
        return max(parameters * (grad + cast) + largest * temporaries,
                   parameters * grad + self.allreduce_bucket_bytes(parameters, largest))

    def allreduce_bucket_bytes(self, parameters, largest):
        """ZeRO-0 with data parallelism: DeepSpeed's pipeline all-reduces the gradients (model dtype; bf16 needs
        ZeRO-1) through flat copies of MEMORY_OPT_ALLREDUCE_SIZE elements, plus the tensor that fills the bucket."""
        if self.workload.zero_stage >= 1 or self.workload.data_parallel == 1:
            return 0
        return min(parameters, MEMORY_OPT_ALLREDUCE_SIZE + largest) * PRECISION_BYTES[self.workload.precision]


def in_flight_micro_batches(stage, num_stages, micro_batches):
    """1F1B: stage s runs num_stages - s forward passes before its first backward."""
    return min(num_stages - stage, micro_batches)


def waiting_micro_batches(stage, num_stages, micro_batches, schedule, max_waiting=None):
    """Micro-batches waiting only for their W at a stage's peak: ZB-H1 holds s of them back on stage s (at most
    max_waiting if given), next to 1F1B's in flight (training/schedule.py), never more than the step's."""
    if schedule != "zero_bubble":
        return 0
    return min(held_back_micro_batches(stage, max_waiting),
               micro_batches - in_flight_micro_batches(stage, num_stages, micro_batches))


def held_back_micro_batches(stage, max_waiting=None):
    """zero_bubble's steady state: stage s runs W s micro-batches after their B (ZB-H1), at most max_waiting."""
    return stage if max_waiting is None else min(stage, max_waiting)


def stage_kinds(stage, num_stages, num_decoders):
    kinds = [DECODER] * num_decoders
    if stage == 0:
        kinds = [EMBEDDING] + kinds
    if stage == num_stages - 1:
        kinds = kinds + [NORM, HEAD]
    return kinds


class StageCostModel:
    """Compute, memory and the combined cost of a stage given its layer kinds."""

    def __init__(self, config, workload, num_stages, compute_weight=0.5):
        self.layers = LayerCosts(config, workload)
        self.workload, self.num_stages, self.compute_weight = workload, num_stages, compute_weight
        # Units: one decoder layer's compute, and its state plus what it keeps per micro-batch for the mean number
        # of micro-batches in flight.
        self.compute_unit = self.layers.stage_flops([DECODER])
        mean_in_flight = sum(self.in_flight(s) for s in range(num_stages)) / num_stages
        kept = (self.layers.hidden_bytes if workload.activation_checkpoint_interval
                else self.layers.saved_bytes[DECODER])
        self.memory_unit = sum(self.layers.stage_state_bytes([DECODER]).values()) + mean_in_flight * kept

    def in_flight(self, stage):
        return in_flight_micro_batches(stage, self.num_stages, self.workload.micro_batches)

    def waiting(self, stage):
        return waiting_micro_batches(stage, self.num_stages, self.workload.micro_batches,
                                     self.workload.pipeline_schedule, self.workload.zero_bubble_max_waiting)

    def activation_bytes(self, stage, kinds):
        """Under zero_bubble the larger of two moments: before a B, and just after it, when its micro-batch has
        traded its activations for its weight-gradient tensors (more than a checkpointed micro-batch keeps)."""
        in_flight, waiting = self.in_flight(stage), self.waiting(stage)
        peak = self.layers.stage_activation_bytes(kinds, in_flight, waiting)
        if self.workload.pipeline_schedule == "zero_bubble":
            peak = max(peak, self.layers.stage_activation_bytes(kinds, in_flight - 1, waiting + 1))
        return peak

    def memory_bytes(self, stage, kinds):
        """Peak memory: weights, optimizer state and buffers, plus the larger of the backward passes (gradients
        and activations) and the optimizer step."""
        state = self.layers.stage_state_bytes(kinds)
        backward = state["gradients"] + self.activation_bytes(stage, kinds)
        return (state["weights"] + state["optimizer"] + self.layers.stage_buffer_bytes()
                + max(backward, self.layers.stage_step_bytes(kinds)))

    def cost(self, stage, kinds):
        compute = self.layers.stage_flops(kinds) / self.compute_unit
        memory = self.memory_bytes(stage, kinds) / self.memory_unit
        return self.compute_weight * compute + (1 - self.compute_weight) * memory


def balanced_decoder_counts(config, num_stages, workload, compute_weight=0.5):
    """Decoder layers per stage minimising the largest stage cost.

    Decoder layers are identical, so the partition is a count per stage, and adding layers one at a time to the
    stage whose cost after the addition is smallest minimises the maximum (every stage's cost rises with its
    count). Ties go to the stage nearest the middle: first and last stages carry the embedding, the head and the
    most micro-batches in flight, so a spare layer belongs in between. Every stage gets at least one layer.
    """
    if not 1 <= num_stages <= config.num_hidden_layers:
        raise ValueError(f"{num_stages} stages for {config.num_hidden_layers} decoder layers: need 1 to "
                         f"{config.num_hidden_layers} stages.")
    model = StageCostModel(config, workload, num_stages, compute_weight)
    counts = [1] * num_stages
    middle = (num_stages - 1) / 2
    for _ in range(config.num_hidden_layers - num_stages):
        stage = min(range(num_stages),
                    key=lambda s: (model.cost(s, stage_kinds(s, num_stages, counts[s] + 1)), abs(s - middle)))
        counts[stage] += 1
    return counts


def stage_bounds_from_decoder_counts(decoder_counts, num_hidden_layers):
    """Stage boundaries from decoder layers per stage; the embedding joins the first stage, norm and head the last."""
    if sum(decoder_counts) != num_hidden_layers or min(decoder_counts) < 0:
        raise ValueError(f"partition {list(decoder_counts)} must list decoder layers per stage summing to "
                         f"num_hidden_layers ({num_hidden_layers}).")
    bounds = [0]
    for count in decoder_counts:
        bounds.append(bounds[-1] + count)
    bounds = [b + 1 for b in bounds]
    bounds[0], bounds[-1] = 0, num_pipeline_layers(num_hidden_layers)
    return bounds


def stage_bounds(config, num_stages, partition, workload, layer_class_names):
    """Stage boundaries (pipeline layer indices, DeepSpeed's `parts`) for every partition method.

    partition: 'balanced' (the cost model), 'parameters' (parameter counts), DeepSpeed's 'uniform' and
    'type:<regex>' (a case-insensitive search on layer class names, layer_class_names in pipeline order), or a
    list of decoder layers per stage.
    """
    num_layers = num_pipeline_layers(config.num_hidden_layers)
    if not isinstance(partition, str):
        if len(partition) != num_stages:
            raise ValueError(f"partition {list(partition)} has {len(partition)} entries for {num_stages} stages.")
        return stage_bounds_from_decoder_counts(partition, config.num_hidden_layers)
    method = partition.lower()
    if method == "balanced":
        counts = balanced_decoder_counts(config, num_stages, workload)
        return stage_bounds_from_decoder_counts(counts, config.num_hidden_layers)
    if method == "parameters":
        return ds_utils.partition_balanced(layer_parameter_counts(config), num_stages)
    if method == "uniform":
        return ds_utils.partition_uniform(num_layers, num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        matches = [1 if pattern.search(name) else 0 for name in layer_class_names]
        if not any(matches):
            raise ValueError(f"partition '{partition}' matches none of the layer classes {sorted(set(layer_class_names))}.")
        return ds_utils.partition_balanced(matches, num_stages)
    raise ValueError(f"partition '{partition}' is not one of balanced, parameters, uniform, type:<regex> or a "
                     f"list of decoder layers per stage.")


def stage_plan(config, bounds, workload):
    """Per stage: its layers, parameters, compute, memory by kind (bytes) and combined cost."""
    num_stages = len(bounds) - 1
    model = StageCostModel(config, workload, num_stages)
    kinds_of = layer_kinds(config.num_hidden_layers)
    rows = []
    for stage in range(num_stages):
        start, stop = bounds[stage], bounds[stage + 1]
        kinds = kinds_of[start:stop]
        state = model.layers.stage_state_bytes(kinds)
        rows.append({
            "stage": stage, "layers": (start, stop), "decoder_layers": kinds.count(DECODER),
            "parameters": model.layers.stage_parameters(kinds),
            "tflops_per_micro_batch": model.layers.stage_flops(kinds) / 1e12,
            **{f"{name}_bytes": value for name, value in state.items()},
            "activation_bytes": model.activation_bytes(stage, kinds),
            "step_bytes": model.layers.stage_step_bytes(kinds),
            "buffer_bytes": model.layers.stage_buffer_bytes(),
            "host_bytes": model.layers.stage_host_bytes(kinds),
            "in_flight": model.in_flight(stage),
            "waiting_for_weight_grads": model.waiting(stage),
            "memory_bytes": model.memory_bytes(stage, kinds),
            "cost": model.cost(stage, kinds),
        })
    return rows


def format_stage_plan(rows):
    """The plan as a table: layers, parameters, compute and estimated memory per stage."""
    lines = [f"{'stage':>5} {'layers':>9} {'decoders':>8} {'params':>9} {'TFLOP/mb':>9} {'memory':>9} {'cost':>6}"]
    for row in rows:
        start, stop = row["layers"]
        lines.append(f"{row['stage']:>5} {f'{start}-{stop - 1}':>9} {row['decoder_layers']:>8} "
                     f"{row['parameters'] / 1e9:>8.2f}B {row['tflops_per_micro_batch']:>9.2f} "
                     f"{row['memory_bytes'] / 2**30:>6.1f}GiB {row['cost']:>6.2f}")
    lines.append(f"largest / smallest stage cost: {cost_spread(rows):.3f}")
    return "\n".join(lines)


def cost_spread(rows):
    """Largest stage cost over the smallest: 1.0 is a perfect balance."""
    costs = [row["cost"] for row in rows]
    return max(costs) / min(costs)
