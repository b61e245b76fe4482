"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight), as transformers' DeepseekV3Attention.

Queries come through a low-rank latent (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; one `q_proj` when
q_lora_rank is None); keys and values through one compressed latent per token: `kv_a_proj_with_mqa` gives
kv_lora_rank latent features and qk_rope_head_dim rotary ones; the latent, normalised (`kv_a_layernorm`), expands
through `kv_b_proj` into each head's qk_nope_head_dim key features and v_head_dim value features; the rotary
features are one key part shared by every head. A query or key head is its non-rotary features then its rotary
ones (qk_nope_head_dim + qk_rope_head_dim); the value head is v_head_dim wide. With rope_interleave (DeepSeek's
checkpoints) the rotary features pair up interleaved, (x0, x1), (x2, x3), ...

The latents of every token meet in `latent_tokens` before they are expanded: tensor parallelism splits the heads
and keeps the narrow latent projections whole, computing them on each rank's own tokens and gathering the latents
there rather than the wider hidden states (models/tensor_parallel.py). The attention core receives the key/value
latent and the rotary key part with the expansion, so that context parallelism gathers the latent, not the
expanded keys and values (models/context_parallel.py).
"""
import math

import torch
from torch import nn

from models.attention import AttentionCore
from models.attention_kernels import apply_rotary, deinterleave
from models.norms import RMSNorm

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps


def softmax_scale(config):
    """transformers' DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared
    when a rotary scaling (YaRN) sets mscale_all_dim (yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """The attention of a decoder layer of an MLA model; it takes and returns what grouped-query attention does
    (models/attention.py)."""

    def __init__(self, config, attention_impl="sdpa", layer_index=0):
        super().__init__()
        self.window = None
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_rank, self.kv_rank = config.q_lora_rank, config.kv_lora_rank
        self.interleaved = config.rope_interleave
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        qk_dim = self.nope + self.rope
        if self.q_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.latent_tokens = nn.Identity()  # every token's latents, where the expansion reads them
        self.core = AttentionCore(attention_impl, softmax_scale(config))

    def forward(self, x, inputs):
        batch, seq = inputs.rows
        q_latent, kv_latent, k_rot = self.latents(x)
        q = self.q_b_proj(q_latent) if self.q_rank is not None else self.q_proj(x)
        q_nope, q_rot = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        k_rot = k_rot.reshape(batch, 1, seq, self.rope)
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat([q_nope, apply_rotary(q_rot, inputs.cos, inputs.sin)], dim=-1)
        keys = (kv_latent.reshape(batch, 1, seq, self.kv_rank), apply_rotary(k_rot, inputs.cos, inputs.sin))
        out = self.core(q, keys, inputs.mask, expand=self.expand)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def latents(self, x):
        """(the query latent, normalised, or None; the key/value latent, normalised; the rotary key part) of every
        token, each (tokens, features)."""
        kv = self.kv_a_proj_with_mqa(x)
        kv_latent, k_rot = kv.split([self.kv_rank, self.rope], dim=-1)
        parts = [self.kv_a_layernorm(kv_latent), k_rot]
        if self.q_rank is not None:
            parts.insert(0, self.q_a_layernorm(self.q_a_proj(x)))
        whole = self.latent_tokens(torch.cat(parts, dim=-1).reshape(-1, sum(p.shape[-1] for p in parts)))
        *q_latent, kv_latent, k_rot = whole.split([p.shape[-1] for p in parts], dim=-1)
        return (q_latent[0] if q_latent else None), kv_latent, k_rot

    def expand(self, kv_latent, k_rot):
        """Keys and values (batch, heads, tokens, features) from the latent (batch, 1, tokens, kv_lora_rank) and the
        rotated key part (batch, 1, tokens, qk_rope_head_dim) every head shares."""
        batch, _, tokens, _ = kv_latent.shape
        kv = self.kv_b_proj(kv_latent).view(batch, tokens, -1, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1), v
