"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight), as transformers' DeepseekV3Attention.

Queries come through a low-rank latent (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; one `q_proj` when
q_lora_rank is None); keys and values through one compressed latent per token: `kv_a_proj_with_mqa` gives
kv_lora_rank latent features and qk_rope_head_dim rotary ones; the latent, normalised (`kv_a_layernorm`), expands
through `kv_b_proj` into each head's qk_nope_head_dim key features and v_head_dim value features; the rotary
features are one key part shared by every head. A query or key head is its non-rotary features then its rotary
ones (qk_nope_head_dim + qk_rope_head_dim); the value head is v_head_dim wide. With rope_interleave (DeepSeek's
checkpoints) the rotary features pair up interleaved, (x0, x1), (x2, x3), ...

Tensor parallelism splits the heads (`q_b_proj` or `q_proj`, `kv_b_proj` by output rows, `o_proj` by input
columns) and keeps the latent projections and their norms whole on every rank: they are narrow (DeepSeek-V3's
`kv_a_proj_with_mqa` is 576 x 7168, `q_a_proj` 1536 x 7168: 16 MB of 1.3 GB per layer in bf16), and splitting
them would put a collective inside each latent norm. Each rank computes them on its own tokens (this rank's share
under sequence parallelism), then the latents, not the hidden states, cross the group: kv_lora_rank +
qk_rope_head_dim (+ q_lora_rank) features a token, 2,112 against a hidden size of 7,168 for DeepSeek-V3.

Context parallelism all-gathers the keys' latent and rotary part (576 features a token), not the expanded keys and
values (num_heads x 320 = 40,960 for DeepSeek-V3), and expands the whole sequence's latent on every rank of the
group: the latent's gradient is reduce-scattered back, the expansion's weight gradient of each rank's queries is
summed over the group with the data-parallel ones (models/context_parallel.py).
"""
import functools
import math

import torch
from torch import nn

from models.attention_kernels import apply_rotary, attend, deinterleave
from models.context_parallel import NO_CONTEXT_PARALLEL
from models.norms import RMSNorm
from models.tensor_parallel import NO_TENSOR_PARALLEL

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
    """The attention of a decoder layer of an MLA model; forward takes and returns what models/llama.py's Attention
    does."""

    def __init__(self, config, attention_impl, parallel=NO_TENSOR_PARALLEL, context=NO_CONTEXT_PARALLEL,
                 layer_index=0):
        super().__init__()
        self.attention_impl, self.parallel, self.context = attention_impl, parallel, context
        self.window = None
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_rank, self.kv_rank = config.q_lora_rank, config.kv_lora_rank
        self.interleaved = config.rope_interleave
        self.scale = softmax_scale(config)
        heads = parallel.local(config.num_attention_heads, "num_attention_heads")
        hidden, bias, qk_dim = config.hidden_size, config.attention_bias, self.nope + self.rope
        if self.q_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
            parallel.mark_sharded(self.q_proj, dim=0)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, parallel)
            self.q_b_proj = nn.Linear(self.q_rank, heads * qk_dim, bias=False)
            parallel.mark_sharded(self.q_b_proj, dim=0)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, parallel)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        parallel.mark_sharded(self.kv_b_proj, dim=0)
        parallel.mark_sharded(self.o_proj, dim=1)

    def forward(self, x, cos, sin, mask, batch, seq):
        q_latent, kv_latent, k_rot = self.latents(x)
        q = self.parallel.whole_input_linear(q_latent, self.q_b_proj) if self.q_rank is not None else \
            self.parallel.column_linears(x, [self.q_proj])[0]
        q_nope, q_rot = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        k_rot = k_rot.reshape(batch, 1, seq, self.rope)
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat([q_nope, apply_rotary(q_rot, cos, sin)], dim=-1)
        # The whole sequence's latent and rotary key part, under context parallelism.
        kv_latent, k_rot = self.context.gather_keys_values(kv_latent.reshape(batch, 1, seq, self.kv_rank),
                                                           apply_rotary(k_rot, cos, sin))
        k, v = self.expand(kv_latent, k_rot)
        out = self.context.attend(functools.partial(attend, attention_impl=self.attention_impl, scale=self.scale),
                                  q, k, v, mask)
        return self.parallel.row_linear(out.transpose(1, 2).reshape(batch, seq, -1), self.o_proj)

    def latents(self, x):
        """(the query latent, normalised, or None; the key/value latent, normalised; the rotary key part) of every
        token, each (tokens, features), from this rank's tokens: the latent projections and norms, held whole by
        every rank, on its own share of the tokens, then gathered (under sequence parallelism; else the gradient
        of each rank's heads summed over the group)."""
        kv = self.parallel.replicated_linear(x, self.kv_a_proj_with_mqa)
        kv_latent, k_rot = kv.split([self.kv_rank, self.rope], dim=-1)
        parts = [self.kv_a_layernorm(kv_latent), k_rot]
        if self.q_rank is not None:
            parts.insert(0, self.q_a_layernorm(self.parallel.replicated_linear(x, self.q_a_proj)))
        whole = self.parallel.whole_input(torch.cat(parts, dim=-1).reshape(-1, sum(p.shape[-1] for p in parts)))
        *q_latent, kv_latent, k_rot = whole.split([p.shape[-1] for p in parts], dim=-1)
        return (q_latent[0] if q_latent else None), kv_latent, k_rot

    def expand(self, kv_latent, k_rot):
        """Keys and values (batch, heads, tokens, features) from the latent (batch, 1, tokens, kv_lora_rank) and the
        rotated key part (batch, 1, tokens, qk_rope_head_dim) every head shares."""
        batch, _, tokens, _ = kv_latent.shape
        kv = self.parallel.whole_input_linear(kv_latent, self.kv_b_proj).view(batch, tokens, -1, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1), v
