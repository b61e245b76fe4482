"""The planner on Gemma 3 and Gemma 4 (planner/stage_costs.py, models/partition.py): each type of layer (sliding,
full, reusing another's keys and values) priced with the parameters of the layer the pipeline builds, on one rank and
per tensor-parallel rank (per-layer embeddings whole on every rank), a tied LM head once beside the embedding, the
model's count equal to transformers'; the tuple between stages (per-layer embeddings' inputs, carried keys and values)
priced as the bytes the pipeline sends."""
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4TextConfig

from models.partition import EMBEDDING, HEAD, decoder_kinds, layer_kinds, model_parameter_count
from models.pipeline_layers import layers_on_meta
from models.tensor_parallel import TensorParallel
from planner.stage_costs import LayerCosts
from planner.workload import Workload
from tests.tiny_models import GEMMA4, GEMMA4_K_EQ_V, LAYER_TYPE_CONFIGS

GEMMAS = ["gemma3_text", "gemma4_e2b", "gemma4_31b", "gemma4_26b_a4b"]
CONF = pathlib.Path(__file__).resolve().parent.parent / "conf"


def tiny(name, tensor_parallel=1):
    """The tiny config; Gemma 4 31B-like with 2 global key/value heads under tensor parallelism 2 (its one would not
    split)."""
    if name == "gemma4_31b" and tensor_parallel > 1:
        return Gemma4TextConfig(**GEMMA4, **{**GEMMA4_K_EQ_V, "num_global_key_value_heads": 2})
    return LAYER_TYPE_CONFIGS[name]()


@pytest.mark.parametrize("name,tensor_parallel", [(name, tensor_parallel) for name in GEMMAS for tensor_parallel in (1, 2)])
def test_the_planner_prices_the_layers_it_builds(name, tensor_parallel):
    """Every pipeline layer's priced parameters are those of the layer built on the meta device for one
    tensor-parallel rank, layer by layer (full layers' own widths, reusing layers without k/v projections and with
    their double-wide MLP, the per-layer table's columns); one stage holds the tied head once, and the model's count,
    each tied weight once, is transformers'."""
    config = tiny(name, tensor_parallel)
    costs = LayerCosts(config, Workload(seq_length=16, micro_batch_size=2, tensor_parallel=tensor_parallel))
    kinds = layer_kinds(config)
    built = {index: sum(p.numel() for p in module.parameters())
             for index, module in layers_on_meta(config, TensorParallel(tensor_parallel)).items()}
    assert {index: costs.parameters[kinds[index]] for index in built} == built
    assert len(set(decoder_kinds(config))) > 1  # sliding and full layers apart
    assert costs.stage_parameters(kinds) == sum(built.values())  # layers_on_meta: no module for the tied head
    assert costs.stage_parameters(kinds[:2]) + costs.stage_parameters(kinds[2:]) == sum(built.values()) + \
        costs.parameters[EMBEDDING]  # on two stages the head's copy
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model_parameter_count(config) == sum(p.numel() for p in model.parameters())
    assert costs.parameters[HEAD] == costs.parameters[EMBEDDING]


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_26b_a4b", "gemma3_text"])
def test_the_priced_stage_tuples_are_the_bytes_the_pipeline_sends(name):
    """The tuple after the embedding and after every decoder layer, run on 2 padded rows: its bytes (the hidden
    states, Gemma 4's embedded tokens and token ids for the per-layer embeddings, the keys and values of layers 2
    and 3 from where they are stored to their reusers 4 and 5, ids, positions, routing counts) and its floating
    tensors' (the gradient sent back) as LayerCosts.boundary_bytes prices them."""
    from models.pipeline import build_pipeline_layers
    from tests.tiny_models import make_batch
    config = tiny(name)
    batch, seq = 2, 16
    costs = LayerCosts(config, Workload(seq_length=seq, micro_batch_size=batch, precision="fp32"))
    layers = [spec.build() for spec in build_pipeline_layers(config)]
    input_ids, attention_mask, _ = make_batch(batch, seq, config.vocab_size)
    tuples = [(input_ids, attention_mask, torch.arange(seq).expand(batch, seq))]
    with torch.no_grad():
        for layer in layers[:config.num_hidden_layers + 1]:
            tuples.append(layer(tuples[-1]))
    for after, sent in enumerate(tuples[1:], start=-1):
        floating = sum(t.numel() * t.element_size() for t in sent if t.is_floating_point())
        assert costs.boundary_bytes(after) == (sum(t.numel() * t.element_size() for t in sent), floating), after
    carried = [costs.boundary_bytes(after)[1] for after in range(-1, config.num_hidden_layers)]
    if name == "gemma4_e2b":  # the keys and values of 2 (from 2 to 3) and of 2 and 3 (to 4), of 3 (to 5)
        kv = costs.key_value_bytes
        assert [c - carried[0] for c in carried] == [0, 0, 0, kv[2], kv[2] + kv[3], kv[3], 0]
        # a stage of the embedding and layers 0-2, then one of layers 3-5: the first makes and sends layer 2's keys
        # and values (with its hidden states), the second receives them
        kinds = layer_kinds(config)
        first, second = costs.stage_boundaries(kinds[:4], 0), costs.stage_boundaries(kinds[4:], 4)
        assert first[1:] == (costs.boundary_bytes(2), costs.hidden_bytes + kv[2])
        assert second[0] == costs.boundary_bytes(2)


@pytest.mark.parametrize("name,published", [("gemma3_27b", 27.0), ("gemma4_31b", 30.7), ("gemma4_26b_a4b", 25.2)])
def test_shipped_configs_count_transformers_parameters(name, published):
    """The shipped configs' sizes (conf/*.yaml model_config) give the published parameter counts as transformers'
    text model counts them, and the planner's count is that model's."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig
    fields = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml").model_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert model_parameter_count(config) == count
    assert round(count / 1e9, 1) == published
