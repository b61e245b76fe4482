"""The gated full attention of the Gated DeltaNet hybrids (transformers' Qwen3_5Attention, Qwen3NextAttention), as one
plain module, and its rotary tables.

q_proj gives each head its query and a gate side by side ([query | gate], 2 * head_dim a head: a split of the heads
must cut on those boundaries); the query and key heads take the offset (1 + w) RMSNorm over their features, then the
rotary embedding on the first partial_rotary_factor of them; softmax attention over grouped key/value heads (SDPA or
transformers' eager formula, models/attention_kernels.py) at scale head_dim ** -0.5; the output times sigmoid(gate)
before o_proj. Parameter names are transformers', so the module's state dict is a decoder layer's `self_attn.*` with
that prefix stripped.
"""
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from models.attention_kernels import apply_rotary, attend
from models.offset_norms import OffsetRMSNorm


class PartialRotaryEmbedding(nn.Module):
    """The rotary tables (cos, sin [B, S, rotary features], in x's dtype) of text positions [B, S], as transformers'
    Qwen3NextRotaryEmbedding and Qwen3_5TextRotaryEmbedding compute them: over the first partial_rotary_factor of
    head_dim, rope_theta from the config (its rope_type's own init function where not 'default'). Qwen3.5's
    multimodal rotary interleaves three position rows (time, height, width); text positions give the three the same
    row, where it is this one."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init = partial_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def partial_rope_parameters(config):
    """transformers' compute_default_rope_parameters for these families: the inverse frequencies of the rotary
    features (head_dim * partial_rotary_factor of them), and an attention scaling of 1."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class GatedAttention(nn.Module):
    """Full attention with an output gate (hidden [B, S, H] -> [B, S, H])."""

    def __init__(self, hidden_size, num_heads, num_key_value_heads, head_dim, rms_norm_eps=1e-6, bias=False,
                 attention_impl="sdpa"):
        super().__init__()
        if num_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                             f"({num_key_value_heads}).")
        self.head_dim, self.attention_impl = head_dim, attention_impl
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(head_dim, eps=rms_norm_eps)
        self.k_norm = OffsetRMSNorm(head_dim, eps=rms_norm_eps)

    @classmethod
    def from_config(cls, config, attention_impl="sdpa"):
        """From a Qwen3_5TextConfig, Qwen3_5MoeTextConfig or Qwen3NextConfig."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.rms_norm_eps, config.attention_bias, attention_impl)

    def forward(self, hidden, cos, sin, mask=None):
        """hidden [B, S, H]; cos, sin: PartialRotaryEmbedding's tables; mask: an additive [B, 1, S, S] mask
        (the stage's mask of packed documents: causal within each, models/attention_kernels.py additive_mask),
        or None for causal attention."""
        batch, seq, _ = hidden.shape
        query, gate = self.q_proj(hidden).view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, mask, self.attention_impl, self.head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(batch, seq, -1) * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)
