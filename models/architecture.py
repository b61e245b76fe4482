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
| deepseek_v3| multi-head latent attention (models/latent_attention.py); the first first_k_dense_replace layers'   |
|            | MLPs dense                                                                                         |
| glm4_moe   | bias on q, k, v only (attention_bias); a per-head q/k norm with use_qk_norm; partial rotary; the   |
|            | first first_k_dense_replace layers' MLPs dense                                                     |
"""
import dataclasses
import difflib
import functools

import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "smollm3", "phi3", "deepseek_v3",
                         "glm4_moe")
# transformers' ACT2FN for the activations LLaMA-family models use (importing ACT2FN costs ~75 MB per process).
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}
# Config fields of other families that change the math in ways this pipeline does not implement: {field: why}.
NOT_IMPLEMENTED = {"attn_logit_softcapping": "an attention logit soft-cap", "final_logit_softcapping":
                   "a final logit soft-cap", "layer_norm_eps": "a LayerNorm (only RMSNorm is implemented)",
                   "use_qk_norm": "a query/key norm this family's layer does not have"}
IMPLEMENTED_BY = {"use_qk_norm": ("glm4_moe",)}  # {field of NOT_IMPLEMENTED: the families that implement it}
# Dropout that transformers applies while training (never in evaluation) and this pipeline does not: {field: where}.
TRAINING_DROPOUT = {"attention_dropout": "on the attention weights", "resid_pdrop": "on each sublayer's output"}


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
        qkv_bias=family == "qwen2" or (attention_bias and family in ("llama", "qwen3", "olmo2", "granite", "smollm3",
                                                                     "glm4_moe")),
        o_bias=attention_bias and family in ("llama", "qwen3", "olmo2", "granite", "smollm3"),
        mlp_bias=mlp_bias and family in ("llama", "granite", "smollm3"),
        qk_norm="head" if family == "glm4_moe" and config.use_qk_norm else {"qwen3": "head", "olmo2": "projection"}.get(
            family),
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
        latent_attention=family == "deepseek_v3")


def sliding_window(config, layer):
    """Decoder layer `layer`'s attention window, as the family's transformers code decides it: every layer of a
    Mistral or Phi-3 config with sliding_window; the layers layer_types marks 'sliding_attention' otherwise (Qwen2
    and Qwen3 mark those from max_window_layers on; SmolLM3 needs use_sliding_window too)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "phi3"):
        return window
    if config.model_type not in ("qwen2", "qwen3", "smollm3") or not getattr(config, "use_sliding_window", False):
        return None
    return window if config.layer_types[layer] == "sliding_attention" else None


def check_trains_as_configured(config):
    """Refuse to train a config that asks for dropout (an attention_dropout of 0.1, as Granite configs may set),
    which transformers would apply while training: conversion, evaluation and export are exact whatever it says."""
    for field, where in TRAINING_DROPOUT.items():
        if getattr(config, field, 0) or 0:
            raise ValueError(f"{field}={getattr(config, field)} in the {config.model_type} config asks for dropout "
                             f"{where} while training, which this pipeline does not implement; set it to 0 in the "
                             f"Hugging Face config.json and convert again (eval_only runs as it is).")


def check_model_config(config):
    """Refuse configs whose math this pipeline does not implement, naming the field, before anything is built."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        nearest = difflib.get_close_matches(config.model_type, SUPPORTED_MODEL_TYPES, n=1, cutoff=0.6)
        raise ValueError(f"model_type '{config.model_type}' is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (the LLaMA layout)"
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
    if config.model_type in ("deepseek_v3", "glm4_moe") and config.first_k_dense_replace < config.num_hidden_layers:
        raise ValueError(f"first_k_dense_replace={config.first_k_dense_replace} < num_hidden_layers="
                         f"{config.num_hidden_layers} in the {config.model_type} config asks for mixture-of-experts "
                         f"layers, which this branch does not implement yet.")
