"""Gemma 4's text model as plain parts for one device, under transformers' names (a decoder layer's state dict is
the Hugging Face one after `model.layers.{i}.`), computing what transformers 5.24's modeling_gemma4.py computes.
Where it differs from Gemma 3 (models/gemma3.py), which it resembles:

- every RMSNorm scales by plain w (weight initialised to ones), x * (mean(x^2) + eps) ** -0.5 in fp32;
- attention scales its scores by 1.0; q, k and v each take a per-head norm, v's without a weight; the full layers
  have their own head_dim (global_head_dim), their own key/value head count (num_global_key_value_heads, with
  attention_k_eq_v) and Gemma 4's proportional partial rotary embedding (models/layer_types.py); with
  attention_k_eq_v a full layer has no v_proj and its values are the raw k_proj output, before k's norm and rotary;
- the last num_kv_shared_layers layers compute no keys or values: each reuses those of the last earlier layer of its
  type (kv_sources). The part takes and returns them explicitly, so that in a pipeline they travel between stages;
  a reusing layer's MLP is twice as wide with use_double_wide_mlp;
- per-layer embeddings (PLE): a per-layer input of hidden_size_per_layer_input features for every token and layer
  (PerLayerInputs), which each layer gates into its residual stream after the MLP;
- each layer's output is multiplied by its layer_scalar (a buffer of the checkpoint, not trained);
- with enable_moe_block, a mixture of experts beside the dense MLP: a router on the residual stream (a weightless
  norm, a learned scale, hidden_size ** -0.5, softmax in fp32, top-k renormalised, times a per-expert scale),
  experts on their own pre-norm, and the dense and expert outputs each normed before they are summed;
- the final logits are soft-capped (final_logit_softcapping: models/gemma3.py's soft_cap).
"""
import torch
from torch import nn
from torch.nn import functional as F

from models.architecture import ACTIVATIONS, MixtureOfExperts, check_gemma_line
from models.attention import AttentionCore
from models.attention_kernels import apply_rotary
from models.gated_mlp import GatedMLP
from models.gemma3 import ScaledEmbedding
from models.moe import LOCAL_EXPERTS, Experts


def kv_sources(config):
    """{layer that reuses keys and values: the layer that computes them}: each of the last num_kv_shared_layers
    layers reuses the last layer of its type before them (transformers' kv_sharing_modes 'reuse' and 'store')."""
    modes = config.kv_sharing_modes
    stores = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return {i: stores[config.layer_types[i]] for i, mode in enumerate(modes) if mode == "reuse"}


class Gemma4RMSNorm(nn.Module):
    """transformers' Gemma4RMSNorm: x * (mean(x^2) + eps) ** -0.5 in fp32, times w in fp32 where it has one (v's
    norm and the router's have none), cast back."""

    def __init__(self, dim, eps, with_scale=True):
        super().__init__()
        self.eps = eps
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):  # a layer built on the meta device is initialised by it (tensor or expert parallelism)
        if hasattr(self, "weight"):
            nn.init.ones_(self.weight)

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if hasattr(self, "weight"):
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4Attention(nn.Module):
    """Attention of decoder layer `layer_index`, sliding or full by its layer type.

    forward(hidden [batch, seq, hidden], cos, sin [batch, seq, head_dim] of the layer's type, mask of its type's
    window or None for causal, shared_kv=None) -> (output [batch, seq, hidden], key_value).

    key_value is (keys, values), each [batch, kv_heads, seq, head_dim], normed and keys rotated: what this layer
    attended with, for the layers that reuse them (`stores_kv`); None from a layer that reuses another's
    (`reuses_kv`, its source `kv_source`), which must be given them as shared_kv. Gradients reach the source layer's
    projections through them. Its scores are scaled by 1.0 in its `core` (models/attention.py AttentionCore), the seam
    context parallelism wraps: under it, keys and values are this rank's tokens', given and returned so."""

    def __init__(self, config, layer_index, attention_impl="sdpa"):
        super().__init__()
        layer_config = config.per_layer_config[layer_index]
        self.layer_index = layer_index
        self.layer_type = config.layer_types[layer_index]
        sliding = self.layer_type == "sliding_attention"
        self.window = config.sliding_window if sliding else None
        self.head_dim = layer_config.head_dim
        self.core = AttentionCore(attention_impl, 1.0)
        mode = config.kv_sharing_modes[layer_index]
        self.reuses_kv, self.stores_kv = mode == "reuse", mode == "store"
        self.kv_source = kv_sources(config).get(layer_index)
        self.values_are_keys = config.attention_k_eq_v and not sliding
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        kv_width = layer_config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        if not self.reuses_kv:  # as transformers: a reusing layer has no key or value weights at all
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
            self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
            if not self.values_are_keys:
                self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)

    def forward(self, hidden, cos, sin, mask, shared_kv=None):
        if self.reuses_kv != (shared_kv is not None):
            raise ValueError(f"layer {self.layer_index} " + (
                f"reuses layer {self.kv_source}'s keys and values: pass them as shared_kv." if self.reuses_kv else
                "computes its own keys and values: pass no shared_kv."))
        batch, seq = cos.shape[:2]  # the rows' shape, also where hidden is their tokens flattened (tensor parallel)
        heads = (batch, seq, -1, self.head_dim)
        q = apply_rotary(self.q_norm(self.q_proj(hidden).view(heads)).transpose(1, 2), cos, sin)
        key_value = None
        if self.reuses_kv:
            k, v = shared_kv
        else:
            keys = self.k_proj(hidden).view(heads)
            values = keys if self.values_are_keys else self.v_proj(hidden).view(heads)
            k = apply_rotary(self.k_norm(keys).transpose(1, 2), cos, sin)
            v = self.v_norm(values).transpose(1, 2)
            key_value = (k, v)
        out = self.core(q, (k, v), mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), key_value


class Gemma4Router(nn.Module):
    """The router of a Gemma 4 MoE layer, `router.*`: forward(hidden [tokens, hidden]) -> (probabilities [tokens,
    experts] fp32, routing weights [tokens, k] fp32, expert ids [tokens, k] int64)."""

    def __init__(self, config):
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.root_scale = hidden ** -0.5
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def reset_parameters(self):  # its own tensors after a build on the meta device; proj has its own
        nn.init.ones_(self.scale)
        nn.init.ones_(self.per_expert_scale)

    def forward(self, hidden):
        scores = self.proj(self.norm(hidden) * self.scale * self.root_scale)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probabilities, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return probabilities, weights * self.per_expert_scale[expert_ids], expert_ids


def gemma4_experts(config):
    """A Gemma 4 MoE layer's experts, `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
    `experts.down_proj` [E, H, I] as transformers stores them, GeGLU between: models/moe.py's Experts (the same
    fused experts as the other MoE families'), all of them: expert parallelism splits them from outside."""
    moe = MixtureOfExperts(num_experts=config.num_experts, top_k=config.top_k_experts,
                           expert_size=config.moe_intermediate_size)
    return Experts(moe, config.hidden_size, ACTIVATIONS[config.hidden_activation], 0, config.num_experts)


class Gemma4DecoderLayer(nn.Module):
    """Decoder layer `layer_index`.

    forward(hidden [batch, seq, hidden], cos, sin, mask, per_layer_input=None, shared_kv=None)
        -> (hidden, key_value, expert_ids)

    cos, sin and mask are those of the layer's type (`layer_type`, `window`; models/layer_types.py builds them once
    per micro-batch). per_layer_input [batch, seq, hidden_size_per_layer_input]: this layer's slice of
    PerLayerInputs' output, required where the config has per-layer embeddings (`per_layer_width` > 0).
    shared_kv and key_value: as Gemma4Attention's (`reuses_kv`, `stores_kv`, `kv_source`).

    An MoE layer's experts are run by its `dispatcher` (models/moe.py's seam, which expert parallelism replaces from
    outside: LOCAL_EXPERTS runs them all here); expert_ids [tokens, top_k] are the experts each token was routed to
    (None on a layer without the MoE block), for the routing counts: transformers computes no auxiliary loss for
    Gemma 4."""

    def __init__(self, config, layer_index, attention_impl="sdpa"):
        super().__init__()
        check_gemma_line(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_index, attention_impl)
        attention = self.self_attn
        self.layer_type, self.window = attention.layer_type, attention.window
        self.reuses_kv, self.stores_kv, self.kv_source = attention.reuses_kv, attention.stores_kv, attention.kv_source
        double_wide = config.use_double_wide_mlp and self.reuses_kv
        self.mlp = GatedMLP(hidden, config.intermediate_size * (2 if double_wide else 1), config.hidden_activation)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer_width = config.hidden_size_per_layer_input or 0
        if self.per_layer_width:
            self.act_fn = ACTIVATIONS[config.hidden_activation]
            self.per_layer_input_gate = nn.Linear(hidden, self.per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer_width, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.moe = config.enable_moe_block
        if self.moe:
            self.router = Gemma4Router(config)
            self.experts = gemma4_experts(config)
            self.dispatcher = LOCAL_EXPERTS
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)

    def reset_parameters(self):
        """The layer's own buffer, layer_scalar, at one, where the layer was built on the meta device (tensor or expert
        parallelism); the checkpoint's value is loaded over it. Its parts initialise themselves."""
        nn.init.ones_(self.layer_scalar)

    def forward(self, hidden, cos, sin, mask, per_layer_input=None, shared_kv=None):
        attention, key_value = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, shared_kv)
        hidden = hidden + self.post_attention_layernorm(attention)
        feedforward = self.mlp(self.pre_feedforward_layernorm(hidden))
        expert_ids = None
        if self.moe:
            experts, expert_ids = self.mixture_of_experts(hidden)
            feedforward = self.post_feedforward_layernorm_1(feedforward) + self.post_feedforward_layernorm_2(experts)
        hidden = hidden + self.post_feedforward_layernorm(feedforward)
        if self.per_layer_width:
            gated = self.act_fn(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar, key_value, expert_ids

    def mixture_of_experts(self, residual):
        """(the experts' output for the residual stream before the feedforward, shaped as it; the expert ids
        [tokens, top_k] each token was routed to): routed from the residual, each expert's input its own pre-norm of
        it."""
        tokens = residual.reshape(-1, residual.shape[-1])
        _, weights, expert_ids = self.router(tokens)
        out = self.dispatcher(self.pre_feedforward_layernorm_2(tokens), expert_ids, weights, self.experts)
        return out.view_as(residual), expert_ids


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer embeddings (PLE) for decoder layers `layers` (a range; all by default): what a stage
    holding those layers needs of the model-level PLE weights, and nothing more.

    forward(input_ids [batch, seq], inputs_embeds [batch, seq, hidden]) -> [batch, seq, len(layers), width]: for each
    layer, (RMSNorm(per_layer_model_projection(inputs_embeds) * hidden ** -0.5) + embed_tokens_per_layer(ids)) *
    2 ** -0.5, transformers' get_per_layer_inputs and project_per_layer_inputs restricted to these layers' columns.
    inputs_embeds is the scaled token embedding (the model's first hidden states), not a later layer's.

    Its parameters, under transformers' names after `model.`, hold these layers' share (`share` cuts it from the
    whole tensor): `embed_tokens_per_layer.weight` [vocab_size_per_layer_input, len(layers) * width] (its columns),
    `per_layer_model_projection.weight` [len(layers) * width, hidden] (its rows), and the one norm every layer shares,
    `per_layer_projection_norm.weight` [width], whole: a copy on every holder, whose gradients are summed over them
    as a tied weight's."""

    SPLIT_DIMS = {"embed_tokens_per_layer.weight": 1, "per_layer_model_projection.weight": 0}

    def __init__(self, config, layers=None):
        super().__init__()
        self.layers = range(config.num_hidden_layers) if layers is None else layers
        if not config.hidden_size_per_layer_input:
            raise ValueError("the gemma4_text config has no per-layer embeddings (hidden_size_per_layer_input is "
                             f"{config.hidden_size_per_layer_input!r}).")
        if self.layers.step != 1 or not 0 <= self.layers.start < self.layers.stop <= config.num_hidden_layers:
            raise ValueError(f"per-layer inputs for layers {self.layers}: give a non-empty range of consecutive "
                             f"layers within 0..{config.num_hidden_layers - 1}.")
        self.width = width = config.hidden_size_per_layer_input
        columns = len(self.layers) * width
        self.embed_tokens_per_layer = ScaledEmbedding(config.vocab_size_per_layer_input, columns,
                                                      config.pad_token_id, width ** 0.5)
        self.per_layer_model_projection = nn.Linear(config.hidden_size, columns, bias=False)
        self.projection_scale = config.hidden_size ** -0.5
        self.per_layer_projection_norm = Gemma4RMSNorm(width, config.rms_norm_eps)
        self.input_scale = 2.0 ** -0.5

    def forward(self, input_ids, inputs_embeds):
        per_layer = (*input_ids.shape, len(self.layers), self.width)
        projected = self.per_layer_model_projection(inputs_embeds) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.reshape(per_layer))
        return (projected + self.embed_tokens_per_layer(input_ids).reshape(per_layer)) * self.input_scale

    def share(self, name, tensor):
        """This share of the whole model's tensor `name` (as in its state dict): a view, so a memory-mapped
        checkpoint tensor reads only these layers' bytes; the norm's weight whole."""
        if name not in self.SPLIT_DIMS:
            return tensor
        return tensor.narrow(self.SPLIT_DIMS[name], self.layers.start * self.width, len(self.layers) * self.width)


def gemma4_embedding(config):
    """The token embedding, `model.embed_tokens` (Gemma 4 ties the LM head to it)."""
    return ScaledEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id, config.hidden_size ** 0.5)


def gemma4_final_norm(config):
    """The final norm, `model.norm`."""
    return Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
