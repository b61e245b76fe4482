"""DeepSeek-V3's router (GLM-4.5's is the same), beside the softmax routers of models/moe.py: sigmoid scores, a
per-expert correction bias that chooses the experts but does not weight them, top-k limited to the best groups of
experts, and weights normalised and scaled, exactly as transformers' DeepseekV3TopkRouter computes them.

Routing without an auxiliary loss: in training DeepSeek-V3 moves each expert's bias after every step towards
balance (balanced_correction_bias); transformers implements the forward only, so with a rate of 0 the bias is the
checkpoint's, frozen. Beside it DeepSeek-V3 adds a small sequence-wise balance loss against extreme imbalance
within one sequence (sequence_balance); transformers has none, so it is off unless a run asks for it.
"""
import torch
import torch.nn.functional as F
from torch import nn

# The marker of a parameter kept in fp32 whatever the training dtype, as transformers keeps it
# (_keep_in_fp32_modules_strict): its own parameter group, its fp32 master weight equal to it (training/loop.py).
FP32_MARKER = "keep_in_fp32"


class SigmoidRouter(nn.Module):
    """The `gate` of a DeepSeek-V3 MoE layer: `weight` [experts, hidden] and the buffer `e_score_correction_bias`
    [experts] (saved with the layer, as the checkpoint holds it), both fp32 in transformers
    (_keep_in_fp32_modules_strict) and kept so under bf16 (FP32_MARKER), the logits computed in fp32 whatever the
    hidden states' dtype."""

    linear = staticmethod(F.linear)  # a stage's defers its weight gradient (models/tensor_parallel.py)

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.num_groups, self.top_groups = config.n_group, config.topk_group
        self.normalize, self.scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        weight = torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight.normal_(std=0.02))
        setattr(self.weight, FP32_MARKER, True)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, hidden):
        """(router logits [tokens, experts] fp32, routing weights [tokens, top_k] fp32, expert ids [tokens, top_k])
        of hidden [tokens, hidden_size]."""
        logits = self.linear(hidden.float(), self.weight.float())
        weights, expert_ids = self.route(logits)
        return logits, weights, expert_ids

    def route(self, logits):
        scores = logits.sigmoid()
        # the choice takes no gradient: chosen off the graph, nothing of it is kept for backward
        expert_ids = group_limited_top_k(scores.detach() + self.e_score_correction_bias, self.top_k, self.num_groups,
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


def sequence_balance(logits, expert_ids, tokens, top_k):
    """DeepSeek-V3's sequence-wise balance loss of one layer over a micro-batch, per expert, before its coefficient
    alpha ([E] fp32; the loss is alpha times its sum). For each sequence (a row: tokens.rows) of T real tokens,
    as the DeepSeek-V3 paper's eq. 17-20 define it:

        f_i = E / (top_k * T) * (the tokens that chose expert i: the router's top-k, bias and groups included)
        P_i = 1 / T * sum over the tokens of s'_i,   s' = the sigmoid scores divided by their sum over the experts

    and the layer's term is f_i * P_i averaged over the micro-batch's sequences (rows with a real token; padding
    counts nowhere). f takes no gradient; P's reaches the router's weight through the scores. The per-sequence sums
    are the tokens' own (RoutedTokens.sum_by_row: under sequence parallelism of the whole group's tokens).
    logits: [T, E] fp32; expert_ids: [T, top_k]; tokens: models/moe.py RoutedTokens."""
    scores = logits.sigmoid()
    num_experts = scores.shape[-1]
    real = tokens.real.to(scores.dtype)[:, None]
    chosen = torch.zeros_like(scores).scatter_(1, expert_ids, 1.0)
    per_token = torch.cat([chosen * real, scores / scores.sum(dim=-1, keepdim=True) * real, real], dim=1)
    sums = tokens.sum_by_row(per_token)
    choices, score_sums, lengths = sums.split([num_experts, num_experts, 1], dim=1)
    length = lengths.clamp(min=1)
    fractions, probabilities = choices * (num_experts / top_k) / length, score_sums / length
    sequences = (lengths > 0).to(scores.dtype)
    return (fractions * probabilities * sequences).sum(dim=0) / sequences.sum().clamp(min=1)
