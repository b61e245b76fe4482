"""The RMSNorms of the decoder, as transformers computes each family's: the layer norms, Qwen3's per-head and
OLMo 2's whole-projection query/key norms, MLA's latent norms (models/latent_attention.py)."""
import torch
import torch.nn.functional as F
from torch import nn

from models.tensor_parallel import NO_TENSOR_PARALLEL


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale (scale_in_fp32, OLMo 2's: scale, then
    cast back)."""

    def __init__(self, hidden_size, eps, parallel=NO_TENSOR_PARALLEL, scale_in_fp32=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.parallel = parallel
        self.scale_in_fp32 = scale_in_fp32

    def forward(self, x):
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        weight = self.parallel.replicated(self.weight)
        return (weight * normed).to(x.dtype) if self.scale_in_fp32 else weight * normed.to(x.dtype)


class HeadRMSNorm(RMSNorm):
    """Qwen3's q_norm / k_norm: an RMSNorm over each head's features of a projection's output, one weight shared by
    every head. Under tensor parallelism each rank normalises its own heads, so the weight's gradient is summed
    over the group."""

    def forward(self, x):
        heads = x.unflatten(-1, (-1, self.weight.shape[0]))
        normed = F.rms_norm(heads.float(), (heads.shape[-1],), eps=self.eps)
        return (self.parallel.shared_by_heads(self.weight) * normed.to(x.dtype)).flatten(-2)


class ProjectionRMSNorm(RMSNorm):
    """OLMo 2's and OLMoE's q_norm / k_norm: one RMSNorm over a whole projection's features (every head). Under
    tensor parallelism the weight splits with the heads, and the mean of squares is summed over the group."""

    def __init__(self, whole_width, eps, parallel=NO_TENSOR_PARALLEL, scale_in_fp32=True):
        super().__init__(whole_width // parallel.size, eps, parallel, scale_in_fp32)
        self.whole_width = whole_width
        parallel.mark_sharded(self, dim=0)

    def forward(self, x):
        x32 = x.float()
        mean_square = self.parallel.sum_over_heads(x32.square().sum(-1, keepdim=True)) / self.whole_width
        normed = x32 * torch.rsqrt(mean_square + self.eps)
        return (self.weight * normed).to(x.dtype) if self.scale_in_fp32 else self.weight * normed.to(x.dtype)
