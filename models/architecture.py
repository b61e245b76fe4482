"""What each supported model family changes in the LLaMA decoder, read from its Hugging Face config in one place.

Every family is LLaMA's layer (RMSNorm, rotary attention, SwiGLU MLP) with a few of these options, each followed
exactly as transformers' modeling file for the family computes it:

| model_type | differences from llama                                                                           |
| mistral    | a sliding window on every layer; no biases                                                         |
| qwen2      | bias on q, k, v only; a sliding window on the layers layer_types marks (max_window_layers)         |
| qwen3      | an RMSNorm over each query and key head (q_norm, k_norm); explicit head_dim; windows as qwen2      |
| olmo2      | norms after attention and MLP instead of before; q_norm, k_norm over the whole q and k projections  |
| granite    | embedding, residual and attention multipliers; logits divided by logits_scaling                    |
| smollm3    | no rotary embedding on the layers no_rope_layers marks 0                                           |
| phi3       | fused qkv_proj and gate_up_proj (split in the pipeline: models/layout.py); partial rotary; no bias |
| deepseek_v3| multi-head latent attention (models/latent_attention.py)                                          |
| glm4_moe   | bias on q, k, v only (attention_bias); a per-head q/k norm with use_qk_norm; partial rotary        |

The mixture-of-experts families replace the MLP of some or all layers by the MoE block (models/moe.py), whose
options (MixtureOfExperts below) come from the config too:

| model_type | differences from llama                                                                           |
| mixtral    | every layer MoE, top-k of a softmax router, renormalised; a sliding window on every layer if set   |
| qwen3_moe  | as qwen3's attention (no windows unless use_sliding_window); MoE layers by decoder_sparse_step and |
|            | mlp_only_layers (the others dense, intermediate_size); norm_topk_prob                             |
| qwen2_moe  | as qwen2's attention (qkv_bias); a shared expert behind a sigmoid gate beside the routed ones     |
| olmoe      | q_norm, k_norm over the whole q and k projections (scaled after the cast, unlike olmo2's)          |
| gpt_oss    | attention sinks; biases everywhere; a sliding window on the layers layer_types marks; YaRN; a     |
|            | router with a bias, top-k of the logits then a softmax; experts with biases and a clamped SwiGLU  |
| deepseek_v3| the first first_k_dense_replace layers dense; DeepSeek-V3's sigmoid, group-limited router with its |
| glm4_moe   | score-correction bias (models/sigmoid_router.py); shared experts (ungated) beside the routed ones  |
"""
import dataclasses
import difflib
import functools

import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe")
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")  # DeepSeek-V3's router (models/sigmoid_router.py)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "smollm3", "phi3", *MOE_MODEL_TYPES)
# transformers' ACT2FN for the activations LLaMA-family models use (importing ACT2FN costs ~75 MB per process).
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}
# Config fields of other families that change the math in ways this pipeline does not implement: {field: why}.
NOT_IMPLEMENTED = {"attn_logit_softcapping": "an attention logit soft-cap", "final_logit_softcapping":
                   "a final logit soft-cap", "layer_norm_eps": "a LayerNorm (only RMSNorm is implemented)",
                   "use_qk_norm": "a query/key norm this family's layer does not have",
                   "clip_qkv": "query, key and value clipping", "quantization_config":
                   "quantized weights (dequantize the checkpoint to bf16 or fp32 first)"}
IMPLEMENTED_BY = {"use_qk_norm": ("glm4_moe",)}  # {field of NOT_IMPLEMENTED: the families that implement it}
# Randomness that transformers applies while training (never in evaluation) and this pipeline does not: {field: what}.
TRAINING_DROPOUT = {"attention_dropout": "dropout on the attention weights",
                    "resid_pdrop": "dropout on each sublayer's output",
                    "router_jitter_noise": "multiplicative noise on the MoE router's input"}


@dataclasses.dataclass(frozen=True)
class MixtureOfExperts:
    """What an MoE block computes (models/moe.py), as the family's transformers code does."""
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate features
    router_name: str = "gate"  # the router's name in the layer (GPT-OSS: router)
    router_bias: bool = False  # GPT-OSS
    softmax_after_topk: bool = False  # GPT-OSS: the top-k logits, then a softmax over them; else top-k of a softmax
    norm_topk_prob: bool = False  # the top-k probabilities divided by their sum (Mixtral always)
    weights_in_logits_dtype: bool = True  # the routing weights cast to the logits' dtype (Mixtral keeps fp32)
    expert_bias: bool = False  # GPT-OSS
    transposed: bool = False  # GPT-OSS's experts: gate_up_proj [E, H, 2I], gate and up interleaved; else [E, 2I, H]
    swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU: (clamp(up) + 1) * gate * sigmoid(alpha * gate)
    swiglu_alpha: float = 1.0
    shared_expert_size: int = 0  # a shared expert's width (a dense MLP beside the routed ones), 0: none
    shared_expert_name: str = "shared_expert"  # DeepSeek-V3's: shared_experts
    shared_expert_gated: bool = True  # Qwen2-MoE's behind a sigmoid gate (shared_expert_gate); DeepSeek-V3's not
    sigmoid_routing: bool = False  # DeepSeek-V3's router (models/sigmoid_router.py), a module of its own
    aux_loss: bool = False  # transformers' output_router_logits: the load-balancing loss (models/router_loss.py)
    aux_loss_coef: float = 0.0
    # DeepSeek-V3's sequence-wise balance loss (models/sigmoid_router.py), its coefficient (the run's
    # moe.sequence_aux_loss_coef; 0: off, as transformers)
    sequence_aux_loss_coef: float = 0.0

    @property
    def loss_sum(self):
        """Whether an auxiliary loss takes its gradient through a floating sum carried between the stages."""
        return self.aux_loss or self.sequence_aux_loss_coef > 0


@dataclasses.dataclass(frozen=True)
class Architecture:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None  # 'head': per head (Qwen3); 'projection': over the whole q and k projections (OLMo 2)
    post_norms: bool = False  # OLMo 2: each sublayer's output normalised before the residual add, no input norm
    embedding_multiplier: float = 1.0  # Granite's multipliers
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    logits_scaling: float = 1.0  # the logits are divided by it
    rotary_fraction: float = 1.0  # Phi's partial rotary embedding: the first fraction of each head's features
    rotary_layers: tuple = ()  # per decoder layer: whether it applies the rotary embedding
    sliding_windows: tuple = ()  # per decoder layer: its attention window (keys > query - window), or None
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj fused in the Hugging Face checkpoint
    norm_scale_in_fp32: bool = False  # OLMo 2, GPT-OSS: an RMSNorm's weight applied before the cast back
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in each softmax's denominator
    moe: MixtureOfExperts | None = None
    sparse_layers: tuple = ()  # per decoder layer: whether its MLP is the MoE block
    latent_attention: bool = False  # DeepSeek-V3: multi-head latent attention (models/latent_attention.py)


def head_dim_of(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def fused_projections(config):
    """{fused projection of a decoder layer: ((its part, rows), ...)}: Phi-3's qkv_proj and gate_up_proj, which the
    pipeline holds as LLaMA's separate projections (row blocks of the fused weight, in order), so tensor parallelism
    splits each by heads or columns in Megatron's layout."""
    if not architecture_of(config).fused_projections:
        return {}
    head_dim, kv_heads = head_dim_of(config), config.num_key_value_heads or config.num_attention_heads
    return {"self_attn.qkv_proj": (("self_attn.q_proj", config.num_attention_heads * head_dim),
                                   ("self_attn.k_proj", kv_heads * head_dim), ("self_attn.v_proj", kv_heads * head_dim)),
            "mlp.gate_up_proj": (("mlp.gate_proj", config.intermediate_size), ("mlp.up_proj", config.intermediate_size))}


def architecture_of(config):
    """The options of a (checked) Hugging Face config."""
    family = config.model_type
    attention_bias, mlp_bias = getattr(config, "attention_bias", False), getattr(config, "mlp_bias", False)
    layers = range(config.num_hidden_layers)
    return Architecture(
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and config.qkv_bias) or (
            attention_bias and family in (*BIASED_ATTENTION, "glm4_moe")),
        o_bias=attention_bias and family in BIASED_ATTENTION,
        mlp_bias=mlp_bias and family in ("llama", "granite", "smollm3"),
        qk_norm="head" if family == "glm4_moe" and config.use_qk_norm else {
            "qwen3": "head", "qwen3_moe": "head", "olmo2": "projection", "olmoe": "projection"}.get(family),
        post_norms=family == "olmo2",
        embedding_multiplier=getattr(config, "embedding_multiplier", 1.0) if family == "granite" else 1.0,
        residual_multiplier=getattr(config, "residual_multiplier", 1.0) if family == "granite" else 1.0,
        attention_scale=config.attention_multiplier if family == "granite" else None,
        logits_scaling=config.logits_scaling if family == "granite" else 1.0,
        rotary_fraction=config.rope_parameters.get("partial_rotary_factor", 1.0) if family in ("phi3", "glm4_moe")
        else 1.0,
        rotary_layers=tuple(bool(config.no_rope_layers[i]) if family == "smollm3" else True for i in layers),
        sliding_windows=tuple(sliding_window(config, i) for i in layers),
        fused_projections=family == "phi3",
        norm_scale_in_fp32=family in ("olmo2", "gpt_oss"),
        attention_sinks=family == "gpt_oss",
        moe=mixture_of_experts(config),
        sparse_layers=tuple(sparse_layer(config, i) for i in layers),
        latent_attention=family == "deepseek_v3")


BIASED_ATTENTION = ("llama", "qwen3", "olmo2", "granite", "smollm3", "qwen3_moe", "olmoe", "gpt_oss")  # attention_bias


def mixture_of_experts(config):
    """The MoE block's options of an MoE family's config, else None."""
    family = config.model_type
    if family not in MOE_MODEL_TYPES:
        return None
    gpt_oss = family == "gpt_oss"
    if family in SIGMOID_ROUTED:  # no load-balancing loss: transformers' forward computes none for them
        return MixtureOfExperts(
            num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            expert_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
            shared_expert_size=config.moe_intermediate_size * config.n_shared_experts,
            shared_expert_name="shared_experts", shared_expert_gated=False, sigmoid_routing=True,
            sequence_aux_loss_coef=getattr(config, "sequence_aux_loss_coef", 0.0))
    return MixtureOfExperts(
        num_experts=config.num_experts, top_k=config.num_experts_per_tok,
        expert_size=config.moe_intermediate_size if family in ("qwen3_moe", "qwen2_moe") else config.intermediate_size,
        router_name="router" if gpt_oss else "gate", router_bias=gpt_oss, softmax_after_topk=gpt_oss,
        norm_topk_prob=family == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
        weights_in_logits_dtype=family != "mixtral", expert_bias=gpt_oss, transposed=gpt_oss,
        swiglu_limit=config.swiglu_limit if gpt_oss else None, swiglu_alpha=config.swiglu_alpha if gpt_oss else 1.0,
        shared_expert_size=config.shared_expert_intermediate_size if family == "qwen2_moe" else 0,
        aux_loss=bool(config.output_router_logits), aux_loss_coef=float(config.router_aux_loss_coef))


def sparse_layer(config, layer):
    """Whether decoder layer `layer`'s MLP is the MoE block: every layer of an MoE family but, in Qwen's, those
    mlp_only_layers lists and those decoder_sparse_step skips."""
    if config.model_type in SIGMOID_ROUTED:
        return layer >= config.first_k_dense_replace
    if config.model_type not in MOE_MODEL_TYPES or config.num_experts == 0:
        return False
    if config.model_type in ("qwen3_moe", "qwen2_moe"):
        return layer not in config.mlp_only_layers and (layer + 1) % config.decoder_sparse_step == 0
    return True


def sliding_window(config, layer):
    """Decoder layer `layer`'s attention window, as the family's transformers code decides it: every layer of a
    Mistral, Mixtral or Phi-3 config with sliding_window, and of a Qwen3-MoE one with use_sliding_window; the layers
    layer_types marks 'sliding_attention' otherwise (GPT-OSS's alternate layers; Qwen2 and Qwen3 mark those from
    max_window_layers on, Qwen2-MoE the odd ones below it; they and SmolLM3 need use_sliding_window too)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):
        return window or None  # Qwen3-MoE's config sets None without use_sliding_window
    if config.model_type == "gpt_oss":
        return window if config.layer_types[layer] == "sliding_attention" else None
    if config.model_type not in ("qwen2", "qwen3", "smollm3", "qwen2_moe") or \
            not getattr(config, "use_sliding_window", False):
        return None
    return window if config.layer_types[layer] == "sliding_attention" else None


def check_trains_as_configured(config):
    """Refuse to train a config that asks for dropout (an attention_dropout of 0.1, as Granite configs may set),
    which transformers would apply while training: conversion, evaluation and export are exact whatever it says."""
    for field, where in TRAINING_DROPOUT.items():
        if getattr(config, field, 0) or 0:
            raise ValueError(f"{field}={getattr(config, field)} in the {config.model_type} config asks for "
                             f"{where} while training, which this pipeline does not implement; set it to 0 in the "
                             f"Hugging Face config.json and convert again (eval_only runs as it is).")


def check_model_config(config):
    """Refuse configs whose math this pipeline does not implement, naming the field, before anything is built."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        nearest = difflib.get_close_matches(config.model_type, SUPPORTED_MODEL_TYPES, n=1, cutoff=0.6)
        raise ValueError(f"model_type '{config.model_type}' is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (the LLaMA layout and its mixtures of experts)"
                         + (f"; the nearest is '{nearest[0]}', whose layers differ from it." if nearest else "."))
    for field, what in NOT_IMPLEMENTED.items():
        if getattr(config, field, None) not in (None, False) and config.model_type not in IMPLEMENTED_BY.get(field, ()):
            raise ValueError(f"{field}={getattr(config, field)!r} in the {config.model_type} config asks for {what}, "
                             f"which this pipeline does not implement.")
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
                         f"num_key_value_heads ({kv_heads}).")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act '{config.hidden_act}' is not supported.")
    check_deepseek_line(config)
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_parameters rope_type '{rope_type}' is not implemented; implemented: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}.")


def check_deepseek_line(config):
    """What the DeepSeek-V3 line's configs may ask that this pipeline does not compute as transformers does."""
    if config.model_type == "deepseek_v3" and config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(f"num_key_value_heads={config.num_key_value_heads} in the deepseek_v3 config differs from "
                         f"num_attention_heads={config.num_attention_heads}: multi-head latent attention expands one "
                         f"key and value per query head (transformers' DeepseekV3Attention cannot run it either); set "
                         f"num_key_value_heads to {config.num_attention_heads}.")
    if config.model_type in SIGMOID_ROUTED and config.n_routed_experts % config.n_group:
        raise ValueError(f"n_group={config.n_group} in the {config.model_type} config does not divide "
                         f"n_routed_experts={config.n_routed_experts}: the router ranks groups of equal size.")
