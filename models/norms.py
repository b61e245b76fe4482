"""The RMSNorms of the decoder, as transformers computes each family's: the layer norms, Qwen3's per-head and
OLMo 2's whole-projection query/key norms, MLA's latent norms (models/latent_attention.py)."""
import torch
import torch.nn.functional as F
from torch import nn

from models.offset_norms import offset_rms_norm


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale (scale_in_fp32, OLMo 2's: scale, then
    cast back); offset: the Gated DeltaNet hybrids' (1 + w) scale in fp32, its weight initialised to 0
    (models/offset_norms.py)."""

    def __init__(self, hidden_size, eps, scale_in_fp32=False, offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset else torch.ones(hidden_size))
        self.eps = eps
        self.scale_in_fp32, self.offset = scale_in_fp32, offset

    def reset_parameters(self):
        (nn.init.zeros_ if self.offset else nn.init.ones_)(self.weight)

    def forward(self, x):
        if self.offset:
            return offset_rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight * normed).to(x.dtype) if self.scale_in_fp32 else self.weight * normed.to(x.dtype)


class HeadRMSNorm(RMSNorm):
    """Qwen3's q_norm / k_norm: an RMSNorm over each head's features of a projection's output, one weight shared by
    every head."""

    def forward(self, x):
        heads = x.unflatten(-1, (-1, self.weight.shape[0]))
        normed = F.rms_norm(heads.float(), (heads.shape[-1],), eps=self.eps)
        return (self.weight * normed.to(x.dtype)).flatten(-2)


class ProjectionRMSNorm(RMSNorm):
    """OLMo 2's and OLMoE's q_norm / k_norm: one RMSNorm over a whole projection's features (every head), its
    weight applied after the cast back but with scale_in_fp32."""

    def __init__(self, width, eps, scale_in_fp32=True):
        super().__init__(width, eps, scale_in_fp32)
        self.whole_width = width

    def forward(self, x):
        x32 = x.float()
        mean_square = self.square_sum(x32) / self.whole_width
        normed = x32 * torch.rsqrt(mean_square + self.eps)
        return (self.weight * normed).to(x.dtype) if self.scale_in_fp32 else self.weight * normed.to(x.dtype)

    def square_sum(self, x32):
        """The sum of squares over the projection's features."""
        return x32.square().sum(-1, keepdim=True)
