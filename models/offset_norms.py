"""The RMSNorms of the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), as transformers computes them: the
offset norm (a (1 + w) scale, its weight zero-initialised) of the decoder's layer norms, the final norm and the full
attention's per-head q_norm / k_norm; and the linear attention's per-head norm gated by SiLU(z)."""
import torch
import torch.nn.functional as F
from torch import nn


class OffsetRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNorm / Qwen3NextRMSNorm over the last dimension: normalised in fp32, scaled by
    (1 + w) in fp32, then cast back (LLaMA's norm casts before its scale)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def reset_parameters(self):
        nn.init.zeros_(self.weight)

    def forward(self, x):
        return offset_rms_norm(x, self.weight, self.eps)


def offset_rms_norm(x, weight, eps):
    """OffsetRMSNorm's math over x's last dimension, which the decoder's RMSNorm takes with offset=True."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNormGated over each value head's features: normalised in fp32, cast back, scaled by w
    (kept in its own dtype: Qwen3.5 stores it in fp32 beside bf16 weights, and the product then stays fp32), times
    SiLU of the gate in fp32, cast to the input's dtype."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x, gate):
        dtype = x.dtype
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)
