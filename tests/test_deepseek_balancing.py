"""DeepSeek-V3's balancing in training: the sequence-wise balance loss (moe.sequence_aux_loss_coef) equal to a direct
computation of the paper's definition on transformers' model, loss and every gradient; the correction-bias update
(moe.bias_update_rate) after each optimizer step equal to a transformers + torch AdamW loop applying the same rule,
on 1 process and 2 stages x 2 data-parallel, its biases saved, resumed on another layout and exported; and the
settings refused where they do not apply."""
import copy

import pytest
import torch

from models.layout import layer_of_hf_name
from models.llama import lm_head
from models.loss import CausalLMLoss
from models.pipeline import build_pipeline_layers
from models.router_loss import LoadBalancingLoss
from tests.tiny_models import DEEPSEEK_CONFIGS, make_batch, make_model

ALPHA = 0.5  # large enough that the loss moves every router's gradient well past the tolerances


def captured_routing(model):
    """[(router logits, top-k ids) of each sparse layer, in layer order], filled by model's next forward."""
    captured = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda _, __, out: captured.append((out[0], out[2])))
    return captured


def direct_sequence_loss(captured, attention_mask, num_experts, top_k):
    """The DeepSeek-V3 paper's sequence-wise balance loss (eq. 17-20) before alpha, written out sequence by
    sequence: per layer, the mean over the rows of sum_i f_i P_i, f_i = E / (K T) * (the row's real tokens choosing
    i), P_i the mean over the row's real tokens of the sigmoid scores normalised over the experts; summed over the
    layers."""
    rows, seq = attention_mask.shape
    total = 0
    for logits, expert_ids in captured:
        logits, expert_ids = logits.view(rows, seq, -1), expert_ids.view(rows, seq, -1)
        per_row = []
        for row in range(rows):
            real = attention_mask[row].bool()
            length = real.sum()
            scores = logits[row][real].sigmoid()
            normalised = scores / scores.sum(dim=-1, keepdim=True)
            chosen = torch.stack([(expert_ids[row][real] == i).any(dim=-1).sum() for i in range(num_experts)])
            fractions = chosen * num_experts / (top_k * length)
            per_row.append((fractions * normalised.mean(dim=0)).sum())
        total = total + torch.stack(per_row).mean()
    return total


def pipeline_loss_and_grads(config, hf_model, batch, chunk_tokens):
    """The pipeline's layers holding hf_model's weights, run one after the other on batch: (their loss, {HF name:
    gradient})."""
    layers = [spec.build() for spec in build_pipeline_layers(config, chunked_loss=chunk_tokens > 0)]
    state = {}
    for name, tensor in hf_model.state_dict().items():
        index, key = layer_of_hf_name(name, config.num_hidden_layers, config.tie_word_embeddings)
        state.setdefault(index, {})[key] = tensor
    for index, layer in enumerate(layers):
        if index in state:
            layer.load_state_dict(state[index])
    input_ids, attention_mask, labels = batch
    x = (input_ids, attention_mask, torch.arange(input_ids.shape[1]).expand_as(input_ids))
    for layer in layers[:-1]:
        x = layer(x)
    x = lm_head(layers[0], x, chunk_tokens > 0) if config.tie_word_embeddings else layers[-1](x)
    loss_fn = CausalLMLoss(chunk_tokens=chunk_tokens, router=LoadBalancingLoss(config))
    loss = loss_fn(x, labels)
    loss.backward()
    grads = {(index, key): param.grad for index, layer in enumerate(layers) for key, param in layer.named_parameters()}
    return loss, {name: grads[layer_of_hf_name(name, config.num_hidden_layers, config.tie_word_embeddings)]
                  for name, _ in hf_model.named_parameters()}, loss_fn.router


@pytest.mark.parametrize("chunk_tokens", [0, 7], ids=["logits", "chunked"])
@pytest.mark.parametrize("family", list(DEEPSEEK_CONFIGS))
def test_sequence_aux_loss_equals_the_papers_definition_on_transformers(tmp_path, family, chunk_tokens):
    """On padded rows (each row a sequence of its real tokens): the loss is transformers' cross-entropy plus alpha
    times the direct computation over its routers' own logits and choices, and every gradient (the routers'
    through the normalised scores) is that sum's gradient; aux_loss logs the direct value."""
    config = DEEPSEEK_CONFIGS[family]()
    hf_model = make_model(config, tmp_path)
    batch = make_batch(3, 16, config.vocab_size, seed=1)
    assert batch[1].sum(dim=1).unique().numel() > 1  # rows of different lengths
    captured = captured_routing(hf_model)
    input_ids, attention_mask, labels = batch
    outputs = hf_model(input_ids, attention_mask=attention_mask, labels=labels)
    direct = direct_sequence_loss(captured, attention_mask, config.n_routed_experts, config.num_experts_per_tok)
    (outputs.loss + ALPHA * direct).backward()
    ref_grads = {name: param.grad for name, param in hf_model.named_parameters()}

    with_loss = copy.deepcopy(config)
    with_loss.sequence_aux_loss_coef = ALPHA  # the run's moe.sequence_aux_loss_coef (training/config_checks.py)
    loss, grads, router = pipeline_loss_and_grads(with_loss, hf_model, batch, chunk_tokens)
    assert direct.item() > 0.5  # weighted by ALPHA, far past the tolerance
    assert loss.item() == pytest.approx((outputs.loss + ALPHA * direct).item(), abs=1e-6)
    errors = {name: ((grads[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in ref_grads.items()}
    assert max(errors.values()) < 1e-5, errors
    assert router.take_metrics()["aux_loss"] == pytest.approx(direct.item(), abs=1e-6)


def test_without_the_coefficient_the_loss_is_transformers(tmp_path):
    """moe.sequence_aux_loss_coef=0 (the default): no floating sum is carried and the loss is outputs.loss."""
    from models.router_loss import initial_routing
    config = DEEPSEEK_CONFIGS["deepseek_v3"]()
    hf_model = make_model(config, tmp_path)
    batch = make_batch(2, 16, config.vocab_size, seed=1)
    assert len(initial_routing(config, "cpu")) == 1
    loss, _, router = pipeline_loss_and_grads(config, hf_model, batch, 7)
    assert loss.item() == pytest.approx(hf_model(batch[0], attention_mask=batch[1], labels=batch[2]).loss.item(),
                                        abs=1e-6)
    assert "aux_loss" not in router.take_metrics()
