"""The planner for the DeepSeek-V3 line and the mixtures with dense layers among sparse ones: multi-head latent
attention's parameters, FLOPs and what it keeps for backward (with the CUDA kernels' attention: a stand-in for
SDPA keeping what they keep), a dense layer's own costs beside a sparse one's, the balanced partition over layers of
two kinds, and the shipped configs moonlight_16b_a3b and deepseek_v3_671b planned on the hardware they name."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from models.architecture import architecture_of
from models.partition import (DECODER, DENSE_DECODER, balanced_decoder_counts, decoder_kinds, layer_parameter_counts,
                              stage_kinds, training_flops_per_token)
from models.sigmoid_router import FP32_MARKER
from planner.stage_costs import LayerCosts, StageCostModel
from planner.workload import Workload
from tests.test_partition import queued_tensor_bytes, saved_activation_bytes
from tests.tiny_models import DEEPSEEK_CONFIGS, MOE_CONFIGS

MIXED = {**DEEPSEEK_CONFIGS, "qwen3_moe": MOE_CONFIGS["qwen3_moe"]}  # dense layers among sparse ones


class KernelAttention(torch.autograd.Function):
    """SDPA as the CUDA kernels the planner plans for run it (memory-efficient, cuDNN or flash attention): the
    output in their (batch, tokens, heads, features) layout, and kept for backward q, k, v, the output and an fp32
    log-sum-exp per head and query. The CPU's math path, which a value width other than the query's takes there,
    keeps the scores instead. Backward computes it again through SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, enable_gqa):
        out = SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[:-1], dtype=torch.float32))
        ctx.options = mask, is_causal, scale, enable_gqa
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        mask, is_causal, scale, enable_gqa = ctx.options
        with torch.enable_grad():
            out = SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return (*torch.autograd.grad(out, (q, k, v), grad), None, None, None, None)


SDPA = F.scaled_dot_product_attention


def kernel_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    return KernelAttention.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def layer_of_kind(config, kind):
    return decoder_kinds(config).index(kind)


def in_training_dtype(module, dtype):
    """module in dtype as the trainer's engine holds it: the parameters transformers keeps in fp32 (DeepSeek-V3's
    router) in fp32."""
    module.to(dtype)
    for param in module.parameters():
        if getattr(param, FP32_MARKER, False):
            param.data = param.data.float()
    return module


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("kind", [DENSE_DECODER, DECODER], ids=["dense", "sparse"])
@pytest.mark.parametrize("family", list(MIXED))
def test_decoder_costs_are_what_autograd_keeps(monkeypatch, dtype, precision, kind, family):
    """Each kind of decoder layer of a model mixing them (MLA with and without the query latent, GLM-4.5's and
    Qwen3-MoE's grouped-query attention; DeepSeek-V3's router): the planner's saved bytes are what autograd keeps
    with the CUDA kernels' attention, its parameters transformers' layer's, and a micro-batch waiting for W keeps
    what the zero-bubble queue holds."""
    from models.attention import StageAttentionInputs
    from models.pipeline_layers import DecoderLayerPipe, StagePlan, StageTuple
    from models.tensor_parallel import TensorParallel
    from models.weight_grads import WeightGradQueue
    monkeypatch.setattr(F, "scaled_dot_product_attention", kernel_attention)
    batch, seq = 2, 24
    config = MIXED[family]()
    layer = layer_of_kind(config, kind)
    costs = LayerCosts(config, Workload(seq_length=seq, micro_batch_size=batch, precision=precision))
    stage_inputs = StageAttentionInputs(config, row_layout="full")
    decoder = in_training_dtype(DecoderLayerPipe(config, stage_inputs, layer_index=layer), dtype)
    hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    mask, positions = torch.ones(batch, seq, dtype=torch.long), torch.arange(seq).expand(batch, seq)
    shared = {t.untyped_storage().data_ptr() for t in stage_inputs(hidden, mask, positions, None) if t is not None}
    params = {p.untyped_storage().data_ptr() for p in decoder.parameters()}
    inputs = StageTuple(config).start(hidden, mask, positions)
    assert saved_activation_bytes(lambda: decoder(inputs), shared | params) == costs.saved_bytes[kind]
    reference = AutoModelForCausalLM.from_config(config).model.layers[layer]
    assert layer_parameter_counts(config)[layer + 1] == sum(p.numel() for p in reference.parameters())
    assert costs.parameters[kind] == layer_parameter_counts(config)[layer + 1]
    if kind == DENSE_DECODER:  # a sparse layer's experts and router take their gradients in B (docs/moe.md)
        parallel = TensorParallel()
        parallel.weight_grads = WeightGradQueue()
        decoder = in_training_dtype(DecoderLayerPipe(config, StageAttentionInputs(config, row_layout="full"),
                                                     layer, StagePlan(parallel=parallel)), dtype)
        params = {p.untyped_storage().data_ptr() for p in decoder.parameters()}
        output = decoder(StageTuple(config).start(hidden, mask, positions))[0]
        with parallel.weight_grads.defer():
            output.backward(torch.randn_like(output))
        assert queued_tensor_bytes(parallel.weight_grads, params) == costs.weight_grad_bytes[kind]


@pytest.mark.parametrize("family", list(DEEPSEEK_CONFIGS))
def test_flops_per_token_count_latent_attention_and_the_active_experts(family):
    """torch's count of transformers' model (eager attention and experts: torch counts no grouped GEMM): the same
    within 2% (the planner counts the norms' weights as matmuls); its attention matmuls (QK^T over the query/key
    width, PV over the value width: MLA's qk_nope + qk_rope and v_head_dim) exactly the planner's."""
    from torch.utils.flop_counter import FlopCounterMode
    from models.partition import attention_head_widths
    config = DEEPSEEK_CONFIGS[family]()
    seq = 16
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    ids = torch.randint(0, config.vocab_size, (2, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert training_flops_per_token(config, seq) == pytest.approx(counter.get_total_flops() / ids.numel(), rel=0.02)
    attention = 3 * 2 * seq * config.num_attention_heads * sum(attention_head_widths(config)) * config.num_hidden_layers
    assert counter.get_flop_counts()["Global"][torch.ops.aten.bmm] / ids.numel() == attention
    assert attention_head_widths(config) == ((config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
                                             if architecture_of(config).latent_attention else (16, 16))


def test_balanced_partition_of_mixed_layers_is_the_best_contiguous_split():
    """Dense and sparse layers cost differently, so the balanced partition is the split with the smallest largest
    stage cost over every contiguous one (here all of them are tried)."""
    config = DEEPSEEK_CONFIGS["deepseek_v3"]()
    config.num_hidden_layers, config.first_k_dense_replace = 7, 3
    config.intermediate_size = 512  # dense layers costlier than sparse ones
    workload = Workload(seq_length=64, micro_batch_size=2, micro_batches=4, precision="bf16")
    model = StageCostModel(config, workload, 3)
    decoders = decoder_kinds(config)
    assert decoders == [DENSE_DECODER] * 3 + [DECODER] * 4
    counts = balanced_decoder_counts(7, 3, model.cost, decoders)

    def largest(split):
        starts = [sum(split[:s]) for s in range(3)]
        return max(model.cost(s, stage_kinds(s, 3, n, decoders[start:])) for s, (start, n) in
                   enumerate(zip(starts, split)))
    splits = [split for split in itertools.product(range(1, 6), repeat=3) if sum(split) == 7]
    assert largest(counts) == min(largest(split) for split in splits)
    assert largest(counts) < largest(balanced_decoder_counts(7, 3, model.cost))  # as if every layer were sparse
    assert counts[0] < counts[2]


@pytest.mark.parametrize("name", ["moonlight_16b_a3b", "deepseek_v3_671b"])
def test_shipped_configs_plan_every_parameter_and_fit_their_hardware(capsys, name):
    """plan_only on the hardware each names: every device and node within its memory; with every expert whole on
    its stage, transformers' parameter count of the published config (its dense and sparse layers apart)."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    from planner.memory_plan import print_memory_plan
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec
    cfg = run_config(name)
    rows = print_memory_plan(plan_spec(cfg))
    assert all(row["fits"] for row in rows)
    assert "does NOT fit" not in capsys.readouterr().out
    whole = print_memory_plan(plan_spec(run_config(name, "expert_parallel_size=1")))
    fields = OmegaConf.to_container(cfg.model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert sum(row["parameters"] for row in whole) == sum(p.numel() for p in model.parameters())


OFFLOADED = ["offload_optimizer=cpu", "expert_parallel_size=1", "num_stages=61", "plan_world_size=61"]
H200 = ["device_memory_gb=141", "host_memory_gb=2048"]


@pytest.mark.parametrize("overrides,fits", [
    ([], True),  # as shipped: 30 stages x 8 data-parallel, experts split over 8, 80 GB GPUs: 30 nodes
    # a checkpointed sparse layer keeping its exchanged rows: 0.9 GiB each a micro-batch in flight, over 80 GB
    (["moe.checkpoint_keeps_rows=true"], False),
    (["num_stages=29", "plan_world_size=232"], False),  # one stage fewer: a stage of 3 sparse layers
    ([*OFFLOADED, "grad_accum_dtype=bf16"], False),  # offloaded, experts whole: over 80 GB
    # on H200s: 61 GPUs, 8 nodes; a save's host copy of a sparse layer's whole optimizer state (its experts whole,
    # 129 GiB a rank) overfills a node of 2 TB, not one of 3
    ([*OFFLOADED, "grad_accum_dtype=bf16", *H200], False),
    ([*OFFLOADED, "grad_accum_dtype=bf16", *H200, "host_memory_gb=3072"], True),
    ([*OFFLOADED, *H200], False),  # with fp32 sums: over 141 GB
], ids=["shipped", "rows_kept", "29_stages", "offloaded_80gb", "offloaded_h200", "offloaded_h200_3tb_host",
        "offloaded_h200_fp32_sums"])
def test_deepseek_v3_node_counts_the_config_states(overrides, fits):
    from planner.memory_plan import host_memory_plan, memory_plan, plan_fits
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec
    spec = plan_spec(run_config("deepseek_v3_671b", *overrides))
    rows = memory_plan(spec)
    assert plan_fits(spec, rows, host_memory_plan(spec, rows)) == fits


def test_measured_costs_are_refused_for_a_model_of_two_decoder_kinds(demo_model, tiny_deepseek_checkpoints, tmp_path):
    from errors import ConfigError
    from tests.test_moe import run_spec_of
    with pytest.raises(ConfigError, match=r"^partition_costs=measured times one decoder layer, and deepseek_v3's are "
                                          r"of two kinds \(dense and sparse\); set partition_costs=flops\.$"):
        run_spec_of(demo_model, tiny_deepseek_checkpoints["deepseek_v3"][1], tmp_path, "partition=balanced",
                    "partition_costs=measured")
