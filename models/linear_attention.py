"""Gated DeltaNet's token mixer (transformers' Qwen3_5GatedDeltaNet; Qwen3-Next's and Qwen3.5-MoE's compute the
same), as one plain module: the projections, the causal depthwise convolution over q|k|v, the gated delta rule
(models/gated_delta_rule.py), the per-head gated norm and the output projection. Parameter names are transformers',
so the module's state dict is a decoder layer's `linear_attn.*` with that prefix stripped.

Rows are packed documents when document ids come with them (0 on padding, k on a row's k-th document): padding
tokens' inputs are zeroed (transformers' apply_mask_to_padding_states), and the convolution's window and the
recurrent state restart at every change of id, so each document's output is the one transformers gives it alone.

A stretch of a row can continue another (context parallelism's next rank): `forward_carrying` takes and returns a
LinearAttentionCarry, the last kernel - 1 convolution inputs with their document ids and the recurrent state after
the last token, all differentiable, so that chaining the stretches of a row gives the whole row's outputs and
gradients.

On CUDA, with flash-linear-attention (`fla`) installed, the rule runs as its chunk_gated_delta_rule kernel, packed
documents as cu_seqlens, and the convolution as the causal-conv1d package's kernel where that is installed too
(DeltaRuleCore.forward, the one place that chooses: cuda_kernels); the torch path everywhere else, and for a
stretch carried from another (forward_carrying) or fp32 activations (fla's kernel takes 16-bit ones).

Qwen3-Next stores in_proj_qkvz and in_proj_ba fused, grouped by key head: FusedGatedDeltaNet holds them so (the
layer files keep every tensor as stored) and regroups their outputs; split_fused_projections / fuse_projections turn
the weights of one layout into the other's (row permutations, exact both ways).
"""
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.gated_delta_rule import chunk_gated_delta_rule
from models.offset_norms import GatedRMSNorm


# The marker of a parameter transformers computes with in the dtype it is stored in, which a run keeps so whatever its
# training dtype (models/pipeline_layers.py StagePlan.kept_in_fp32): Qwen3.5 stores A_log and the gated norm's weight
# in fp32 beside bf16 weights (the decay and the norm then run in fp32), Qwen3.6 in bf16.
KEPT_AS_STORED = "kept_as_stored"


class LinearAttentionCarry(NamedTuple):
    """What a linear-attention layer hands from one stretch of a row to the stretch after it."""
    conv_inputs: torch.Tensor  # [B, kernel - 1, conv channels]: the convolution's last inputs (q|k|v projections)
    document_ids: torch.Tensor  # [B, kernel - 1]: their document ids (0: padding, or no token)
    recurrent_state: torch.Tensor  # [B, value heads, key features, value features] fp32, after the last token


def causal_conv1d(x, weight, document_ids=None, context=None, context_document_ids=None):
    """SiLU of the causal depthwise convolution of x [B, S, C] (channels last) by weight [C, 1, K], no bias:
    out[t] = silu(sum_m weight[:, 0, m] * x[t - (K - 1) + m]), as transformers' causal_conv1d_fn (an fp32 sum, cast
    to x's dtype once, then the SiLU in it). Inputs before the row are zeros, or `context` [B, K - 1, C] (the
    previous stretch's last inputs); with document_ids [B, S] (and context_document_ids [B, K - 1] beside a context)
    an input of another document than the output's counts as zero."""
    batch, seq, channels = x.shape
    kernel = weight.shape[-1]
    taps = weight.view(channels, kernel).float()
    before = x.new_zeros(batch, kernel - 1, channels) if context is None else context.to(x.dtype)
    inputs = torch.cat([before, x], dim=1)
    if document_ids is not None:
        context_ids = (document_ids.new_zeros(batch, kernel - 1) if context_document_ids is None
                       else context_document_ids)
        all_ids = torch.cat([context_ids, document_ids], dim=1)
    out = x.float() * taps[:, -1]
    for m in range(kernel - 1):
        term = inputs[:, m:m + seq].float() * taps[:, m]
        if document_ids is not None:
            term = term * (all_ids[:, m:m + seq] == document_ids)[..., None]
        out = out + term
    return F.silu(out.to(x.dtype))


class DeltaRuleCore(nn.Module):
    """What a linear-attention layer computes along the sequence, no parameters of its own: the causal convolution
    over q|k|v (the layer's weight passed in) and the gated delta rule over its heads. The one seam context
    parallelism replaces from outside (models/context_parallel.py ContextParallelDeltaRuleCore), as it replaces
    softmax attention's core."""

    def __init__(self, num_key_heads, num_value_heads, key_head_dim, value_head_dim):
        super().__init__()
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim

    def forward(self, qkv, conv_weight, g, beta, document_ids=None, context=None, context_ids=None,
                initial_state=None, output_final_state=False):
        """(output [B, S, Hv, dv], final state or None) of the q|k|v projections qkv [B, S, C], the log decays g and
        betas [B, S, Hv]; document_ids, the convolution's context and the initial state as models/gated_delta_rule.py
        and causal_conv1d take them."""
        kernels = cuda_kernels() if qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16) else None
        if kernels is not None and context is None and initial_state is None and not output_final_state:
            return self.with_kernels(kernels, qkv, conv_weight, g, beta, document_ids), None
        batch, seq, _ = qkv.shape
        key_dim = self.num_key_heads * self.key_head_dim
        mixed = causal_conv1d(qkv, conv_weight, document_ids, context, context_ids)
        query, key, value = mixed.split([key_dim, key_dim, self.num_value_heads * self.value_head_dim], dim=-1)
        return chunk_gated_delta_rule(
            query.reshape(batch, seq, -1, self.key_head_dim), key.reshape(batch, seq, -1, self.key_head_dim),
            value.reshape(batch, seq, -1, self.value_head_dim), g, beta, document_ids, initial_state,
            output_final_state=output_final_state)


    def with_kernels(self, kernels, qkv, conv_weight, g, beta, document_ids):
        """The output through fla's chunk_gated_delta_rule (and causal-conv1d's kernel, if installed), as
        transformers' fast path calls them: q and k L2-normalised in the kernel and repeated to the value heads, each
        packed document a sequence of its own (cu_seqlens over the flattened rows). Reading the documents' starts
        onto the host is one sync per layer and micro-batch, which fla's varlen kernels need (they plan their blocks
        on the host)."""
        rule, conv = kernels
        batch, seq, _ = qkv.shape
        segments = None if document_ids is None else document_segments(document_ids)
        if conv is None:
            mixed = causal_conv1d(qkv, conv_weight, document_ids)
        else:
            mixed = conv(qkv.transpose(1, 2), conv_weight.squeeze(1), bias=None, activation="silu",
                         seq_idx=None if segments is None else segments.to(torch.int32)).transpose(1, 2)
        key_dim = self.num_key_heads * self.key_head_dim
        query, key, value = mixed.split([key_dim, key_dim, self.num_value_heads * self.value_head_dim], dim=-1)
        group = self.num_value_heads // self.num_key_heads
        query, key = (x.reshape(batch, seq, -1, self.key_head_dim).repeat_interleave(group, dim=2)
                      for x in (query, key))
        value = value.reshape(batch, seq, -1, self.value_head_dim)
        if segments is None:
            out, _ = rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            return out
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        first_tokens = starts.reshape(-1).nonzero().squeeze(1)
        cu_seqlens = torch.cat([first_tokens, first_tokens.new_tensor([batch * seq])])
        flat = lambda x: x.reshape(1, batch * seq, *x.shape[2:])  # noqa: E731
        out, _ = rule(flat(query), flat(key), flat(value), g=flat(g), beta=flat(beta), cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=True)
        return out.view(batch, seq, *out.shape[2:])


@functools.cache
def cuda_kernels():
    """(fla's chunk_gated_delta_rule, causal-conv1d's causal_conv1d_fn or None) where flash-linear-attention is
    installed, else None: whether CUDA runs the kernels (asked once a process)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule
    except ImportError:
        return None
    try:
        from causal_conv1d import causal_conv1d_fn as conv
    except ImportError:
        conv = None
    return rule, conv


def document_segments(document_ids):
    """[B, S] int64: each token's run of equal document ids within its row, numbered from 0 (padding's run too):
    what causal-conv1d's seq_idx and the sequences of cu_seqlens keep apart."""
    changes = torch.zeros_like(document_ids)
    changes[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    return changes.cumsum(dim=1)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of one decoder layer (hidden [B, S, H] -> [B, S, H])."""

    def __init__(self, hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim, conv_kernel_size,
                 rms_norm_eps=1e-6):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear_num_value_heads ({num_value_heads}) is not a multiple of linear_num_key_heads "
                             f"({num_key_heads}): each key head serves a whole group of value heads.")
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim, self.value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.conv_kernel_size = conv_kernel_size
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        # transformers' nn.Conv1d (depthwise, no bias): its weight [C, 1, K] under the same name
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel_size, groups=conv_dim, bias=False,
                                padding=conv_kernel_size - 1)
        self.core = DeltaRuleCore(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads))
        self.reset_parameters()
        self.norm = GatedRMSNorm(value_head_dim, eps=rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        for param in (self.A_log, self.norm.weight):
            setattr(param, KEPT_AS_STORED, True)
        # q, k and v channels, which a split by heads cuts apart (models/tensor_parallel.py shard_of): marked
        # whatever the split, so that a checkpoint saved split loads whole
        for param in (self.in_proj_qkv.weight, self.conv1d.weight):
            param.tensor_parallel_blocks = (self.key_dim, self.key_dim, self.value_dim)

    def reset_parameters(self):
        """transformers' initialisation of the parameters the module holds itself (the decays'): a parameter made
        after a build on the meta device gets it (models/tensor_parallel.py materialize)."""
        with torch.no_grad():
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())

    @classmethod
    def from_config(cls, config):
        """From a Qwen3_5TextConfig, Qwen3_5MoeTextConfig or Qwen3NextConfig (their linear_* fields)."""
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                   config.rms_norm_eps)

    def forward(self, hidden, document_ids=None, rows=None):
        """hidden [B, S, H]; document_ids [B, S] or None (each row one document, no padding); rows: (B, S) where
        hidden holds the rows' tokens flattened (sequence parallelism's layout around the projections)."""
        return self.mix(hidden, document_ids, None, carry_out=False, rows=rows)[0]

    def projections(self, hidden):
        """(q|k|v, z, b, a): the projections of hidden, each over its last dimension."""
        return self.in_proj_qkv(hidden), self.in_proj_z(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden)

    def forward_carrying(self, hidden, document_ids=None, carry=None):
        """(output, the LinearAttentionCarry after the stretch): the stretch continues `carry` (None: starts the row)
        where its first token is of the carry's last token's document (document_ids None: it is)."""
        return self.mix(hidden, document_ids, carry, carry_out=True)

    def mix(self, hidden, document_ids, carry, carry_out, rows=None):
        """(output, the LinearAttentionCarry after the stretch if carry_out, else None)."""
        batch, seq = hidden.shape[:2] if rows is None else rows
        # padding's projections zeroed: transformers zeroes its inputs (the projections have no bias)
        qkv, z, b, a = (x.reshape(batch, seq, -1) if document_ids is None else
                        x.reshape(batch, seq, -1) * (document_ids != 0)[..., None].to(x.dtype)
                        for x in self.projections(hidden))
        z = z.view(batch, seq, -1, self.value_head_dim)
        beta = b.sigmoid()
        # fp32 whatever the weights' dtype (A_log may be stored in fp32 beside bf16 weights), as transformers
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        context = context_ids = initial_state = None
        if carry is not None:
            context, context_ids, initial_state = carry
            if document_ids is not None:  # the state goes on only into the document it was left in
                initial_state = initial_state * (context_ids[:, -1] == document_ids[:, 0]).to(
                    initial_state.dtype)[:, None, None, None]
        out, final_state = self.core(qkv, self.conv1d.weight, g, beta, document_ids, context, context_ids,
                                     initial_state, output_final_state=carry_out)
        out = self.out_proj(self.norm(out, z).reshape(batch, seq, -1))
        if not carry_out:
            return out, None
        return out, self.carry_after(qkv, document_ids, context, context_ids, final_state)

    def carry_after(self, qkv, document_ids, context, context_ids, final_state):
        """The LinearAttentionCarry after a stretch: its last kernel - 1 convolution inputs (the carry's before
        them where the stretch is shorter) and their documents, and the final state."""
        batch, seq, channels = qkv.shape
        keep = self.conv_kernel_size - 1
        if document_ids is None:  # one document: the carry's, or the row's first
            document_ids = torch.ones(batch, seq, dtype=torch.long, device=qkv.device) if context_ids is None \
                else context_ids[:, -1:].expand(batch, seq)
        if context is None:
            context = qkv.new_zeros(batch, keep, channels)
            context_ids = document_ids.new_zeros(batch, keep)
        inputs = torch.cat([context.to(qkv.dtype), qkv], dim=1)[:, -keep:]
        ids = torch.cat([context_ids, document_ids], dim=1)[:, -keep:]
        return LinearAttentionCarry(inputs, ids, final_state)


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear attention: GatedDeltaNet holding in_proj_qkvz and in_proj_ba as the checkpoint stores
    them (rows grouped by key head: its q, its k, its group's v, then z; its group's b, then a), their outputs
    regrouped into q|k|v, z, b, a as transformers' fix_query_key_value_ordering does. A split of the key heads cuts
    both projections on those groups' boundaries."""

    def __init__(self, hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim, conv_kernel_size,
                 rms_norm_eps=1e-6):
        super().__init__(hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim, conv_kernel_size,
                         rms_norm_eps)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_value_heads, bias=False)  # (grouped by key head: no blocks)

    def projections(self, hidden):
        group = self.num_value_heads // self.num_key_heads
        key, value = self.key_head_dim, group * self.value_head_dim
        qkvz = self.in_proj_qkvz(hidden)
        q, k, v, z = qkvz.unflatten(-1, (-1, 2 * key + 2 * value)).split([key, key, value, value], dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (-1, 2 * group)).split([group, group], dim=-1)
        return torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1), z.flatten(-2), b.flatten(-2), \
            a.flatten(-2)


def split_fused_projections(qkvz, ba, num_key_heads, num_value_heads, key_head_dim, value_head_dim):
    """Qwen3-Next's in_proj_qkvz and in_proj_ba (rows grouped by key head: q, k, then the group's v and z; the
    group's b, then its a) as Qwen3.5's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): every q row, every k row,
    every v row; z; b; a. Any tensor whose rows are the projection's outputs (a weight, a LoRA B)."""
    group = num_value_heads // num_key_heads
    heads = qkvz.view(num_key_heads, 2 * key_head_dim + 2 * group * value_head_dim, *qkvz.shape[1:])
    q, k, v, z = heads.split([key_head_dim, key_head_dim, group * value_head_dim, group * value_head_dim], dim=1)
    b, a = ba.view(num_key_heads, 2 * group, *ba.shape[1:]).split([group, group], dim=1)
    rows = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    return torch.cat([rows(q), rows(k), rows(v)]), rows(z), rows(b), rows(a)


def fuse_projections(qkv, z, b, a, num_key_heads, num_value_heads, key_head_dim, value_head_dim):
    """split_fused_projections' inverse: (in_proj_qkvz, in_proj_ba) in Qwen3-Next's layout."""
    key_dim = num_key_heads * key_head_dim
    q, k, v = qkv.split([key_dim, key_dim, qkv.shape[0] - 2 * key_dim])
    heads = lambda x: x.reshape(num_key_heads, -1, *x.shape[1:])  # noqa: E731
    qkvz = torch.cat([heads(q), heads(k), heads(v), heads(z)], dim=1).reshape(-1, *qkv.shape[1:])
    return qkvz, torch.cat([heads(b), heads(a)], dim=1).reshape(-1, *b.shape[1:])
