"""Which pipeline layers each stage owns, and what the model computes, from its config alone (nothing is built).

Partition methods: DeepSpeed's `parameters` and `uniform`, `type:<regex>` (a case-insensitive search on layer class
names), an explicit list of decoder layers per stage, and `balanced`, which minimises the largest stage cost. What a
stage costs depends on the training run (optimizer state, micro-batches in flight, checkpointing), so `balanced`
takes that cost from the caller: planner/stage_costs.py's, the one the memory plan prints.
"""
import re

from deepspeed_internals.registry import partition_balanced, partition_uniform
from models.layout import num_pipeline_layers
import torch

from models.architecture import COMPOSED, GATED_ATTENTION, LINEAR_ATTENTION, architecture_of, head_dim_of
from models.decoder import decoder_layer
from models.lora import NO_LORA, adapter_parameter_total
from models.multi_token_prediction import mtp_layout_of
from schedules.rules import chunk_ids, chunks_per_rank

EMBEDDING, DECODER, NORM, HEAD = "embedding", "decoder", "norm", "head"
DENSE_DECODER = "dense_decoder"  # a dense layer of a model that mixes them with sparse ones
LINEAR_PREFIX = "linear_"  # a hybrid's linear-attention layer of either kind: linear_decoder, linear_dense_decoder
DECODERS = (DECODER, DENSE_DECODER, LINEAR_PREFIX + DECODER, LINEAR_PREFIX + DENSE_DECODER)


def decoder_kinds(config):
    """The kind of each decoder layer: DECODER, but DENSE_DECODER for the dense layers of a mixture of experts that
    mixes them with sparse ones (DeepSeek-V3's first_k_dense_replace, Qwen-MoE's mlp_only_layers), which cost less;
    a hybrid's linear-attention layers (Qwen3.5's Gated DeltaNet) prefixed linear_, costed apart from its full
    attention ones."""
    architecture = architecture_of(config)
    sparse = architecture.sparse_layers
    mixed = any(sparse) and not all(sparse)
    return [(LINEAR_PREFIX if mixer == LINEAR_ATTENTION else "") + (DENSE_DECODER if mixed and not layer_sparse
                                                                    else DECODER)
            for layer_sparse, mixer in zip(sparse, architecture.mixer_layers)]


def layer_kinds(config):
    """Layer kind of every pipeline index (models/layout.py's map)."""
    return [EMBEDDING] + decoder_kinds(config) + [NORM, HEAD]


def kind_layer(config, kind):
    """The decoder layer whose costs a decoder kind takes: the first of its kind (the first sparse one of an MoE
    model's DECODER)."""
    kinds = decoder_kinds(config)
    return planned_decoder(config) if kinds[planned_decoder(config)] == kind else kinds.index(kind)


def stage_kinds(stage, num_stages, num_decoders, decoders=None):
    """The layer kinds of a stage holding num_decoders decoder layers: decoders (the kinds of the model's decoder
    layers from the stage's first, default all DECODER), the embedding joining the first stage, the final norm and
    the head the last."""
    kinds = list(decoders[:num_decoders]) if decoders is not None else [DECODER] * num_decoders
    if stage == 0:
        kinds = [EMBEDDING] + kinds
    if stage == num_stages - 1:
        kinds = kinds + [NORM, HEAD]
    return kinds


def counts_kinds(counts, decoders):
    """The layer kinds of every stage (or chunk) holding counts[s] decoder layers of the model's `decoders` kinds,
    in order."""
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    return [stage_kinds(stage, len(counts), count, decoders[start:]) for stage, (start, count) in
            enumerate(zip(starts, counts))]


def decoder_parameter_split(config, layer=None, active=False):
    """A decoder layer's parameters as (sharded, replicated) under tensor parallelism: the projections' weights
    (Phi-3's fused ones as many), the column-parallel biases (q, k, v, gate, up), OLMo 2's whole-projection q/k
    norms and GPT-OSS's sinks split over the ranks; the two norms, Qwen3's per-head q/k norms and the row-parallel
    biases (o, down) are whole on every rank, as are an MoE layer's router and experts (models/moe.py), a
    Qwen2-MoE shared expert splitting like the dense MLP. layer: the decoder layer (None: the first sparse one of an
    MoE model, which the planner takes for every layer; a dense one among them is smaller). active: the weights a
    token runs through (its top_k experts of num_experts), which its FLOPs count; else all."""
    architecture = architecture_of(config)
    if architecture.decoder != COMPOSED:
        return own_layer_parameter_split(config, planned_decoder(config) if layer is None else layer, active)
    hidden = config.hidden_size
    sparse = architecture.sparse_layers[planned_decoder(config) if layer is None else layer]
    inter = 0 if sparse else config.intermediate_size
    sharded, replicated = attention_parameter_split(config, planned_decoder(config) if layer is None else layer)
    sharded += 3 * hidden * inter
    replicated += 2 * hidden
    if architecture.mlp_bias:
        sharded += 2 * inter
        replicated += hidden
    if sparse:
        moe = architecture.moe
        replicated += moe.num_experts * (hidden + moe.router_bias) + \
            (moe.top_k if active else moe.num_experts) * expert_parameters(moe, hidden)
        if moe.shared_expert_size:
            sharded += 3 * hidden * moe.shared_expert_size
            replicated += hidden if moe.shared_expert_gated else 0  # Qwen2-MoE's gate
    return sharded, replicated


def own_layer_parameter_split(config, layer, active=False):
    """decoder_parameter_split of a family with decoder layers of its own (Gemma 3's and 4's, whose layers differ
    by type: sliding or full, storing or reusing keys and values, their share of the per-layer embeddings), counted
    on the layer built on the meta device: its matrices sharded, but Gemma 4's router and experts, whole on every
    rank as an MoEBlock's (models/tensor_parallel.py gemma4_moe_plan; the experts as a token runs through them when
    active), replicated with the vectors (norms, the router's scales)."""
    with torch.device("meta"):
        module = decoder_layer(config, layer)
    sharded = replicated = 0
    for name, param in module.named_parameters():
        if name.startswith("experts."):
            moe = architecture_of(config).moe
            replicated += int(param.numel() * (moe.top_k / moe.num_experts if active else 1))
        elif param.dim() < 2 or name.startswith("router."):
            replicated += param.numel()
        else:
            sharded += param.numel()
    return sharded, replicated


def attention_parameter_split(config, layer=0):
    """Decoder layer `layer`'s token mixer's parameters as (sharded, replicated) under tensor parallelism (see
    decoder_parameter_split). Multi-head latent attention (models/latent_attention.py): the head projections
    (q_b_proj or q_proj, kv_b_proj, o_proj) split, the latent projections and their norms whole. A hybrid's linear
    attention (linear_attention_parameters) and gated attention (a query and a gate per head in q_proj, per-head
    q/k norms)."""
    architecture = architecture_of(config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    mixer = architecture.mixer_layers[layer]
    if mixer == LINEAR_ATTENTION:
        return linear_attention_parameters(config), 0
    if mixer == GATED_ATTENTION:
        kv_heads, head_dim = config.num_key_value_heads or heads, head_dim_of(config)
        return hidden * head_dim * (3 * heads + 2 * kv_heads), 2 * head_dim
    if architecture.latent_attention:
        qk_width, bias = config.qk_nope_head_dim + config.qk_rope_head_dim, bool(config.attention_bias)
        kv_rank, q_rank = config.kv_lora_rank, config.q_lora_rank
        sharded = heads * (kv_rank * (config.qk_nope_head_dim + config.v_head_dim) + config.v_head_dim * hidden)
        replicated = (hidden + bias) * (kv_rank + config.qk_rope_head_dim) + kv_rank + bias * hidden
        if q_rank is None:
            return sharded + hidden * heads * qk_width, replicated
        return sharded + q_rank * heads * qk_width, replicated + (hidden + bias) * q_rank + q_rank
    kv_heads = config.num_key_value_heads or heads
    head_dim = head_dim_of(config)
    sharded, replicated = hidden * head_dim * (2 * heads + 2 * kv_heads), 0
    if architecture.qkv_bias:
        sharded += head_dim * (heads + 2 * kv_heads)
    if architecture.o_bias:
        replicated += hidden
    if architecture.qk_norm == "head":
        replicated += 2 * head_dim
    elif architecture.qk_norm == "projection":
        sharded += head_dim * (heads + kv_heads)
    if architecture.attention_sinks:
        sharded += heads
    return sharded, replicated


def linear_attention_widths(config):
    """(key features: q's, and k's, all heads; value features; the convolution's channels, q|k|v) of a hybrid's
    linear attention."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    return key, value, 2 * key + value


def linear_attention_parameters(config):
    """Gated DeltaNet's parameters (models/linear_attention.py): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (or
    Qwen3-Next's fused in_proj_qkvz, in_proj_ba: as many), the depthwise convolution, dt_bias and A_log per value
    head, the gated norm's weight, out_proj; counted as split over the tensor-parallel ranks by head (the gated
    norm's head_dim weights, whole on every rank, among them)."""
    _, value, conv = linear_attention_widths(config)
    heads, hidden = config.linear_num_value_heads, config.hidden_size
    return (hidden * (conv + value + 2 * heads) + conv * config.linear_conv_kernel_dim + 2 * heads
            + config.linear_value_head_dim + value * hidden)


def linear_attention_flops(config):
    """Forward FLOPs of one token through Gated DeltaNet's convolution and chunked rule (models/gated_delta_rule.py),
    its projections left out (counted as weights): per value head, the chunk's products of its query and key with
    the chunk's keys, its solved betas' values and keys, its output over the chunk's new values (2 x chunk x (2 key
    + 2 value features)), and its three products with the state (2 x 3 x key x value features); the convolution's
    taps over every channel."""
    from models.gated_delta_rule import CHUNK_SIZE
    key, value = config.linear_key_head_dim, config.linear_value_head_dim
    per_head = 2 * CHUNK_SIZE * (2 * key + 2 * value) + 6 * key * value
    return config.linear_num_value_heads * per_head + 2 * config.linear_conv_kernel_dim * linear_attention_widths(
        config)[2]


def attention_head_widths(config, layer=0):
    """(a query or key head's features, a value head's) of decoder layer `layer`: head_dim both (Gemma 4's full
    layers' their own), or multi-head latent attention's qk_nope_head_dim + qk_rope_head_dim and v_head_dim."""
    if architecture_of(config).latent_attention:
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return head_dim_of(config, layer), head_dim_of(config, layer)


def expert_parameters(moe, hidden):
    """One expert's parameters: its gate, up and down projections (and GPT-OSS's biases)."""
    return 3 * hidden * moe.expert_size + (2 * moe.expert_size + hidden if moe.expert_bias else 0)


def planned_decoder(config):
    """The decoder layer the cost model takes for every one: the first sparse layer of an MoE model, else the first;
    of a family whose layers differ by type (Gemma's sliding and full layers, Gemma 4's reusing ones with their
    double-wide MLP), its largest, so that every layer's costs are at most those priced."""
    if architecture_of(config).decoder != COMPOSED:
        sizes = [sum(own_layer_parameter_split(config, layer)) for layer in range(config.num_hidden_layers)]
        return sizes.index(max(sizes))
    sparse = architecture_of(config).sparse_layers
    return sparse.index(True) if any(sparse) else 0


def mean_attended_keys(config, seq_length):
    """Keys a query attends, averaged over a sequence's queries and the decoder layers: seq_length / 2 under the
    causal mask (the cost model's convention), less the keys a layer's sliding window cuts off (the triangle of
    (seq_length - window)^2 / 2 scores past it)."""
    def keys(window):
        beyond = max(0, seq_length - window) if window else 0
        return seq_length / 2 - beyond ** 2 / (2 * seq_length)
    architecture = architecture_of(config)
    attending = [window for window, mixer in zip(architecture.sliding_windows, architecture.mixer_layers)
                 if mixer != LINEAR_ATTENTION]  # a hybrid's linear attention attends no keys (linear_attention_flops)
    return sum(keys(window) for window in attending) / len(attending)


def layer_parameter_counts(config):
    """Parameters of each pipeline layer, from the config alone (a tied LM head counts 0: the embedding owns it; the
    final norm's layer holds a trained MTP layer)."""
    embedding = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embedding
    decoders = [sum(decoder_parameter_split(config, layer)) for layer in range(config.num_hidden_layers)]
    return [embedding] + decoders + [config.hidden_size + sum(mtp_parameter_split(config)), head]


def mtp_decoder(config):
    """(the config, index) the MTP layer a run trains (mtp_loss_scale > 0) builds its decoder layer as
    (models/multi_token_prediction.py); None for a run that does not train one."""
    if not getattr(config, "mtp_loss_scale", 0.0) > 0:
        return None
    return mtp_layout_of(config).layer_config(config)


def mtp_parameter_split(config):
    """The trained MTP layer's parameters as (sharded, replicated) under tensor parallelism ((0, 0) without one):
    its decoder layer's (decoder_parameter_split), and its projection of [embedding | hidden] (2 h x h) and three
    norms, whole on every rank (models/pipeline_layers.py StagePlan.multi_token_prediction)."""
    layer = mtp_decoder(config)
    if layer is None:
        return 0, 0
    sharded, replicated = decoder_parameter_split(*layer)
    return sharded, replicated + 2 * config.hidden_size ** 2 + 3 * config.hidden_size


def training_flops_per_token(config, seq_length, lora=NO_LORA):
    """Model FLOPs of one training token (forward + backward = 3 x forward, recomputation not counted), the figure
    MFU divides by the device's peak: 2 per weight per token for every decoder weight and the LM head (the
    embedding is a gather), plus attention's QK^T and PV, 2 x seq_length x heads x (query/key + value head widths:
    2 x head_dim, or MLA's) per token and layer over all seq_length x seq_length scores (PaLM's convention, as published MFU figures and
    torch.utils.flop_counter count it; the planner's cost model instead counts only the causal half), over a
    layer's sliding window where it is shorter. An MoE layer's weights count as a token runs through them: the
    router and its top_k experts. Under LoRA
    the frozen weights' backward computes input gradients only (2 x forward becomes 1 x), and the adapters count
    like any trained weight (the experts' as a token runs through them)."""
    matmul_weights = sum(sum(decoder_parameter_split(config, layer, active=True))
                         for layer in range(config.num_hidden_layers)) + config.vocab_size * config.hidden_size
    architecture = architecture_of(config)
    mixers = architecture.mixer_layers
    attention = sum(2 * min(seq_length, window or seq_length) * config.num_attention_heads
                    * sum(attention_head_widths(config, layer))
                    for layer, (window, mixer) in enumerate(zip(architecture.sliding_windows, mixers))
                    if mixer != LINEAR_ATTENTION)
    if LINEAR_ATTENTION in mixers:
        attention += mixers.count(LINEAR_ATTENTION) * linear_attention_flops(config)
    if not lora.enabled:
        return 3 * (2 * matmul_weights + attention)
    adapters = adapter_parameter_total(config, lora, active=True)
    return 2 * 2 * matmul_weights + 3 * (attention + 2 * adapters)


def balanced_decoder_counts(num_hidden_layers, num_stages, stage_cost, decoders=None):
    """Decoder layers per stage minimising the largest stage_cost(stage, kinds). decoders: the kind of each decoder
    layer (decoder_kinds; None: all alike).

    Where decoder layers are identical the partition is a count per stage, and adding layers one at a time to the
    stage whose cost after the addition is smallest minimises the maximum (every stage's cost rises with its
    count). Ties go to the stage nearest the middle: first and last stages carry the embedding, the head and the
    most micro-batches in flight, so a spare layer belongs in between. Every stage gets at least one layer. Where
    they differ (dense layers among sparse ones), balanced_mixed_counts.
    """
    if not 1 <= num_stages <= num_hidden_layers:
        raise ValueError(f"{num_stages} stages for {num_hidden_layers} decoder layers: need 1 to "
                         f"{num_hidden_layers} stages.")
    if decoders is not None and len(set(decoders)) > 1:
        return balanced_mixed_counts(decoders, num_stages, stage_cost)
    counts = [1] * num_stages
    middle = (num_stages - 1) / 2
    for _ in range(num_hidden_layers - num_stages):
        stage = min(range(num_stages),
                    key=lambda s: (stage_cost(s, stage_kinds(s, num_stages, counts[s] + 1)), abs(s - middle)))
        counts[stage] += 1
    return counts


def balanced_mixed_counts(decoders, num_stages, stage_cost):
    """balanced_decoder_counts for decoder layers of different kinds: adding a layer to a stage moves the layers of
    every later one, so each stage's run of layers is chosen together, by dynamic programming over (stages, layers):
    exactly the smallest largest cost, and among those, the one with the smallest sum of squared stage compute
    (an even spread). A stage's cost rises with its layers, which bounds the search."""
    layers = len(decoders)

    def cost(stage, first, end):  # stage holding decoder layers first .. end - 1
        return stage_cost(stage, stage_kinds(stage, num_stages, end - first, decoders[first:]))
    best = {0: ((0, 0), 0.0, [])}  # layers held by the stages so far: (largest cost, sum of squares, counts)
    for stage in range(num_stages):
        reached = {}
        for end in range(stage + 1, layers - (num_stages - stage - 1) + 1):
            options = []
            for first in range(end - 1, stage - 1, -1):
                if first not in best:
                    continue
                largest, squares, counts = best[first]
                own = cost(stage, first, end)
                if options and own > min(options)[0]:
                    break  # more layers on this stage only cost more
                options.append((max(largest, own), squares + own[1] ** 2, counts + [end - first]))
            reached[end] = min(options, key=lambda option: option[:2])
        best = reached
    return best[layers][2]


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


def decoder_counts_of_bounds(bounds):
    """The explicit partition (decoder layers per stage) of stage bounds over [embedding, decoders, norm, head]."""
    last_decoder = bounds[-1] - 3
    return [len(range(max(start, 1), min(stop, last_decoder + 1))) for start, stop in zip(bounds, bounds[1:])]


def stage_bounds(config, num_stages, partition, layer_class_names, stage_cost=None):
    """Stage boundaries (pipeline layer indices, DeepSpeed's `parts`) for every partition method.

    partition: 'balanced' (needs stage_cost(stage, kinds)), 'parameters' (parameter counts), DeepSpeed's 'uniform'
    and 'type:<regex>' (on layer_class_names, in pipeline order), or a list of decoder layers per stage.
    """
    # DeepSpeed's partitioners return numpy integers; bounds go into checkpoints' JSON.
    return [int(bound) for bound in partition_bounds(config, num_stages, partition, layer_class_names, stage_cost)]


def partition_bounds(config, num_stages, partition, layer_class_names, stage_cost):
    if not isinstance(partition, str):
        if len(partition) != num_stages:
            raise ValueError(f"partition {list(partition)} has {len(partition)} entries for {num_stages} stages.")
        return stage_bounds_from_decoder_counts(partition, config.num_hidden_layers)
    method = partition.lower()
    if method == "balanced":
        if stage_cost is None:
            raise ValueError("partition 'balanced' needs a stage cost (planner/stage_costs.py: balanced_stage_cost).")
        counts = balanced_decoder_counts(config.num_hidden_layers, num_stages, stage_cost, decoder_kinds(config))
        return stage_bounds_from_decoder_counts(counts, config.num_hidden_layers)
    if method == "parameters":
        return partition_balanced(layer_parameter_counts(config), num_stages)
    if method == "uniform":
        return partition_uniform(num_pipeline_layers(config.num_hidden_layers), num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        matches = [1 if pattern.search(name) else 0 for name in layer_class_names]
        if not any(matches):
            raise ValueError(f"partition '{partition}' matches none of the layer classes {sorted(set(layer_class_names))}.")
        return partition_balanced(matches, num_stages)
    raise ValueError(f"partition '{partition}' is not one of balanced, parameters, uniform, type:<regex> or a "
                     f"list of decoder layers per stage.")


def chunk_bounds(config, num_stages, partition, layer_class_names, chunk_cost=None, schedule="1f1b",
                 virtual_stages=1):
    """Layer bounds of every global chunk (pipeline layer indices; chunk g is layers bounds[g]..bounds[g+1]-1):
    the model split into num_stages x chunks per rank (v under interleaved_1f1b, 2 under zbv) as stage_bounds splits
    it into stages, the embedding on chunk 0 and the final norm and head on the last chunk (rank 0's under zbv,
    schedules/rules.py's chunk_ids). A list partition gives one entry per chunk."""
    return stage_bounds(config, num_stages * chunks_per_rank(schedule, virtual_stages), partition, layer_class_names,
                        chunk_cost)


def rank_chunk_layers(bounds, schedule, num_stages, rank, virtual_stages=1):
    """[(first pipeline layer, end) of each of a rank's local chunks, in local order] of chunk_bounds' bounds."""
    return [(bounds[chunk], bounds[chunk + 1]) for chunk in chunk_ids(schedule, num_stages, rank, virtual_stages)]
