"""Tiny LLaMA-family models built locally from a config (random weights, save_pretrained): the Hugging Face model
is the oracle the pipeline must match."""
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma3TextConfig, Gemma4TextConfig, Olmo3Config, Glm4MoeConfig, GptOssConfig, GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig,
                          Olmo2Config, OlmoeConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig, SmolLM3Config)

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-5)
TOKENS = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary (no pad row: see llama2)

TINY_CONFIGS = {
    # LLaMA-2 style: multi-head attention.
    "llama2": lambda: LlamaConfig(**COMMON, num_key_value_heads=4),
    # LLaMA-3 style: grouped-query attention, rope_theta 500000, llama3 rope scaling; its pad token a real one (as
    # pad = eos), in the second half of the vocabulary (tensor parallel 2: the second rank's row 2).
    "llama3": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, pad_token_id=50, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "tied": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=3),
    # Mistral v0.1: grouped-query attention, a sliding window (8) shorter than the tests' sequences.
    "mistral": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8),
    # Qwen2 style: bias on q, k, v; a sliding window on the layers from max_window_layers on.
    "qwen2": lambda: Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=True,
                                 sliding_window=8, max_window_layers=2),
    # Qwen3 (tied, as its small sizes): per-head q/k norms, head_dim (16) not hidden / heads.
    "qwen3": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    # OLMo 2: norms after attention and MLP, q/k norms over the whole projections.
    "olmo2": lambda: Olmo2Config(**COMMON, **TOKENS, num_key_value_heads=2),
    # Granite 3: every multiplier away from 1 (logits_scaling a power of two is exact as the head's input scale).
    "granite": lambda: GraniteConfig(**COMMON, num_key_value_heads=2, embedding_multiplier=12.0,
                                     residual_multiplier=0.22, attention_multiplier=0.25, logits_scaling=8.0),
    # SmolLM3 (tied): no rotary embedding on every 4th layer.
    "smollm3": lambda: SmolLM3Config(**COMMON, **TOKENS, num_key_value_heads=2),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj; Phi-4-mini's partial rotary embedding.
    "phi3": lambda: Phi3Config(**COMMON, **TOKENS, num_key_value_heads=2, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}

# Mixtures of experts, each with transformers' load-balancing loss on (a coefficient large enough to move the routers'
# gradients well past the tests' tolerances) and experts 16 wide (torch's grouped GEMM wants 16-byte strides).
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
MOE_CONFIGS = {
    # Mixtral: every layer sparse, top-2 of 4 renormalised, a sliding window on every layer.
    "mixtral": lambda: MixtralConfig(**{**COMMON, "intermediate_size": 16}, **MOE, num_key_value_heads=2,
                                     num_local_experts=4, sliding_window=8),
    # Qwen3-MoE: per-head q/k norms; layer 1 dense (mlp_only_layers), the others top-2 of 8 renormalised; tied.
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, **MOE, num_key_value_heads=2, head_dim=16, num_experts=8,
                                        moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1],
                                        tie_word_embeddings=True),
    # Qwen2-MoE: q/k/v biases, every second layer sparse with a shared expert behind its sigmoid gate, not
    # renormalised; windows on the layers below max_window_layers that layer_types marks.
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, **MOE, num_key_value_heads=2, num_experts=4, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=32, decoder_sparse_step=2,
                                        use_sliding_window=True, sliding_window=8, max_window_layers=2),
    # OLMoE: q/k norms over the whole projections, top-2 of 8, not renormalised.
    "olmoe": lambda: OlmoeConfig(**{**COMMON, "intermediate_size": 16}, **MOE, **TOKENS, num_key_value_heads=2,
                                 num_experts=8),
    # GPT-OSS: attention sinks, biases everywhere, a window on alternate layers, YaRN; a router with a bias (top-2 of
    # 4, then a softmax), experts with biases and the clamped SwiGLU (a limit the tiny activations reach).
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "intermediate_size": 16}, **MOE, num_key_value_heads=2, head_dim=8,
                                    num_local_experts=4, sliding_window=8, swiglu_limit=0.05, rope_parameters={
                                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
}

# The DeepSeek-V3 line: DeepSeek-V3's sigmoid router with its correction bias (random, so that it changes the
# choice), shared experts, the first layer dense; no load-balancing loss (transformers computes none for them).
LATENT = dict(num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=8)
ROUTED = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
              first_k_dense_replace=1)
DEEPSEEK_CONFIGS = {
    # DeepSeek-V3 / Kimi K2: the query latent, interleaved rotary part, YaRN with mscale (softmax scale and tables);
    # the top-2 of 8 experts within the best 2 of 4 groups, normalised, scaled.
    "deepseek_v3": lambda: DeepseekV3Config(**COMMON, **LATENT, **ROUTED, q_lora_rank=16, n_group=4, topk_group=2,
                                            norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters={
                                                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "mscale": 0.9, "mscale_all_dim": 1.1, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "original_max_position_embeddings": 16}),
    # Moonlight / DeepSeek-V2-Lite style: no query latent (q_proj), the rotary part as halves; one group, weights
    # not normalised; tied.
    "deepseek_v3_q_proj": lambda: DeepseekV3Config(**COMMON, **LATENT, **ROUTED, q_lora_rank=None, n_group=1,
                                                   topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5,
                                                   rope_interleave=False, tie_word_embeddings=True),
    # GLM-4.5: grouped-query attention with q/k/v biases, per-head q/k norms, half the head rotary; DeepSeek's router
    # over 2 groups.
    "glm4_moe": lambda: Glm4MoeConfig(**COMMON, **ROUTED, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                      use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=1.5),
}

# The Gated DeltaNet hybrids: 2 key heads and 4 value heads of 8 (grouped value heads), a kernel of 4; gated full
# attention of 4 query and 2 key/value heads of 16, a quarter of each rotary; positions to 256, so that packed rows
# cross the delta rule's chunks of 64.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
HYBRID = dict(COMMON, max_position_embeddings=256, num_key_value_heads=2, head_dim=16, **LINEAR)
QWEN_EXPERTS = dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16)
HYBRID_CONFIGS = {
    # Qwen3.5 / 3.6 dense: a full-attention layer second, not at the interval's place (layer_types decides)
    "qwen3_5": lambda: Qwen3_5TextConfig(**HYBRID, layer_types=["linear_attention", "full_attention",
                                                                 "linear_attention", "linear_attention"]),
    # Qwen3.5 0.8B-like: tied embeddings, a pad token that is a real one
    "qwen3_5_tied": lambda: Qwen3_5TextConfig(**HYBRID, tie_word_embeddings=True, pad_token_id=3),
    # Qwen3.5-MoE: every layer top-2 of 4 renormalised, the gated shared expert, the load-balancing loss on
    "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(**HYBRID, **MOE, **QWEN_EXPERTS),
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba, layer 1 dense (mlp_only_layers), top-k not renormalised
    "qwen3_next": lambda: Qwen3NextConfig(**HYBRID, **MOE, **QWEN_EXPERTS, mlp_only_layers=[1], norm_topk_prob=False),
}


# Gemma 3, Gemma 4 and OLMo 3: sliding and full layers by layer_types (the window, 4, shorter than the tests' rows),
# each type with its own rotary.
LAYER_TYPES = dict(COMMON, num_hidden_layers=6, num_key_value_heads=2, sliding_window=4, rms_norm_eps=1e-6)
GEMMA4 = dict(LAYER_TYPES, head_dim=8, global_head_dim=16, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "full_attention"] * 3)
GEMMA4_PLE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=96)  # E2B / E4B
GEMMA4_SHARED_KV = dict(num_kv_shared_layers=2, use_double_wide_mlp=True)  # layers 4, 5 reuse 2's and 3's
GEMMA4_K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)  # 31B and 26B-A4B
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
LAYER_TYPE_CONFIGS = {
    # Gemma 3: two full layers of six, linear scaling on their rotary, query_pre_attn_scalar away from head_dim
    "gemma3_text": lambda: Gemma3TextConfig(**LAYER_TYPES, head_dim=16, query_pre_attn_scalar=12,
                                            sliding_window_pattern=3, final_logit_softcapping=2.0, rope_parameters={
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1e6}}),
    "gemma4_e2b": lambda: Gemma4TextConfig(**{**GEMMA4, **GEMMA4_PLE}, **GEMMA4_SHARED_KV, final_logit_softcapping=2.0),
    "gemma4_31b": lambda: Gemma4TextConfig(**GEMMA4, **GEMMA4_K_EQ_V, final_logit_softcapping=30.0),
    # 26B-A4B: two key/value heads on its full layers (as the hub's), which tensor parallelism 2 splits
    "gemma4_26b_a4b": lambda: Gemma4TextConfig(**GEMMA4, **{**GEMMA4_K_EQ_V, "num_global_key_value_heads": 2},
                                               **GEMMA4_MOE, final_logit_softcapping=2.0),
    # OLMo 3: three sliding layers, then a full one with YaRN (without biases and with its norms as initialised:
    # random biases there leave transformers' own fp32 key gradients 1e-4 away from its float64 ones)
    "olmo3": lambda: Olmo3Config(**{**LAYER_TYPES, "num_hidden_layers": 4}, **TOKENS,
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                  "full_attention": {
                                                      "rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                      "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                      "beta_slow": 1.0}}),
}


def make_tiny_model(name, path, seed=0, **save_kwargs):
    """Save a randomly initialised tiny model to path and return it (fp32, eval mode)."""
    configs = {**TINY_CONFIGS, **MOE_CONFIGS, **DEEPSEEK_CONFIGS, **HYBRID_CONFIGS, **LAYER_TYPE_CONFIGS}
    return make_model(configs[name](), path, seed, **save_kwargs)


PERTURBED_NORMS = ("gemma3_text", "gemma4_text")  # norms whose init would hide a (1 + w) against a w


def make_model(config, path, seed=0, dtype=torch.float32, **save_kwargs):
    """Save a randomly initialised model of a config to path, its weights in dtype, and return it (eval mode)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias mapping testable
        for param_name, param in model.named_parameters():
            if param_name.endswith((".bias", "_bias")):
                param.normal_(std=0.02)
            if config.model_type in PERTURBED_NORMS and param_name.endswith("norm.weight"):
                param.add_(torch.randn_like(param), alpha=0.3)  # away from the identity, (1 + w) or w
            elif param_name.endswith("norm.weight") and not param.any():  # a (1 + w) norm's: 0 would hide the offset
                param.normal_(std=0.1)
            if param_name.endswith("A_log"):  # decays of 0.05 to 1 a token: init's (to 16) forget within a token,
                param.uniform_(-3.0, 0.0)  # leaving the decay's gradients at fp32's noise
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # DeepSeek's: moves the choice, not the weights
                buffer.normal_(std=0.1)
            if buffer_name.endswith("layer_scalar"):  # Gemma 4's, ones at init
                buffer.uniform_(0.5, 1.5)
        if config.pad_token_id is not None:  # a pad that is a real token (eos) has a trained row, not init's zeros
            model.get_input_embeddings().weight[config.pad_token_id].normal_(std=0.02)
    model.save_pretrained(path, **save_kwargs)
    return model.eval()


def make_batch(num_rows, seq_len, vocab_size, seed=0):
    """Right-padded rows of random lengths: (input_ids, attention_mask, labels) with -100 on padding."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (num_rows, seq_len), generator=gen)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (num_rows,), generator=gen)
    lengths[0] = seq_len
    attention_mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels
