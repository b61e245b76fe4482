"""What one decoder layer costs on one rank per micro-batch, for each kind of decoder layer a model has
(models/partition.py decoder_kinds: all alike, a mixture of experts' dense layers apart from its sparse ones, a
hybrid's linear-attention layers apart from its full ones, Gemma's layers by type):
its parameters, its training FLOPs, what it keeps for backward, its backward's workspace, and what a micro-batch
waiting for its weight gradients keeps. planner/stage_costs.py builds stages from them, as its docstring describes
(tensor, sequence and context parallelism, checkpointing, schedules).

Attention is grouped-query (models/attention.py) or multi-head latent (models/latent_attention.py, MLA). What MLA keeps
for backward: the layer's normed input (its share of the tokens: the latent projections run on this rank's
tokens), each latent norm's fp32 input, inverse RMS and normed output, the latents as the head projections take
them (gathered under sequence parallelism), the queries and keys of this rank's heads, the keys' and values'
expansion (the values are a view of it), the attention output and the kernel's log-sum-exp: what the CUDA kernels
SDPA picks keep (memory-efficient or cuDNN attention, which take a value width other than the query's; flash's
layout of the output, which o_proj reads as a view). The latent (kv_lora_rank + qk_rope_head_dim a token) is what
crosses the tensor- and context-parallel groups, not what backward keeps: the expanded keys and values are kept, as
SDPA's backward needs them. On the CPU, whose flash kernel takes one width, SDPA falls back to its math path
instead, which keeps the scores.

A hybrid's linear-attention layer (Gated DeltaNet, Qwen3.5) is priced apart from its full-attention ones: its
projections, convolution and per-head state as parameters (models/partition.py linear_attention_parameters), its
convolution's and chunked rule's FLOPs in place of attention's (linear_attention_flops), and what it keeps for
backward measured from the layer itself: its forward run on the meta device at the micro-batch's shape (no memory,
no time to speak of), each storage autograd saves counted once (linear_attention_saved_bytes): the projections'
input and outputs, the convolution's, the rule's per-chunk systems, decays and the state entering every chunk, the
gated norm's, as the torch path keeps them (flash-linear-attention's kernels, on CUDA, recompute some of them and
keep less). Its full-attention layers are gated attention: each query head's gate beside it in q_proj.

A mixture of experts' sparse layer keeps what its MoE block saves beyond the dense layer's attention and norms
(moe_saved_bytes), and attention with sinks (GPT-OSS) always runs the eager formula, which keeps more than SDPA
(eager_attention_extra_bytes); tests/test_moe.py checks these against autograd's saved tensors.
"""
import functools

import torch

from models.architecture import GATED_ATTENTION, LINEAR_ATTENTION, architecture_of, head_dim_of, key_value_heads
from models.lora import adapter_parameter_count, expert_ranks
from models.partition import (decoder_kinds, decoder_parameter_split, expert_parameters, linear_attention_flops,
                              linear_attention_widths, mean_attended_keys)
from planner.training_state import FP32_BYTES

INT64_BYTES = 8


class DecoderCosts:
    """The costs of decoder layer `layer` (and of every layer of its kind) for one micro-batch of a workload; every
    figure is one rank's."""

    def __init__(self, config, workload, layer):
        self.config, self.workload = config, workload
        architecture = architecture_of(config)
        self.latent = architecture.latent_attention
        self.mixer = architecture.mixer_layers[layer]
        self.linear = self.mixer == LINEAR_ATTENTION
        t = workload.tensor_parallel
        tokens, residual, gathered = workload.tokens, workload.residual_tokens, workload.gathered_input_tokens
        hidden, act = config.hidden_size, workload.activation_bytes
        # this rank's query features, the keys' and values' it holds per token (MLA: its heads' keys), and the
        # values' its queries attend over (QK^T and PV: the FLOPs)
        self.heads = config.num_attention_heads // t
        if self.latent:
            self.q_width = self.kv_width = self.heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
            self.value_width = self.heads * config.v_head_dim
        else:
            # the layer's own widths: Gemma's sliding and full layers differ (head_dim, key/value heads)
            self.head_dim = head_dim_of(config, layer)
            self.q_width = self.value_width = config.num_attention_heads * self.head_dim // t
            self.kv_width = key_value_heads(config)[layer] * self.head_dim // t
        sparse = architecture.sparse_layers[layer]
        moe = architecture.moe if sparse else None
        inter = moe.shared_expert_size // t if moe else config.intermediate_size // t
        self.inter = inter
        sharded, replicated = decoder_parameter_split(config, layer)
        active_sharded, active_replicated = decoder_parameter_split(config, layer, active=True)
        lora = workload.lora
        self.adapters = adapter_parameter_count(config, lora, t, layer_index=layer)
        # Under expert parallelism this rank's slice of the experts, whose optimizer state ZeRO-1 shards over the
        # dp / ep ranks holding them (models/expert_parallel.py), as much per rank as every expert's over all dp ranks.
        experts = moe.num_experts * expert_parameters(moe, hidden) if moe else 0
        self.experts_not_held = experts - experts // workload.expert_parallel
        self.parameters = sharded // t + replicated - self.experts_not_held + self.adapters
        # The largest file of the layer a rank writes (models/pipeline.py saved_parts): the layer's part held on
        # this tensor-parallel rank (rank 0's, with the replicated tensors), or under expert parallelism the larger
        # of the rest and the rank's slice of the experts, a file of its own; under LoRA only the adapters are saved.
        held = experts - self.experts_not_held
        self.largest_file = (self.adapters if lora.enabled else max(held, self.parameters - held)
                             if workload.expert_parallel > 1 else self.parameters)
        self.largest_tensor = max(hidden * max(inter, self.q_width * (2 if self.mixer == GATED_ATTENTION else 1),
                                               linear_attention_widths(config)[2] if self.linear else 0),
                                  self.latent_largest_tensor(),
                                  2 * moe.num_experts * moe.expert_size * hidden // workload.expert_parallel
                                  if moe else 0)
        # Matmuls: 2 FLOPs per weight per token; causal attention: QK^T and PV over half the seq x seq scores
        # (fewer under sliding windows: the mean over the layers of this kind, Gemma's sliding ones apart from its
        # full ones). Norms and row-parallel biases (counted the same way), and MLA's latent projections, run on the
        # residual stream's tokens.
        kinds = decoder_kinds(config)
        self.matmul_flops = 2 * tokens * (active_sharded // t) + 2 * residual * active_replicated
        mixing = (tokens * linear_attention_flops(config) if self.linear else round(
            2 * tokens * mean_attended_keys(config, workload.seq_length, [i for i, kind in enumerate(kinds)
                                                                          if kind == kinds[layer]])
            * (self.q_width + self.value_width)))
        self.forward_flops = self.matmul_flops + mixing + 2 * tokens * self.adapters
        # 8 hidden-sized and 4 intermediate-sized tensors in the activation dtype, the two norms' fp32 inputs and
        # inverse RMS, and attention's (attention_saved_bytes). Of the hidden-sized ones, the norms' normalised
        # outputs are on the residual stream's tokens, the inputs of the column-parallel groups (q/k/v, gate/up) on
        # the gathered tokens.
        self.saved_bytes = (act * (2 * residual * hidden + gathered * hidden + 4 * tokens * inter)
                            + FP32_BYTES * residual * (2 * hidden + 2) + self.attention_saved_bytes())
        if architecture.norm_scale_in_fp32:  # OLMo 2's and GPT-OSS's layer norms keep an fp32 normalised output
            self.saved_bytes += 2 * residual * hidden * (FP32_BYTES - act)
        if architecture.offset_norms:  # the hybrids' (1 + w) norms keep their fp32 normalised input for the scale
            self.saved_bytes += 2 * residual * hidden * FP32_BYTES
        if moe:
            self.saved_bytes += moe_saved_bytes(moe, residual, hidden, act)
        if moe and lora.enabled:  # the folded copy of each adapted expert tensor, per micro-batch
            self.saved_bytes += lora_folded_expert_bytes(moe, hidden, act, expert_ranks(config, lora.target_modules,
                                                                                        lora.rank),
                                                         moe.num_experts // workload.expert_parallel)
        # A checkpointed block keeps, under expert parallelism, each sparse layer's dispatch for its recomputation
        # (models/expert_parallel.py KeptDispatch): with its rows, the received tokens (one per token and rank holding
        # one of its experts: at most, and counted as, a balanced share of the T x k choices) and the T x k rows come
        # back; its routing decision (T x k indices) is left out, as the router's own are.
        keeps_rows = moe and workload.expert_parallel > 1 and workload.checkpoint_keeps_rows
        self.checkpoint_kept_bytes = 2 * residual * moe.top_k * hidden * act if keeps_rows else 0
        if architecture.attention_sinks:
            self.saved_bytes += eager_attention_extra_bytes(workload, self.heads, self.q_width, self.kv_width, act)
        # LoRA keeps each adapter's rank-wide h (gathered for a column-parallel group) and, with dropout, its
        # dropped input and mask; the frozen projections' own inputs stay kept, for the adapters' A gradients.
        if lora.enabled:
            widths = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": self.value_width,
                      "gate_proj": hidden, "up_proj": hidden, "down_proj": inter, "q_a_proj": hidden,
                      "kv_a_proj_with_mqa": hidden, "q_b_proj": getattr(config, "q_lora_rank", None) or 0,
                      "kv_b_proj": getattr(config, "kv_lora_rank", 0)}  # MLA's projections: their inputs
            self.saved_bytes += sum(act * tokens * lora.rank + (tokens * widths[name] * (act + 1) if lora.dropout
                                                                 else 0) for name in lora.target_modules)
        # Gradients alive at once while the layer runs backward: its MLP and residual stream (two on this rank's
        # residual tokens, two on all tokens: a column group's input gradient, in the pool under sequence
        # parallelism, and a row-parallel output's gathered gradient); context parallelism adds the whole
        # sequence's key and value gradients (this rank's heads).
        pooled = 1 if workload.splits_sequence else 0
        gathered_kv_grads = 2 * workload.key_value_tokens * self.kv_width if workload.context_parallel > 1 else 0
        routed_inter = moe.top_k * residual * 2 * moe.expert_size if moe else 0  # a token's k experts' gate_up
        self.backward_bytes = act * (2 * tokens * inter + routed_inter + 2 * residual * hidden
                                     + (2 - pooled) * tokens * hidden + gathered_kv_grads)
        # A micro-batch waiting for its W (zero-bubble schedule) keeps each deferred linear layer's input and output
        # gradient (models/weight_grads.py), checkpointed or not: gate/up's input (gathered), down_proj's input,
        # gate, up and down's output gradients (all tokens, before the row-parallel reduction), and attention's; a
        # sparse layer's MLP is its shared expert (if any), its router and its experts (the shared expert keeps the
        # router's input, unless it keeps the gathered tokens instead).
        self.weight_grad_bytes = ((act * (gathered * hidden + tokens * (3 * inter + hidden)) if inter else 0)
                                  + self.attention_weight_grad_bytes())
        if moe:
            self.weight_grad_bytes += moe_weight_grad_bytes(moe, residual, hidden, act,
                                                            bool(inter) and gathered == residual)

    def latent_largest_tensor(self):
        """MLA's largest projection weight on this rank (0 for grouped-query attention)."""
        if not self.latent:
            return 0
        config, hidden = self.config, self.config.hidden_size
        return max(self.value_width * hidden,  # o_proj
                   config.kv_lora_rank * self.heads * (config.qk_nope_head_dim + config.v_head_dim),  # kv_b_proj
                   (config.q_lora_rank or hidden) * self.q_width,  # q_b_proj, or q_proj
                   hidden * (config.kv_lora_rank + config.qk_rope_head_dim),  # kv_a_proj_with_mqa
                   hidden * (config.q_lora_rank or 0))  # q_a_proj

    def attention_saved_bytes(self):
        """What attention keeps for backward beyond its input. Grouped-query: q (this rank's heads) and its output
        (o_proj's input, a view of it), k and v (this rank's key/value heads; SDPA's enable_gqa: not copied per
        query head; over the whole sequence under context parallelism), the kernel's log-sum-exp per head, and the
        q/k/v group's gathered input. MLA: the module docstring's list."""
        workload, config, act = self.workload, self.config, self.workload.activation_bytes
        tokens, residual, gathered = workload.tokens, workload.residual_tokens, workload.gathered_input_tokens
        architecture = architecture_of(config)
        if self.linear:
            return linear_attention_saved_bytes(config, workload.micro_batch_size,
                                                workload.seq_length // workload.context_parallel, act)
        if self.mixer == GATED_ATTENTION:  # q_proj's query and gate, the gate's sigmoid, the (1 + w) q/k head norms
            qk_width = self.q_width + self.kv_width
            return (act * (gathered * config.hidden_size + 4 * tokens * self.q_width
                           + 2 * workload.key_value_tokens * self.kv_width) + FP32_BYTES * tokens * self.heads
                    + tokens * ((2 * FP32_BYTES + act) * qk_width + FP32_BYTES * (qk_width // head_dim_of(config))))
        if not self.latent:
            saved = (act * (gathered * config.hidden_size + 2 * tokens * self.q_width
                            + 2 * workload.key_value_tokens * self.kv_width) + FP32_BYTES * tokens * self.heads)
            # Qwen3's per-head and OLMo 2's whole-projection q/k norms (on all tokens, this rank's heads) keep their
            # fp32 input and inverse RMS (per head, per token), and Qwen3's its normalised output, OLMo 2's its fp32
            # scaled one (OLMoE's scales after the cast: in the activation dtype).
            qk_width = self.q_width + self.kv_width
            if architecture.qk_norm == "head":
                saved += tokens * ((FP32_BYTES + act) * qk_width + FP32_BYTES * (qk_width // self.head_dim))
            elif architecture.qk_norm == "projection":
                scaled_bytes = FP32_BYTES if architecture.norm_scale_in_fp32 else act
                saved += tokens * ((FP32_BYTES + scaled_bytes) * qk_width + 2 * FP32_BYTES)
            return saved
        kv_rank, rope, q_rank = config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank or 0
        # each latent norm's fp32 input (in fp32 the projection's output itself: the key latent's with the rotary
        # part), inverse RMS and normed output
        norms = residual * (FP32_BYTES * (kv_rank + (rope if act == FP32_BYTES else 0) + 1) + act * kv_rank)
        if q_rank:
            norms += residual * (FP32_BYTES * (q_rank + 1) + act * q_rank)
        # q_proj's own gathered input, where sequence parallelism gathers one (the latent projections' is the share)
        q_input = gathered * config.hidden_size if not q_rank and workload.splits_sequence else 0
        heads = self.heads
        core = tokens * heads * (2 * (config.qk_nope_head_dim + rope) + config.qk_nope_head_dim
                                 + 2 * config.v_head_dim)  # q, k, the expansion (v's storage), the output
        return (act * (residual * config.hidden_size + q_input + gathered * (q_rank + kv_rank + rope) + core)
                + norms + FP32_BYTES * tokens * heads)

    def attention_weight_grad_bytes(self):
        """What attention's deferred weight gradients keep (models/weight_grads.py): grouped-query, q/k/v's gathered
        input and output gradients, o_proj's input and output gradient; MLA, the latent projections' input (this
        rank's share) and output gradients, the head projections' latent input (gathered) and output gradients,
        o_proj's."""
        workload, config, act = self.workload, self.config, self.workload.activation_bytes
        tokens, residual, gathered, hidden = (workload.tokens, workload.residual_tokens,
                                              workload.gathered_input_tokens, config.hidden_size)
        if self.linear:  # in_proj_qkv, _z, _b, _a (one input) and out_proj
            key, value, conv = linear_attention_widths(config)
            heads = config.linear_num_value_heads
            return act * (gathered * hidden + tokens * (conv + 2 * value + 2 * heads + hidden))
        if self.mixer == GATED_ATTENTION:
            return act * (gathered * hidden + tokens * (3 * self.q_width + 2 * self.kv_width + hidden))
        if not self.latent:
            return act * (gathered * hidden + tokens * (2 * self.q_width + 2 * self.kv_width + hidden))
        kv_rank, rope, q_rank = config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank or 0
        q_input = gathered * hidden if not q_rank and workload.splits_sequence else 0
        latents = (residual * hidden + q_input + residual * (q_rank + kv_rank + rope)
                   + gathered * (q_rank + kv_rank + rope))
        heads = self.heads * (config.qk_nope_head_dim + rope + config.qk_nope_head_dim + 2 * config.v_head_dim)
        return act * (latents + tokens * (heads + hidden))


def moe_saved_bytes(moe, tokens, hidden, act):
    """What an MoE block (models/moe.py) keeps for backward on the `tokens` it routes (its residual share), besides
    the dense layer's attention and norms (its shared expert counts as the dense MLP): per routed choice
    (tokens x top_k), the token's copy, its gate/up and down outputs and the SwiGLU's intermediates (GPT-OSS's
    clamped one keeps three more and each row's expert), the sort's two int64 indices (its order, each row's token)
    and the routing weight (fp32 in Mixtral); per token, the router's softmax (fp32) and top-k indices, with
    norm_topk_prob the top-k and their sum, GPT-OSS's softmax of the top-k instead, and with the load-balancing
    loss the softmax in the activation dtype and the fp32 mask; the grouped GEMM's two int32 offsets. Checked
    against autograd's saved tensors (tests/test_moe.py)."""
    routed = tokens * moe.top_k
    swiglu = 7 if moe.swiglu_limit is not None else 4  # intermediate-sized tensors per choice, gate/up's two included
    weight_bytes = act if moe.weights_in_logits_dtype and not moe.sigmoid_routing else FP32_BYTES
    per_choice = act * (2 * hidden + swiglu * moe.expert_size) + 2 * INT64_BYTES + weight_bytes \
        + (INT64_BYTES if moe.expert_bias else 0)
    if moe.softmax_after_topk:
        router = moe.top_k * (INT64_BYTES + act)
    else:  # DeepSeek-V3's: its sigmoid scores, and below fp32 the fp32 copy of its input
        router = FP32_BYTES * moe.num_experts + INT64_BYTES * moe.top_k + \
            (FP32_BYTES * (moe.top_k + 1) if moe.norm_topk_prob else 0) + \
            (FP32_BYTES * hidden if moe.sigmoid_routing and act != FP32_BYTES else 0)
    aux = act * moe.num_experts + FP32_BYTES if moe.aux_loss else 0
    # Qwen2-MoE's shared expert gate's sigmoid and the shared output
    shared_gate = act * (hidden + 1) if moe.shared_expert_size and moe.shared_expert_gated else 0
    return routed * per_choice + tokens * (router + aux + shared_gate) + 2 * 4 * moe.num_experts


def lora_folded_expert_bytes(moe, hidden, act, adapted, experts_held):
    """What LoRA on the experts (models/moe.py Experts.weight) keeps for backward beyond the adapters: each adapted
    fused projection (`adapted`: gate_up_proj, down_proj) folded, W + scaling B A for each of the `experts_held`
    experts, which the grouped GEMM keeps for its input gradient."""
    widths = {"gate_up_proj": 2 * moe.expert_size * hidden, "down_proj": moe.expert_size * hidden}
    return act * experts_held * sum(widths[name] for name in adapted)


def moe_weight_grad_bytes(moe, tokens, hidden, act, input_kept):
    """What a micro-batch waiting for its W (zero-bubble schedules, models/weight_grads.py) keeps of an MoE block on
    the `tokens` it routes: per routed choice the experts' inputs (the token's copy and the SwiGLU's output) and
    output gradients (gate/up's and down's), and with expert biases each row's expert; per token the router's
    logit gradient (fp32 in DeepSeek's sigmoid router) and its input, the block's (input_kept: already counted, as
    the shared expert's input) or DeepSeek's fp32 copy of it below fp32, Qwen2-MoE's shared gate's gradient; the
    grouped GEMM's two offsets."""
    routed = tokens * moe.top_k
    experts = routed * (act * (2 * hidden + 3 * moe.expert_size) + (INT64_BYTES if moe.expert_bias else 0)) \
        + 2 * 4 * moe.num_experts
    copied = moe.sigmoid_routing and act != FP32_BYTES
    router_input = FP32_BYTES * hidden if copied else 0 if input_kept else act * hidden
    logits = (FP32_BYTES if moe.sigmoid_routing else act) * moe.num_experts
    shared_gate = act if moe.shared_expert_size and moe.shared_expert_gated else 0
    return experts + tokens * (router_input + logits + shared_gate)


def eager_attention_extra_bytes(workload, heads, q_width, kv_width, act):
    """What attention with sinks (GPT-OSS, always the eager formula: models/attention_kernels.py) keeps beyond SDPA's: the keys
    and values repeated for every query head, and the scores with the sink column, their maximum and their
    softmax, instead of SDPA's log-sum-exp."""
    scores = workload.micro_batch_size * heads * workload.seq_length * (workload.seq_length + 1)
    return (act * (2 * workload.tokens * (q_width - kv_width) + 2 * scores
                   + workload.micro_batch_size * heads * workload.seq_length)
            - FP32_BYTES * workload.tokens * heads)


def linear_attention_saved_bytes(config, rows, seq, act):
    """What a Gated DeltaNet layer keeps for backward over a micro-batch of `rows` packed rows of `seq` tokens (its
    projections' input, the padding-masked hidden states, included): measured from its own forward on the meta device (models/decoder.py's layer of the config, in
    the activation dtype), each saved storage once, its weights left out."""
    widths = (config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
              config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim)
    return measured_linear_attention_bytes(widths, architecture_of(config).fused_linear_projections, rows, seq,
                                           torch.float32 if act == FP32_BYTES else torch.bfloat16)


@functools.lru_cache(maxsize=64)
def measured_linear_attention_bytes(widths, fused, rows, seq, dtype):
    from models.linear_attention import FusedGatedDeltaNet, GatedDeltaNet
    with torch.device("meta"):
        layer = (FusedGatedDeltaNet if fused else GatedDeltaNet)(*widths).to(dtype)
        hidden = torch.empty(rows, seq, widths[0], dtype=dtype, requires_grad=True)
        document_ids = torch.ones(rows, seq, dtype=torch.long)
    weights = {param.untyped_storage()._cdata for param in layer.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()  # on the meta device every data pointer is 0: the storage's own address
        if storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(hidden, document_ids)
    return sum(saved.values())
