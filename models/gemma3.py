"""Gemma 3's text model as plain parts for one device, under transformers' names (a decoder layer's state dict is
the Hugging Face one after `model.layers.{i}.`), computing what transformers 5.24's modeling_gemma3.py computes:

- every RMSNorm scales by (1 + w), its weight zero-initialised, in fp32 before the cast back;
- a decoder layer has sandwich norms: input and post-attention norms around the attention, pre- and post-feedforward
  norms around the MLP, each sublayer's output normed before its residual add;
- attention has per-head q and k norms before the rotary embedding and scales its scores by
  `query_pre_attn_scalar ** -0.5`; its window and rotary parameters come from its layer type (models/layer_types.py:
  the sliding layers' θ and the full layers' θ with their own scaling); GQA; biases where attention_bias says;
- the MLP is GeGLU (gelu_pytorch_tanh);
- the embedding is multiplied by sqrt(hidden_size) rounded to the weight's dtype (55.4256 is 55.5 in bf16);
- the final logits may be soft-capped (final_logit_softcapping).

transformers' Gemma 3 attention never passes attn_logit_softcapping to its attention functions, so it changes
nothing there, nor here. Gemma 4 (models/gemma4.py) differs in most of these; it shares only the embedding, the
soft cap and the gated MLP, whose math is the same.
"""
import torch
from torch import nn

from models.architecture import check_gemma_line
from models.attention import AttentionCore
from models.attention_kernels import apply_rotary
from models.gated_mlp import GatedMLP


class Gemma3RMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: normalise in fp32, scale by (1 + w) in fp32, cast back (Qwen3.5's norm too)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self):  # a layer built on the meta device is initialised by it (tensor or expert parallelism)
        nn.init.zeros_(self.weight)

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """An embedding multiplied by `scale` rounded to the weight's dtype, as Gemma's scaled word embeddings do (Gemma
    3's and Gemma 4's token embeddings: sqrt(hidden_size); Gemma 4's per-layer table: sqrt(its width)). Rounded as
    transformers rounds it: to fp32 first (its buffer's dtype), then to the weight's. The pad token's row takes no
    gradient (padding_idx), as transformers builds it."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx, scale):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.scale = scale

    def forward(self, input_ids):
        # The scale rounded on the host (a CPU tensor's item, no device sync), then one multiply.
        return super().forward(input_ids) * torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype).item()


def soft_cap(logits, cap):
    """cap * tanh(logits / cap), transformers' final_logit_softcapping (None: the logits as they are). Elementwise,
    so a chunked loss applies it to each chunk's logits (and a tensor-parallel rank to its vocabulary share)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def soft_cap_derivative(capped, cap):
    """d soft_cap / d logits from the capped logits themselves, 1 - (capped / cap)^2: what a loss that computes its
    logits' gradient by hand (models/loss.py's chunked cross-entropy) multiplies that gradient by."""
    if cap is None:
        return torch.ones_like(capped)
    return 1 - (capped / cap).square()


class Gemma3Attention(nn.Module):
    """Grouped-query attention of decoder layer `layer_index`.

    forward(hidden [batch, seq, hidden], cos, sin [batch, seq, head_dim] of the layer's type, mask: the additive mask
    of its type's window or None for causal) -> [batch, seq, hidden]. Its scores scaled by query_pre_attn_scalar **
    -0.5 in its `core` (models/attention.py AttentionCore, on heads-first tensors), the seam context parallelism
    wraps."""

    def __init__(self, config, layer_index, attention_impl="sdpa"):
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.head_dim = config.head_dim
        self.core = AttentionCore(attention_impl, config.query_pre_attn_scalar ** -0.5)
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, mask):
        batch, seq = cos.shape[:2]  # the rows' shape, also where hidden is their tokens flattened (tensor parallel)
        heads = (batch, seq, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden).view(heads)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden).view(heads)).transpose(1, 2)
        v = self.v_proj(hidden).view(heads).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, (k, v), mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Gemma3DecoderLayer(nn.Module):
    """Decoder layer `layer_index`: forward(hidden, cos, sin, mask) -> hidden, with the tables and mask of the
    layer's type (`layer_type`, `window`: models/layer_types.py builds them once per micro-batch)."""

    def __init__(self, config, layer_index, attention_impl="sdpa"):
        super().__init__()
        check_gemma_line(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_index, attention_impl)
        self.layer_type, self.window = self.self_attn.layer_type, self.self_attn.window
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = Gemma3RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)

    def forward(self, hidden, cos, sin, mask):
        attention = self.self_attn(self.input_layernorm(hidden), cos, sin, mask)
        hidden = hidden + self.post_attention_layernorm(attention)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def gemma3_embedding(config):
    """The token embedding, `model.embed_tokens` (Gemma 3 ties the LM head to it)."""
    return ScaledEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id, config.hidden_size ** 0.5)


def gemma3_final_norm(config):
    """The final norm, `model.norm`."""
    return Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

