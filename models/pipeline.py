"""The model as DeepSpeed layer specs, split into stages. Specs are built into modules only on the rank that owns
them, so no rank ever holds more than its own stage. Which layers a stage owns, and how a layer's weights are read,
come from the caller (the trainer: training/run_spec.py's stage bounds, checkpoints/layer_files.py's reader)."""
import functools
import os
from typing import NamedTuple

import torch
from deepspeed import checkpointing
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from deepspeed_internals.access import (pipeline_grid, set_layer_range, set_partition, synchronize_tied_weights,
                                        use_deepspeed_expert_groups)
from deepspeed_internals.registry import non_reentrant_checkpoint
from models.architecture import COMPOSED, architecture_of, check_model_config
from models.attention import StageAttentionInputs
from models.context_parallel import NO_CONTEXT_PARALLEL, ContextParallelAttentionInputs, build_context_parallel
from models.expert_parallel import NO_EXPERT_PARALLEL, build_expert_parallel, keeping_dispatch
from models.layout import expert_shard_file_name
from models.lora import NO_LORA, add_adapters, freeze_all_but_adapters
from models.loss import CausalLMLoss
from models.partition import stage_bounds
from models.pipeline_layers import (DECODER_PIPES, EmbeddingPipe, LMHeadPipe, StageDecoder, StagePlan, StageTuple,
                                   decoder_pipe, final_norm_pipe, lm_head)
from models.preference import PreferenceLoss, PreferenceSettings
from models.router_loss import LoadBalancingLoss
from models.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel, parallelize_adapters

ATTENTION_IMPLS = ("sdpa", "eager")
LOSS_IMPLS = ("chunked", "logits")
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_pipeline_layers(config, attention_impl="sdpa", parallel=NO_TENSOR_PARALLEL, context=NO_CONTEXT_PARALLEL,
                          chunked_loss=False, row_layout="packed", experts=NO_EXPERT_PARALLEL,
                          kept_in_fp32=frozenset()):
    """Layer specs in pipeline index order (models/layout.py): embedding, decoder layers, final norm, LM head. Under
    the chunked loss the head hands the loss its input and weight instead of logits; what the rows hold (row_layout)
    decides the attention masks, `experts` where each sparse layer's experts are, and kept_in_fp32 the decoder
    layers' keys kept in fp32 as the checkpoint stores them (models/pipeline_layers.py StagePlan)."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl '{attention_impl}' is not one of {ATTENTION_IMPLS}.")
    stage_inputs = (ContextParallelAttentionInputs(config, context, row_layout) if context.size > 1
                    else StageAttentionInputs(config, row_layout))
    tied = config.tie_word_embeddings
    embedding = (TiedLayerSpec("embed", EmbeddingPipe, config, parallel, context) if tied
                 else LayerSpec(EmbeddingPipe, config, parallel, context))
    head = (TiedLayerSpec("embed", EmbeddingPipe, config, parallel, context,
                          forward_fn=functools.partial(lm_head, chunked_loss=chunked_loss))
            if tied else LayerSpec(LMHeadPipe, config, parallel, chunked_loss))
    plan = StagePlan(attention_impl, parallel, context, experts, kept_in_fp32=frozenset(kept_in_fp32))
    decoders = [LayerSpec(decoder_pipe(config), config, stage_inputs, index, plan)
                for index in range(config.num_hidden_layers)]
    return [embedding, *decoders, LayerSpec(final_norm_pipe(config), config, parallel, stage_inputs, plan), head]


def partition_stages(config, num_stages, partition="parameters", stage_cost=None):
    """Stage bounds for a partition method or a list of decoder layers per stage (models/partition.py);
    'balanced' needs stage_cost (planner/stage_costs.py)."""
    class_names = [spec.typename.__name__ for spec in build_pipeline_layers(config)]
    return stage_bounds(config, num_stages, partition, class_names, stage_cost)


class LlamaPipeline(PipelineModule):
    """DeepSpeed's PipelineModule over given stage bounds instead of partitioning by building every layer
    (DeepSpeed's 'parameters' method builds each layer on every rank to count it). layer_loader(layer, paths,
    tensor-parallel rank, size, strict) reads one layer's files into it; None keeps DeepSpeed's own loader.

    Several chunks per rank (interleaved and V schedules, engines/chunked_engine.py): stage_bounds then bound
    the model's chunks (global chunk g holds layers stage_bounds[g] to stage_bounds[g + 1]) and chunk_ids lists
    each rank's chunks ([[0, 3], [1, 2]]: a V on 2 ranks). A rank builds only its chunks' layers, each under its
    global layer index (parameter names and layer files as under one chunk per rank, so checkpoints do not
    depend on the schedule); forward runs the chunk `active_chunk` (a local index) names. A tied weight whose
    layers all sit on one rank (the V's embedding and head on rank 0) is tied there and never all-reduced.
    _partition_layers, _build, stage_owner, _index_tied_modules and load_state_dir override DeepSpeed's
    (deepspeed_internals/ lists them)."""

    def __init__(self, config, stage_bounds, parallel, layer_loader, context=NO_CONTEXT_PARALLEL, chunk_ids=None,
                 experts=NO_EXPERT_PARALLEL, **kwargs):
        self.model_config = config
        self.stage_bounds = list(stage_bounds)
        self.parallel = parallel
        self.context = context  # which tokens of a collated micro-batch this rank holds (split_micro_batch)
        self.experts = experts
        self.layer_loader = layer_loader
        self.chunk_ids = chunk_ids
        self.active_chunk = 0
        super().__init__(partition_method="explicit", **kwargs)
        # in a tuple: the Parameter itself as an attribute would be registered under the module's own name
        self.per_layer_norm = self.share_per_layer_norm()

    def share_per_layer_norm(self):
        """Gemma 4's per-layer-embedding norm, one weight every decoder layer reads and holds a copy of: one
        Parameter for this rank's layers (autograd sums their gradients into it), summed over the stages as a tied
        weight's (get_tied_weights_and_groups); () for any other model."""
        if not StageTuple(self.model_config).per_layer:
            return ()
        norms = [layer.per_layer_inputs.per_layer_projection_norm for layer in self.forward_funcs
                 if isinstance(layer, StageDecoder)]
        if not norms:
            raise ValueError(f"stage bounds {self.stage_bounds} leave a stage without decoder layers; with per-layer "
                             f"embeddings (hidden_size_per_layer_input) every stage must hold one: give each some.")
        for norm in norms[1:]:
            norm.weight = norms[0].weight
        return (norms[0].weight,)

    def get_tied_weights_and_groups(self):
        """DeepSpeed's tied weights and their groups, and Gemma 4's per-layer norm over the pipeline's stages
        (every stage holds decoder layers, each a copy of it)."""
        tied = super().get_tied_weights_and_groups()
        if self.per_layer_norm and self.num_stages > 1:
            tied.append((self.per_layer_norm[0], pipeline_grid(self).get_pipe_parallel_group()))
        return tied

    def _partition_layers(self, method="parameters"):
        # DeepSpeed's grid made the process groups just before this call, and the layers are built after it.
        self.parallel.group = pipeline_grid(self).get_slice_parallel_group()
        if self.chunk_ids is None:
            self.chunk_ids = [[stage] for stage in range(self.num_stages)]
        chunks = sorted(chunk for rank_chunks in self.chunk_ids for chunk in rank_chunks)
        if len(self.chunk_ids) != self.num_stages or chunks != list(range(len(self.stage_bounds) - 1)):
            raise ValueError(f"stage bounds {self.stage_bounds} are not the chunks {self.chunk_ids} of "
                             f"{self.num_stages} stages.")
        stage = self.topology().get_coord(self.global_rank).pipe
        self.chunk_layers = [range(self.stage_bounds[g], self.stage_bounds[g + 1]) for g in self.chunk_ids[stage]]
        self.layer_indices = [index for layers in self.chunk_layers for index in layers]
        set_partition(self, self.stage_bounds, stage)  # DeepSpeed's `parts`: the chunks' bounds
        set_layer_range(self, self.chunk_layers[0])

    def _build(self):
        """DeepSpeed's build of a contiguous range of layers, once per chunk: forward_funcs lists the chunks' layers
        in the rank's chunk order."""
        for layers in self.chunk_layers:
            set_layer_range(self, layers)
            super()._build()
        set_layer_range(self, self.chunk_layers[0])

    def stage_owner(self, layer_idx):
        """The pipeline stage (rank) holding a layer: DeepSpeed's tied groups are made from it."""
        chunk = next(g for g in range(len(self.stage_bounds) - 1)
                     if self.stage_bounds[g] <= layer_idx < self.stage_bounds[g + 1])
        return next(stage for stage, chunks in enumerate(self.chunk_ids) if chunk in chunks)

    def _index_tied_modules(self):
        """DeepSpeed's groups of the ranks sharing each tied weight, but for a weight on a single rank: nothing to
        synchronise or reduce."""
        return {key: comm for key, comm in super()._index_tied_modules().items() if len(comm["ranks"]) > 1}

    def forward(self, forward_input):
        """DeepSpeed's forward over a rank's one chunk; with several, the active chunk's layers, those of each
        block of activation_checkpoint_interval decoder layers checkpointed as DeepSpeed does."""
        if len(self.chunk_layers) == 1:
            return super().forward(forward_input)
        first = sum(len(layers) for layers in self.chunk_layers[:self.active_chunk])
        layers = self.forward_funcs[first:first + len(self.chunk_layers[self.active_chunk])]
        interval = self.activation_checkpoint_interval or len(layers)
        x = forward_input
        for start in range(0, len(layers), interval):
            block = functools.partial(run_layers, layers[start:start + interval])
            if self.activation_checkpoint_interval and all(isinstance(layer, StageDecoder)
                                                           for layer in layers[start:start + interval]):
                x = self.activation_checkpoint_func(block, *(x if isinstance(x, tuple) else (x,)))
            else:
                x = block(x)
        return x

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """DeepSpeed's file of a layer, named by its global index (local indices skip between chunks)."""
        return super().ckpt_layer_path(ckpt_dir, self.layer_indices[local_layer_idx] - self.layer_indices[0])

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        return super().ckpt_layer_path_list(ckpt_dir, self.layer_indices[local_layer_idx] - self.layer_indices[0])

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        """DeepSpeed's save of the stage's layer files, each file written by one rank from its own tensors
        (saved_parts): nothing is gathered, under expert parallelism each slice of the experts goes to a file of
        its own, and a tensor-parallel group writes its replicated tensors once."""
        for index, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            frozen = {name for name, param in layer.named_parameters() if not param.requires_grad}
            tensors = {key: tensor for key, tensor in layer.state_dict(keep_vars=True).items()
                       if not (exclude_frozen_params and key in frozen)}
            for part in self.saved_parts(save_dir, index, tensors):
                if part.writes:
                    checkpoint_engine.makedirs(save_dir, exist_ok=True)
                    checkpoint_engine.save(host_copies(part.tensors, checkpoint_engine), part.path)

    def saved_parts(self, save_dir, local_index, tensors, turn=0):
        """The SavedParts of a layer of this stage holding this rank's `tensors` ({key: tensor} of the layer's).
        The layer's file of this tensor-parallel rank holds its slices of the split tensors and, on rank 0 only,
        the replicated ones (the same on every rank of the group), written by data-parallel rank turn % dp. Under
        expert parallelism the experts' tensors go instead to the file of this rank's slice of them
        (models/layout.py expert_shard_file_name), written by replica turn % replicas of the ranks holding that
        slice: the post-init loader reads any expert-parallel size's slices from such files."""
        grid, experts = pipeline_grid(self), self.experts
        dp_rank, dp_size = grid.data_parallel_id, grid.data_parallel_size
        saved = {key: tensor for key, tensor in tensors.items()
                 if self.parallel.rank == 0 or getattr(tensor, "tensor_parallel_dim", None) is not None}
        shard = {key: tensor for key, tensor in saved.items() if experts.size > 1 and hasattr(tensor, "expert_slice")}
        layer = {key: tensor for key, tensor in saved.items() if key not in shard}
        writer = turn % dp_size
        parts = [SavedPart(self.ckpt_layer_path(save_dir, local_index), layer, grid.get_data_parallel_group(), writer,
                           dp_rank == writer)]
        if shard:
            writer = turn % (dp_size // experts.size)
            name = expert_shard_file_name(self.layer_indices[local_index], experts.rank, experts.size)
            parts.append(SavedPart(os.path.join(save_dir, name), shard, experts.replica_group, writer,
                                   dp_rank // experts.size == writer))
        return parts

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        """DeepSpeed's per-layer loading through layer_loader: each layer's files straight into its parameters
        (under tensor parallelism, this rank's slice)."""
        if self.layer_loader is None:
            return super().load_state_dir(load_dir, checkpoint_engine, strict)
        for index, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "load_state_dict"):  # a tied head's forward function: its weight is tied
                continue
            self.layer_loader(layer, self.ckpt_layer_path_list(load_dir, index), self.parallel.rank,
                              self.parallel.size, strict)
        synchronize_tied_weights(self)


class SavedPart(NamedTuple):
    """Tensors of a layer that one file of a checkpoint holds: the ranks of `group` (a process group) hold them
    alike, and its rank `writer` writes the file; writes: whether this rank is that writer."""
    path: str
    tensors: dict
    group: object
    writer: int
    writes: bool


def host_copies(tensors, checkpoint_engine):
    """A file's tensors as a synchronous torch.save takes them: each tensor's own bytes on the host (a parameter may
    be a view of ZeRO's flat buffer, whose whole storage torch.save would write); as they are for a background
    save's snapshot, which copies them itself (checkpoints/background_save.py)."""
    if not checkpoint_engine.preserves_storage_sharing():
        return {key: tensor.detach() for key, tensor in tensors.items()}
    return {key: tensor.detach().to("cpu", copy=True) for key, tensor in tensors.items()}


def run_layers(layers, *inputs):
    """Layers one after the other (a checkpointed block's function: it takes the tuple's tensors as arguments)."""
    x = inputs[0] if len(inputs) == 1 else inputs
    for layer in layers:
        x = layer(x)
    return x


def check_own_layers_parallelism(config, expert_parallel):
    """Refuse, in one line, expert parallelism for Gemma's own decoder layers (models/gemma3.py, gemma4.py) without
    experts to split: tensor parallelism (the attention, the MLP, the vocabulary; PLE and Gemma 4's MoE block on each
    rank's tokens), context parallelism (their attention core wrapped), expert parallelism of Gemma 4's experts,
    pipeline and data parallelism, ZeRO-1, bf16, checkpointing and packing train them."""
    if architecture_of(config).decoder == COMPOSED or architecture_of(config).moe or expert_parallel == 1:
        return
    raise ValueError(f"expert_parallel_size={expert_parallel}: {config.model_type}'s decoder layers have no experts to "
                     f"split; set it to 1.")


def build_pipeline_module(config, topology, stage_bounds=None, attention_impl="sdpa", activation_checkpoint_interval=0,
                          dtype=None, sequence_parallel=True, recompute_sequence_gather=False, layer_loader=None,
                          context_parallel_size=1, loss_chunk_tokens=0, grad_accum_dtype=None, lora=NO_LORA, seed=0,
                          objective=PreferenceSettings(), seq_length=None, row_layout="packed", chunk_ids=None,
                          expert_parallel_size=1, counts_step_loads=False, checkpoint_keeps_rows=True,
                          kept_in_fp32=frozenset()):
    """The pipeline module of this rank's stage, with the parallelism its topology and sizes ask for applied to its
    layers and the loss its objective takes.

    The topology (cluster/distributed.py) has a 'model' axis for tensor parallelism; context and expert parallelism
    take ranks of its data axis. The stage is built directly in the training dtype, so that a bf16 stage never exists
    in fp32 first; stage_bounds (default: the 'parameters' partition) and chunk_ids (several chunks per rank, see
    LlamaPipeline) say which layers it holds, and layer_loader how their files are read. LoRA's adapters are added
    to the built decoder layers, split like their projections, and everything else is frozen; row_layout (what the
    rows hold, data/collator.py) decides the masks, and seq_length the labels' width when they may be one wider than
    the rows (token shards). With counts_step_loads the router's loss also sums each step's expert loads, by which
    DeepSeek-V3's bias balancing moves the routers' biases. Under expert parallelism a checkpointed block keeps its
    sparse layers' routing and, with checkpoint_keeps_rows, their exchanged rows for the recomputation
    (models/expert_parallel.py KeptDispatch); kept_in_fp32 names the decoder layers' parameters kept in fp32 as their
    checkpoint stores them (models/pipeline_layers.py StagePlan)."""
    check_model_config(config)
    tp_size = max(1, topology.get_dim("model"))
    check_own_layers_parallelism(config, expert_parallel_size)
    rank = torch.distributed.get_rank()
    parallel = TensorParallel(tp_size, getattr(topology.get_coord(rank), "model", 0), sequence_parallel,
                              recompute_sequence_gather)
    context = build_context_parallel(topology, context_parallel_size)
    experts = build_expert_parallel(topology, expert_parallel_size)
    if stage_bounds is None:
        stage_bounds = partition_stages(config, topology.get_dim("pipe"))
    moe = architecture_of(config).moe
    router, moe_loss_sum = ((LoadBalancingLoss(config, parallel, counts_step_loads, context), moe.loss_sum)
                            if moe else (None, False))
    logit_cap = architecture_of(config).final_logit_softcapping  # Gemma's, inside the loss
    loss_fn = (PreferenceLoss(objective, parallel, loss_chunk_tokens, context, grad_accum_dtype, router, logit_cap)
               if objective.preference else CausalLMLoss(parallel, loss_chunk_tokens, context, grad_accum_dtype,
                                                     seq_length, router, logit_cap,
                                                     getattr(config, "mtp_loss_scale", 0.0)))
    previous_dtype = torch.get_default_dtype()
    # Under LoRA the frozen embedding's output takes no gradient: reentrant checkpointing of the first decoder layer
    # would then give its adapters none either. With an auxiliary loss's sum a stage has two floating outputs, which
    # DeepSpeed runs backward from one at a time: reentrant checkpointing frees its recomputation after the first.
    checkpoint = non_reentrant_checkpoint if lora.enabled or moe_loss_sum else checkpointing.checkpoint
    if experts.size > 1:  # a checkpointed block keeps its sparse layers' dispatch for the recomputation
        checkpoint = keeping_dispatch(checkpoint, checkpoint_keeps_rows)
    torch.set_default_dtype(dtype or previous_dtype)
    try:
        module = LlamaPipeline(config, stage_bounds, parallel, layer_loader, context, chunk_ids, experts,
                               layers=build_pipeline_layers(config, attention_impl, parallel, context,
                                                            chunked_loss=loss_chunk_tokens > 0,
                                                            row_layout=row_layout, experts=experts,
                                                            kept_in_fp32=kept_in_fp32),
                               topology=topology, loss_fn=loss_fn,
                               activation_checkpoint_interval=activation_checkpoint_interval,
                               # The embedding's input is integer ids: reentrant checkpointing of it would get no grad.
                               checkpointable_layers=[pipe.__name__ for pipe in DECODER_PIPES.values()],
                               activation_checkpoint_func=checkpoint)
        if lora.enabled:
            for local, layer in enumerate(module.forward_funcs):
                if isinstance(layer, StageDecoder):
                    add_adapters(layer, lora, config, parallel.size, parallel.rank, seed,
                                 module.layer_indices[local])
                    parallelize_adapters(layer, parallel)
            freeze_all_but_adapters(module)
        expert_params = [p for p in module.parameters() if hasattr(p, "expert_slice")]
        if experts.size > 1 and expert_params:
            use_deepspeed_expert_groups(module, expert_params, experts.name, moe.num_experts, experts.group,
                                        experts.ranks, experts.replica_group, experts.replica_ranks)
        return module
    finally:
        torch.set_default_dtype(previous_dtype)
