"""The planner on the Gated DeltaNet hybrids (planner/decoder_costs.py, models/partition.py): each kind of layer
(linear attention apart from gated full attention, dense or sparse) costed with its own parameters (equal to the
layer's), its own FLOPs (the chunked rule's instead of attention's) and what it keeps for backward (the linear
attention's measured from its forward on the meta device, within 6% of autograd's on the CPU for the whole decoder
layer), and the shipped configs qwen3_5_27b and qwen3_5_397b_a17b planned to fit the hardware they name, every
parameter of transformers' text model counted."""
import pytest
import torch

from models.partition import LINEAR_PREFIX, decoder_kinds, kind_layer, training_flops_per_token
from models.pipeline_layers import DecoderLayerPipe, StageTuple
from models.attention import StageAttentionInputs
from planner.decoder_costs import DecoderCosts
from planner.workload import Workload
from tests.test_partition import saved_activation_bytes
from tests.tiny_models import HYBRID_CONFIGS


@pytest.mark.parametrize("family", list(HYBRID_CONFIGS))
def test_each_kind_of_layer_has_its_own_parameters(family):
    config = HYBRID_CONFIGS[family]()
    kinds = decoder_kinds(config)
    assert {kind.startswith(LINEAR_PREFIX) for kind in kinds} == {True, False}
    for kind in set(kinds):
        layer = kind_layer(config, kind)
        assert kinds[layer] == kind
        with torch.device("meta"):
            built = DecoderLayerPipe(config, None, layer)
        costs = DecoderCosts(config, Workload(seq_length=64), layer)
        assert costs.parameters == sum(p.numel() for p in built.parameters()), kind


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_saved_bytes_are_close_to_what_autograd_saves(family, dtype, precision):
    """A whole decoder layer of each kind on 2 packed rows of 128 tokens: the plan within 6% of autograd's saved
    storages (the linear attention's own part measured exactly; the decoder's formula around it, and gated
    attention's, approximate)."""
    config = HYBRID_CONFIGS[family]()
    batch, seq = 2, 128
    for kind in set(decoder_kinds(config)):
        layer = kind_layer(config, kind)
        costs = DecoderCosts(config, Workload(seq_length=seq, micro_batch_size=batch, precision=precision), layer)
        inputs = StageAttentionInputs(config, "packed")
        decoder = DecoderLayerPipe(config, inputs, layer).to(dtype)
        hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
        ids, positions = torch.ones(batch, seq, dtype=torch.long), torch.arange(seq).expand(batch, seq)
        excluded = {t.untyped_storage().data_ptr() for t in (*inputs(hidden, ids, positions)[:2], hidden,
                                                             *decoder.parameters(), *decoder.buffers())}
        measured = saved_activation_bytes(lambda: decoder(StageTuple(config).start(hidden, ids, positions)), excluded)
        assert abs(costs.saved_bytes / measured - 1) < 0.06, (kind, costs.saved_bytes, measured)


def test_linear_attention_is_priced_apart_from_attention():
    """Qwen3.5-27B's sizes: a linear-attention layer's FLOPs do not grow with the sequence as attention's do, and
    the model's training FLOPs count only the full-attention layers' scores."""
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec
    config = plan_spec(run_config("qwen3_5_27b")).model_config
    kinds = decoder_kinds(config)
    linear, full = kinds.index(LINEAR_PREFIX + "decoder"), kinds.index("decoder")
    flops = {seq: {layer: DecoderCosts(config, Workload(seq_length=seq), layer).forward_flops / seq
                   for layer in (linear, full)} for seq in (4096, 32768)}
    assert flops[32768][linear] == pytest.approx(flops[4096][linear], rel=1e-9)  # per token: constant
    width = config.num_attention_heads * config.head_dim  # QK^T and PV over the causal half of the keys
    assert flops[32768][full] - flops[4096][full] == pytest.approx(2 * (32768 - 4096) / 2 * 2 * width, rel=1e-9)
    per_token = {seq: training_flops_per_token(config, seq) for seq in (4096, 32768)}
    attention_growth = 3 * 2 * (32768 - 4096) * config.num_attention_heads * 2 * config.head_dim * 16  # 16 layers
    assert per_token[32768] - per_token[4096] == pytest.approx(attention_growth, rel=1e-9)


@pytest.mark.parametrize("name", ["qwen3_5_27b", "qwen3_5_397b_a17b"])
def test_shipped_configs_plan_every_parameter_and_fit_their_hardware(capsys, name):
    """plan_only on the hardware each names (2 nodes x 8 x 80 GB; 12 nodes x 8 H200, the experts split over 8):
    every device within its memory with 10% to spare; with every expert whole on its stage, transformers' parameter
    count of the published text config."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoModelForCausalLM

    from planner.memory_plan import print_memory_plan
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec
    cfg = run_config(name)
    rows = print_memory_plan(plan_spec(cfg))
    assert all(row["fits"] for row in rows)
    assert "does NOT fit" not in capsys.readouterr().out
    assert max(row["memory_bytes"] for row in rows) < 0.9 * cfg.device_memory_gb * 2 ** 30
    whole = print_memory_plan(plan_spec(run_config(name, "expert_parallel_size=1")))
    fields = OmegaConf.to_container(cfg.model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert sum(row["parameters"] for row in whole) == sum(p.numel() for p in model.parameters())
