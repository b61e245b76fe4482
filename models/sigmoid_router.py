"""DeepSeek-V3's router (GLM-4.5's is the same), beside the softmax routers of models/moe.py: sigmoid scores, a
per-expert correction bias that chooses the experts but does not weight them, top-k limited to the best groups of
experts, and weights normalised and scaled, exactly as transformers' DeepseekV3TopkRouter computes them.

Routing without an auxiliary loss: in training DeepSeek-V3 moves each expert's bias after every step towards
balance (balanced_correction_bias); transformers implements the forward only, so with a rate of 0 the bias is the
checkpoint's, frozen.
"""
import torch
import torch.nn.functional as F
from torch import nn

from models.tensor_parallel import NO_TENSOR_PARALLEL


class SigmoidRouter(nn.Module):
    """The `gate` of a DeepSeek-V3 MoE layer: `weight` [experts, hidden] and the buffer `e_score_correction_bias`
    [experts] (saved with the layer, as the checkpoint holds it), both fp32 in transformers
    (_keep_in_fp32_modules_strict), the logits computed in fp32 whatever the hidden states' dtype."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.num_groups, self.top_groups = config.n_group, config.topk_group
        self.normalize, self.scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.parallel = parallel
        weight = torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight.normal_(std=0.02))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden):
        """(router logits [tokens, experts] fp32, routing weights [tokens, top_k] fp32, expert ids [tokens, top_k])
        of hidden [tokens, hidden_size]."""
        logits = F.linear(hidden.float(), self.parallel.replicated(self.weight).float())
        weights, expert_ids = self.route(logits)
        return logits, weights, expert_ids

    def route(self, logits):
        scores = logits.sigmoid()
        expert_ids = group_limited_top_k(scores + self.e_score_correction_bias, self.top_k, self.num_groups,
                                         self.top_groups)
        weights = scores.gather(1, expert_ids)  # the scores without the bias weight the experts
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling_factor, expert_ids


def group_limited_top_k(choice_scores, top_k, num_groups, top_groups):
    """The top_k experts [tokens, top_k] of each token among the experts of its top_groups best groups, a group
    (num_groups contiguous blocks of experts) ranked by the sum of its two best scores. The same torch.topk calls
    (sorted=False) on the same values as transformers: the ids come in its order, which the weights' sum follows."""
    tokens, num_experts = choice_scores.shape
    grouped = choice_scores.view(tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    masked = grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, num_experts)
    return torch.topk(masked, k=top_k, dim=-1, sorted=False)[1]


def balanced_correction_bias(bias, loads, rate):
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias moved by rate towards balance, up when the
    expert took fewer tokens than the mean, down when more, unchanged at the mean: bias + rate * sign(mean - load).
    loads: [experts] tokens routed to each over the global batch (every data-parallel rank, every micro-batch)."""
    loads = loads.to(bias.dtype)
    return bias + rate * torch.sign(loads.mean() - loads)
