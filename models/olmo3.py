"""OLMo 3's decoder layer as plain parts for one device, under transformers' names (a layer's state dict is the
Hugging Face one after `model.layers.{i}.`), computing what transformers 5.24's modeling_olmo3.py computes.

It is OLMo 2's layer (norms after the attention and the MLP, before each residual add, and no input norm; q and k
normed over their whole projections, every head together; SwiGLU; RMSNorms that scale before the cast back) with
what OLMo 3 adds: a layer type per layer (three sliding-window layers, then a full one, by default), each type with
its own rotary parameters (the full layers may carry YaRN or linear scaling alone) and the sliding layers attending
within `sliding_window` positions. Its rotary tables stay in fp32 and each rotation runs in fp32 before the cast
back to the projections' dtype.
"""
import torch
from torch import nn

from models.attention_kernels import apply_rotary, attend
from models.gated_mlp import GatedMLP


class Olmo3RMSNorm(nn.Module):
    """transformers' Olmo3RMSNorm: normalise in fp32, scale in fp32, cast back."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


class Olmo3Attention(nn.Module):
    """Grouped-query attention of decoder layer `layer_index`: forward(hidden [batch, seq, hidden], cos, sin [batch,
    seq, head_dim] fp32 of the layer's type, mask of its type's window or None for causal) -> [batch, seq, hidden].
    `attend(q, k, v, mask)` is the attention core, the seam context parallelism wraps."""

    def __init__(self, config, layer_index, attention_impl="sdpa"):
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.attention_impl = attention_impl
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Olmo3RMSNorm(heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo3RMSNorm(kv_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, mask):
        batch, seq = hidden.shape[:2]
        heads = (batch, seq, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden)).view(heads).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden)).view(heads).transpose(1, 2)
        v = self.v_proj(hidden).view(heads).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin).to(q.dtype), apply_rotary(k, cos, sin).to(k.dtype)
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q, k, v, mask):
        return attend(q, k, v, mask, self.attention_impl)


class Olmo3DecoderLayer(nn.Module):
    """Decoder layer `layer_index`: forward(hidden, cos, sin, mask) -> hidden, with the fp32 tables and the mask of
    the layer's type (`layer_type`, `window`: models/layer_types.py builds them once per micro-batch)."""

    def __init__(self, config, layer_index, attention_impl="sdpa"):
        super().__init__()
        self.self_attn = Olmo3Attention(config, layer_index, attention_impl)
        self.layer_type, self.window = self.self_attn.layer_type, self.self_attn.window
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, mask):
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, cos, sin, mask))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


def olmo3_final_norm(config):
    """The final norm, `model.norm` (the embedding and LM head are plain: nn.Embedding, nn.Linear)."""
    return Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)
