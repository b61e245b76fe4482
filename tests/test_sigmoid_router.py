"""DeepSeek-V3's router (models/sigmoid_router.py) against transformers' DeepseekV3TopkRouter and GLM-4.5's
Glm4MoeTopkRouter on the same weights and correction bias: the same expert ids in the same order and the same
weights, to the last bit, with groups (n_group > 1, topk_group < n_group) and without, normalised or not, scaled;
the bias-balancing rule on given loads."""
import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from models.sigmoid_router import SigmoidRouter, balanced_correction_bias, group_limited_top_k

ROUTERS = {"deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter), "glm4_moe": (Glm4MoeConfig, Glm4MoeTopkRouter)}
CASES = {  # name: config fields
    "groups_normalised": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5),
    "groups_raw": dict(n_routed_experts=16, num_experts_per_tok=3, n_group=8, topk_group=3, norm_topk_prob=False,
                       routed_scaling_factor=1.5),
    "one_group": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=1.0),
}


@pytest.mark.parametrize("family", ROUTERS)
@pytest.mark.parametrize("case", CASES)
def test_router_matches_transformers(family, case):
    config_class, reference_class = ROUTERS[family]
    config = config_class(hidden_size=32, **CASES[case])
    torch.manual_seed(0)
    reference = reference_class(config)
    with torch.no_grad():
        reference.weight.normal_()
        reference.e_score_correction_bias.normal_(std=0.5)  # large enough to change the choice
    ours = SigmoidRouter(config)
    ours.load_state_dict(reference.state_dict())
    hidden = torch.randn(64, 32, dtype=torch.bfloat16)  # the logits in fp32 whatever the hidden states' dtype
    expected_logits, expected_weights, expected_ids = reference(hidden)
    logits, weights, ids = ours(hidden)
    assert torch.equal(logits, expected_logits)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights)
    assert weights.dtype == torch.float32 and ids.shape == (64, config.num_experts_per_tok)
    # The bias chose: without it some tokens would take other experts; it never weights them.
    unbiased = group_limited_top_k(logits.sigmoid(), config.num_experts_per_tok, config.n_group, config.topk_group)
    assert not torch.equal(unbiased.sort(dim=-1).values, ids.sort(dim=-1).values)
    assert torch.equal(weights, ours.route(logits)[0])


def test_experts_outside_the_best_groups_are_never_chosen():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.6, 0.5, 0.95, 0.05]])  # groups of 2: sums 1.7, 0.2, 1.1, 1.0
    ids = group_limited_top_k(scores, top_k=3, num_groups=4, top_groups=2)
    assert sorted(ids[0].tolist()) == [0, 1, 4]  # 6 (0.95, the best expert) sits in the third-best group


def test_bias_moves_each_expert_towards_balance():
    bias = torch.tensor([0.0, 0.1, -0.2, 0.3])
    loads = torch.tensor([10, 2, 6, 6])  # mean 6
    updated = balanced_correction_bias(bias, loads, rate=0.001)
    assert torch.equal(updated, bias + torch.tensor([-0.001, 0.001, 0.0, 0.0]))
    assert torch.equal(balanced_correction_bias(bias, loads, rate=0.0), bias)  # 0: frozen, as transformers
