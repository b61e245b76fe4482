"""What each supported model family is, declared once per model_type from its Hugging Face config.

A family's decoder layer composes parts: a token mixer (grouped-query attention, models/attention.py, or multi-head
latent attention, models/latent_attention.py), a feed-forward (the dense MLP, models/mlp.py, or a mixture of
experts, models/moe.py), RMSNorms placed before or after each of them (models/decoder.py), the rotary embedding and
a few multipliers. The declarations below (FAMILIES) say which parts and options each family takes, each as
transformers' modeling file for the family computes it, so that reading one family's function tells what it is.
Adding a family means adding its declaration here and, where it brings math no part has, a part.
"""
import dataclasses
import difflib
import functools

import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# transformers' ACT2FN for the activations the families use (importing ACT2FN would cost every process memory).
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

ATTENTION, LATENT_ATTENTION = "attention", "latent_attention"  # the token mixers
# the Gated DeltaNet hybrids' (Qwen3.5, Qwen3-Next): gated full attention and linear attention, per layer_types
GATED_ATTENTION, LINEAR_ATTENTION = "gated_attention", "linear_attention"
HYBRID_MIXERS = {"full_attention": GATED_ATTENTION, "linear_attention": LINEAR_ATTENTION}  # {layer type: mixer}
PRE_NORMS, POST_NORMS = "pre", "post"  # where a layer's norms sit (models/decoder.py NORM_PLACEMENTS)


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
    """A family's decoder, as its declaration below fills it in. The per-layer tuples have one entry per decoder
    layer."""
    token_mixer: str = ATTENTION
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None  # 'head': per head (Qwen3); 'projection': over the whole q and k projections (OLMo 2)
    norm_placement: str = PRE_NORMS
    norm_scale_in_fp32: bool = False  # OLMo 2, GPT-OSS: an RMSNorm's weight applied before the cast back
    embedding_multiplier: float = 1.0  # Granite's multipliers
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    logits_scaling: float = 1.0  # the logits are divided by it
    rotary_fraction: float = 1.0  # Phi's partial rotary embedding: the first fraction of each head's features
    rotary_layers: tuple = ()  # per decoder layer: whether it applies the rotary embedding
    sliding_windows: tuple = ()  # per decoder layer: its attention window (keys > query - window), or None
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj fused in the Hugging Face checkpoint
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in each softmax's denominator
    moe: MixtureOfExperts | None = None
    sparse_layers: tuple = ()  # per decoder layer: whether its feed-forward is the MoE block
    mixer_layers: tuple = ()  # per decoder layer: its token mixer (the hybrids' differ from layer to layer)
    offset_norms: bool = False  # the hybrids' (1 + w) RMSNorms (models/offset_norms.py), weights initialised to 0
    fused_linear_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba (models/linear_attention.py)

    @property
    def latent_attention(self):
        return self.token_mixer == LATENT_ATTENTION


def architecture_of(config):
    """The Architecture of a (checked) Hugging Face config: its family's declaration, with LLaMA's per-layer
    defaults (rotary embedding everywhere, no window, dense feed-forwards) where the family sets none."""
    declared = FAMILIES[config.model_type](config)
    layers = config.num_hidden_layers
    return dataclasses.replace(declared, rotary_layers=declared.rotary_layers or (True,) * layers,
                               sliding_windows=declared.sliding_windows or (None,) * layers,
                               sparse_layers=declared.sparse_layers or (False,) * layers,
                               mixer_layers=declared.mixer_layers or (declared.token_mixer,) * layers)


# --- the families -----------------------------------------------------------------------------------------------

def llama(config):
    """LLaMA 1-3.3, SmolLM2: RMSNorm before attention and MLP, rotary attention, SwiGLU MLP; biases as the config
    asks."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias)


def mistral(config):
    """Mistral v0.1: LLaMA with a sliding window on every layer and no biases."""
    return Architecture(sliding_windows=every_layer(config, config.sliding_window or None))


def qwen2(config):
    """Qwen2, Qwen2.5: biases on q, k and v only; with use_sliding_window, windows on the layers layer_types marks
    (from max_window_layers on)."""
    return Architecture(qkv_bias=True, sliding_windows=marked_windows(config, config.use_sliding_window))


def qwen3(config):
    """Qwen3 (dense): an RMSNorm over each query and key head; windows as Qwen2's."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm="head",
                        sliding_windows=marked_windows(config, config.use_sliding_window))


def olmo2(config):
    """OLMo 2: each sublayer's output normalised before the residual add (no input norms); q and k normalised
    over their whole projections; every norm's weight applied before the cast back."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm="projection",
                        norm_placement=POST_NORMS, norm_scale_in_fp32=True)


def granite(config):
    """Granite 3: LLaMA with embedding, residual and attention multipliers, and the logits divided by
    logits_scaling."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias,
                        embedding_multiplier=config.embedding_multiplier,
                        residual_multiplier=config.residual_multiplier, attention_scale=config.attention_multiplier,
                        logits_scaling=config.logits_scaling)


def smollm3(config):
    """SmolLM3: LLaMA without the rotary embedding on the layers no_rope_layers marks 0; windows as Qwen2's."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias,
                        rotary_layers=tuple(bool(rotary) for rotary in
                                            config.no_rope_layers[:config.num_hidden_layers]),
                        sliding_windows=marked_windows(config, config.use_sliding_window))


def phi3(config):
    """Phi-3, Phi-4: fused qkv_proj and gate_up_proj in the checkpoint (held as LLaMA's parts: models/layout.py),
    a partial rotary embedding, a sliding window on every layer if set, no biases."""
    return Architecture(fused_projections=True, rotary_fraction=partial_rotary(config),
                        sliding_windows=every_layer(config, config.sliding_window or None))


def mixtral(config):
    """Mixtral: Mistral's attention; every layer's MLP a mixture of experts, the top-k of a softmax router
    renormalised (in fp32)."""
    return Architecture(sliding_windows=every_layer(config, config.sliding_window or None),
                        moe=MixtureOfExperts(config.num_local_experts, config.num_experts_per_tok,
                                             config.intermediate_size, norm_topk_prob=True,
                                             weights_in_logits_dtype=False, **load_balancing(config)),
                        sparse_layers=every_layer(config, config.num_local_experts > 0))


def qwen3_moe(config):
    """Qwen3-MoE: Qwen3's attention (a window on every layer only with use_sliding_window); experts on the layers
    decoder_sparse_step picks and mlp_only_layers leaves, dense MLPs of intermediate_size on the others."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm="head",
                        sliding_windows=every_layer(config, config.sliding_window or None),
                        moe=MixtureOfExperts(config.num_experts, config.num_experts_per_tok,
                                             config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                                             **load_balancing(config)),
                        sparse_layers=qwen_sparse_layers(config))


def qwen2_moe(config):
    """Qwen2-MoE: Qwen2's attention (q/k/v biases with qkv_bias); experts as Qwen3-MoE's, beside them a shared
    expert behind a sigmoid gate."""
    return Architecture(qkv_bias=config.qkv_bias, sliding_windows=marked_windows(config, config.use_sliding_window),
                        moe=MixtureOfExperts(config.num_experts, config.num_experts_per_tok,
                                             config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                                             shared_expert_size=config.shared_expert_intermediate_size,
                                             **load_balancing(config)),
                        sparse_layers=qwen_sparse_layers(config))


def olmoe(config):
    """OLMoE: q and k normalised over their whole projections (the weight applied after the cast, unlike
    OLMo 2's); every layer's MLP a mixture of experts, the top-k of a softmax router."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm="projection",
                        moe=MixtureOfExperts(config.num_experts, config.num_experts_per_tok,
                                             config.intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                                             **load_balancing(config)),
                        sparse_layers=every_layer(config, config.num_experts > 0))


def gpt_oss(config):
    """GPT-OSS: attention sinks, biases everywhere, a window on the layers layer_types marks, YaRN; a router with a
    bias, the top-k of its logits then a softmax; experts held transposed, with biases and a clamped SwiGLU."""
    return Architecture(qkv_bias=config.attention_bias, o_bias=config.attention_bias, norm_scale_in_fp32=True,
                        attention_sinks=True, sliding_windows=marked_windows(config, True),
                        moe=MixtureOfExperts(config.num_local_experts, config.num_experts_per_tok,
                                             config.intermediate_size, router_name="router", router_bias=True,
                                             softmax_after_topk=True, norm_topk_prob=False, expert_bias=True,
                                             transposed=True, swiglu_limit=config.swiglu_limit,
                                             swiglu_alpha=config.swiglu_alpha, **load_balancing(config)),
                        sparse_layers=every_layer(config, config.num_local_experts > 0))


def deepseek_v3(config):
    """DeepSeek-V3, Kimi K2, Moonlight: multi-head latent attention; after the first first_k_dense_replace dense
    layers, DeepSeek-V3's sigmoid router (models/sigmoid_router.py) over routed experts beside ungated shared
    ones."""
    return Architecture(token_mixer=LATENT_ATTENTION, moe=sigmoid_routed_experts(config),
                        sparse_layers=tuple(layer >= config.first_k_dense_replace
                                            for layer in range(config.num_hidden_layers)))


def glm4_moe(config):
    """GLM-4.5: grouped-query attention with q/k/v biases (attention_bias), a per-head q/k norm with use_qk_norm and
    a partial rotary embedding; DeepSeek-V3's router and experts after the first first_k_dense_replace layers."""
    return Architecture(qkv_bias=config.attention_bias, qk_norm="head" if config.use_qk_norm else None,
                        rotary_fraction=partial_rotary(config), moe=sigmoid_routed_experts(config),
                        sparse_layers=tuple(layer >= config.first_k_dense_replace
                                            for layer in range(config.num_hidden_layers)))


def qwen3_5_text(config):
    """Qwen3.5, Qwen3.6 (dense): the Gated DeltaNet hybrid. Each layer's token mixer as layer_types says, linear
    attention (models/linear_attention.py) or gated full attention with a partial rotary embedding
    (models/gated_attention.py); (1 + w) RMSNorms before the mixer and the SwiGLU MLP, and as the final norm."""
    return Architecture(rotary_fraction=partial_rotary(config), offset_norms=True, mixer_layers=hybrid_mixers(config))


def qwen3_5_moe_text(config):
    """Qwen3.5-MoE, Qwen3.6-MoE: Qwen3.5's layers with every feed-forward a mixture of experts, the top-k of a
    softmax router always renormalised, beside a shared expert behind its sigmoid gate."""
    return dataclasses.replace(qwen3_5_text(config), moe=MixtureOfExperts(
        config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, norm_topk_prob=True,
        shared_expert_size=config.shared_expert_intermediate_size, **load_balancing(config)),
        sparse_layers=every_layer(config, True))


def qwen3_next(config):
    """Qwen3-Next: Qwen3.5-MoE's layers with the linear attention's projections fused (in_proj_qkvz, in_proj_ba,
    grouped by key head), the experts on the layers decoder_sparse_step picks and mlp_only_layers leaves, top-k
    renormalised with norm_topk_prob."""
    return dataclasses.replace(qwen3_5_text(config), fused_linear_projections=True, moe=MixtureOfExperts(
        config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob, shared_expert_size=config.shared_expert_intermediate_size,
        **load_balancing(config)), sparse_layers=qwen_sparse_layers(config))


FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "olmo2": olmo2, "granite": granite,
            "smollm3": smollm3, "phi3": phi3, "mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe,
            "olmoe": olmoe, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe,
            "qwen3_5_text": qwen3_5_text, "qwen3_5_moe_text": qwen3_5_moe_text, "qwen3_next": qwen3_next}
# Multimodal checkpoints whose text model trains ({model_type: its text config's}); their towers and MTP layer are
# carried as they are (models/layout.py), and every step takes their text config (models/layout.py text_config_of).
TRAINED_THROUGH_TEXT = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_MODEL_TYPES = (*FAMILIES, *TRAINED_THROUGH_TEXT)


# --- what several families share ----------------------------------------------------------------------------------

def every_layer(config, value):
    return (value,) * config.num_hidden_layers


def marked_windows(config, windowed):
    """sliding_window on the layers layer_types marks 'sliding_attention' (Qwen2 and Qwen3 mark those from
    max_window_layers on, Qwen2-MoE the odd ones below it, GPT-OSS alternate layers), when `windowed`."""
    return tuple(config.sliding_window if windowed and kind == "sliding_attention" else None
                 for kind in config.layer_types[:config.num_hidden_layers])


def hybrid_mixers(config):
    """The token mixer of each decoder layer, from the layer types the config lists."""
    unknown = sorted(set(config.layer_types) - set(HYBRID_MIXERS))
    if unknown:
        raise ValueError(f"layer_types {unknown} in the {config.model_type} config are not implemented; implemented: "
                         f"{', '.join(HYBRID_MIXERS)}.")
    return tuple(HYBRID_MIXERS[kind] for kind in config.layer_types[:config.num_hidden_layers])


def partial_rotary(config):
    return config.rope_parameters.get("partial_rotary_factor", 1.0)


def load_balancing(config):
    """transformers' load-balancing loss of a softmax-routed family: on with output_router_logits."""
    return dict(aux_loss=bool(config.output_router_logits), aux_loss_coef=float(config.router_aux_loss_coef))


def qwen_sparse_layers(config):
    """Qwen-MoE's layers with experts: every decoder_sparse_step-th, but those mlp_only_layers lists."""
    return tuple(config.num_experts > 0 and layer not in config.mlp_only_layers and
                 (layer + 1) % config.decoder_sparse_step == 0 for layer in range(config.num_hidden_layers))


def sigmoid_routed_experts(config):
    """DeepSeek-V3's experts: no load-balancing loss (transformers' forward computes none for them), its
    sequence-wise one when the run asks (moe.sequence_aux_loss_coef)."""
    return MixtureOfExperts(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                            expert_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                            shared_expert_size=config.moe_intermediate_size * config.n_shared_experts,
                            shared_expert_name="shared_experts", shared_expert_gated=False, sigmoid_routing=True,
                            sequence_aux_loss_coef=getattr(config, "sequence_aux_loss_coef", 0.0))


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
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (the LLaMA layout, its mixtures of experts and the "
                         f"Gated DeltaNet hybrids)"
                         + (f"; the nearest is '{nearest[0]}', whose layers differ from it." if nearest else "."))
    if config.model_type in TRAINED_THROUGH_TEXT:
        check_model_config(config.get_text_config())
        return
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
    check_hybrid_line(config)
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_parameters rope_type '{rope_type}' is not implemented; implemented: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}.")


def check_hybrid_line(config):
    """What the Gated DeltaNet hybrids' configs may ask that this pipeline does not compute as transformers does."""
    if config.model_type not in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        return
    hybrid_mixers(config)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads={config.linear_num_value_heads} in the {config.model_type} config "
                         f"is not a multiple of linear_num_key_heads={config.linear_num_key_heads}: each key head "
                         f"serves a whole group of value heads.")


def check_deepseek_line(config):
    """What the DeepSeek-V3 line's configs may ask that this pipeline does not compute as transformers does."""
    if config.model_type == "deepseek_v3" and config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(f"num_key_value_heads={config.num_key_value_heads} in the deepseek_v3 config differs from "
                         f"num_attention_heads={config.num_attention_heads}: multi-head latent attention expands one "
                         f"key and value per query head (transformers' DeepseekV3Attention cannot run it either); set "
                         f"num_key_value_heads to {config.num_attention_heads}.")
    if config.model_type in ("deepseek_v3", "glm4_moe") and config.n_routed_experts % config.n_group:
        raise ValueError(f"n_group={config.n_group} in the {config.model_type} config does not divide "
                         f"n_routed_experts={config.n_routed_experts}: the router ranks groups of equal size.")
