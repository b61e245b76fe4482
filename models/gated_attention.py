"""The gated full attention of the Gated DeltaNet hybrids (transformers' Qwen3_5Attention, Qwen3NextAttention), as one
plain module. Its rotary tables are the decoder's (models/rotary.py over the first partial_rotary_factor of head_dim:
Qwen3.5's multimodal rotary interleaves three position rows, time, height and width, which text positions make the
same row, where it is that one).

q_proj gives each head its query and a gate side by side ([query | gate], 2 * head_dim a head: a split of the heads
must cut on those boundaries); the query and key heads take the offset (1 + w) RMSNorm over their features, then the
rotary embedding on the first partial_rotary_factor of them; softmax attention over grouped key/value heads (the
decoder's AttentionCore, which context parallelism replaces from outside: SDPA or transformers' eager formula) at
scale head_dim ** -0.5; the output times sigmoid(gate)
before o_proj. Parameter names are transformers', so the module's state dict is a decoder layer's `self_attn.*` with
that prefix stripped.
"""
import torch
from torch import nn

from models.attention import AttentionCore
from models.attention_kernels import apply_rotary
from models.offset_norms import OffsetRMSNorm


class GatedAttention(nn.Module):
    """Full attention with an output gate (hidden [B, S, H] -> [B, S, H])."""

    def __init__(self, hidden_size, num_heads, num_key_value_heads, head_dim, rms_norm_eps=1e-6, bias=False,
                 attention_impl="sdpa"):
        super().__init__()
        if num_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                             f"({num_key_value_heads}).")
        self.head_dim = head_dim
        self.window = None  # every layer attends over the whole sequence
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(head_dim, eps=rms_norm_eps)
        self.k_norm = OffsetRMSNorm(head_dim, eps=rms_norm_eps)
        self.core = AttentionCore(attention_impl, head_dim ** -0.5)

    @classmethod
    def from_config(cls, config, attention_impl="sdpa"):
        """From a Qwen3_5TextConfig, Qwen3_5MoeTextConfig or Qwen3NextConfig."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.rms_norm_eps, config.attention_bias, attention_impl)

    def forward(self, hidden, inputs):
        """hidden [B, S, H] (or the rows' tokens flattened alike); inputs: the batch's AttentionInputs
        (models/attention.py: the rotary tables, the additive mask of packed documents or None for causal
        attention, the rows' shape)."""
        batch, seq = inputs.rows
        cos, sin = inputs.cos, inputs.sin
        query, gate = self.q_proj(hidden).view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, (k, v), inputs.mask)
        out = out.transpose(1, 2).reshape(batch, seq, -1) * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)
