"""The GPU check of the mixtures of experts and of multi-head latent attention on one GPU (bash scripts/gpu_check.sh):
each family's evaluation by the trainer in bf16 against transformers' bf16 loss over the same rows (tests/gpu/
moe_checks.py; the CPU suite runs the same in fp32, where it is exact: tests/test_gpu_check.py), the path a sparse
layer's experts take on this GPU and how many times its forward and backward wait for the device, whatever the
number of experts, the kernel SDPA picks for latent attention, and the tokens/s of a Qwen3-30B-A3B-shaped stage.
Expert parallelism over NCCL: tests/gpu/test_two_gpus.py."""
import json
import math
import statistics

import pytest
import torch

from tests.gpu import moe_checks
from tests.gpu.test_one_gpu import run_script, sdpa_nodes
from tests.launch import check_ok, launch_trainer, read_metrics
from tests.tiny_models import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# bf16 against bf16 with other kernels (the experts' grouped GEMM and sort, the router's order of sums, SDPA's
# backend) over 8 x 31 tokens: not yet measured on a GPU; allowed at bf16's resolution of a loss near ln 96.
BF16_EVAL_TOLERANCE = 2e-2


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", moe_checks.FAMILIES)
def test_moe_eval_in_bf16_equals_transformers(demo_model, tmp_path, record_property, family):
    model = moe_checks.converted(family, tmp_path / "model", torch.bfloat16)
    rows = moe_checks.write_eval_rows(tmp_path / "eval.jsonl", moe_checks.family_config(family).vocab_size)
    ours = moe_checks.trainer_eval_loss(demo_model, model, tmp_path, "bf16", "cuda")
    theirs = moe_checks.transformers_eval_loss(model["hf"], rows, "cuda", torch.bfloat16)
    difference = abs(ours - theirs)
    assert difference <= BF16_EVAL_TOLERANCE, (ours, theirs)
    path = moe_checks.expert_path(family, "cuda", torch.bfloat16)
    record_property("figure", f"eval loss {ours:.4f} vs transformers {theirs:.4f}: |difference| {difference:.1e} "
                              f"(allowed {BF16_EVAL_TOLERANCE:g}); experts through {path} on sm"
                              f"{''.join(map(str, torch.cuda.get_device_capability()))}")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_sparse_layers_host_syncs_do_not_grow_with_its_experts(record_property, family):
    """One forward and backward of a sparse layer in bf16 with 8 and with 64 experts: the same count of host syncs
    (a sync per expert would grow with them), and the experts' path on this GPU."""
    counts = {experts: moe_checks.cuda_syncs_of_a_sparse_layer(family, torch.bfloat16, experts) for experts in (8, 64)}
    assert len(set(counts.values())) == 1, counts
    path = moe_checks.expert_path(family, "cuda", torch.bfloat16)
    record_property("figure", f"{counts[8]} host syncs per forward and backward at 8 and at 64 experts; experts "
                              f"through {path}")


def test_latent_attention_runs_a_fused_sdpa_kernel(record_property):
    """DeepSeek-V3's MLA (its value heads narrower than its query and key heads) in bf16 on rows of one document:
    SDPA on memory-efficient or cuDNN attention, which sdpa_kernel makes an error rather than a silent fall-back
    to the math kernel (what the planner's MLA figures assume: planner/decoder_costs.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    layer, inputs = moe_checks.sparse_layer("deepseek_v3", "cuda", torch.bfloat16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = layer(inputs)[0]
        out.float().pow(2).mean().backward()
    kernels = sdpa_nodes(out.grad_fn)
    assert any(kind in name for name in kernels for kind in ("Efficient", "Cudnn")), kernels
    assert bool(torch.isfinite(inputs[0].grad).all())
    record_property("figure", f"{', '.join(sorted(kernels))}")


def qwen3_30b_a3b_stage_config():
    """Qwen3-30B-A3B's layer shape (128 experts, top 8 of width 768, 32 query and 4 key/value heads of 128) in 2
    layers over a 32,000-token vocabulary: 1.3B parameters, 0.2B of them active per token."""
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=4096, output_router_logits=True,
                          router_aux_loss_coef=0.001, tie_word_embeddings=False)


def test_throughput_of_a_qwen3_moe_stage(tmp_path, record_property):
    """qwen3_30b_a3b_stage_config with random weights, 8 steps on 1 GPU as the shipped config trains (bf16, ZeRO-1,
    the load-balancing loss on, checkpointing every layer): the trainer's tokens/s, TFLOP/s (the active experts'
    FLOPs) and MFU over the steps after the first two, and each layer's expert load."""
    config, seq, micro_batch, micro_batches, steps = qwen3_30b_a3b_stage_config(), 2048, 2, 8, 8
    parameters = sum(p.numel() for p in make_model(config, str(tmp_path / "hf"), dtype=torch.bfloat16).parameters())
    run_script("convert2ckpt.py", "--model_name_or_path", tmp_path / "hf", "--output_dir", tmp_path / "ds")
    rows = torch.randint(0, config.vocab_size, (steps * micro_batch * micro_batches, seq)).tolist()
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": row}) + "\n" for row in rows)
    out = tmp_path / "run"
    check_ok(launch_trainer(1, [f"{k}={v}" for k, v in dict(
        model_name_or_path=tmp_path / "ds", train_file=tmp_path / "train.jsonl", output_dir=out, seq_length=seq,
        micro_batch_size=micro_batch, gradient_accumulation_steps=micro_batches, max_steps=steps, logging_steps=1,
        activation_checkpoint_interval=1, **{"data.format": "pretokenized"}).items()], config="base",
        accelerator="cuda", timeout=600))
    records = [r for r in read_metrics(out) if "loss" in r]
    assert len(records) == steps and all(math.isfinite(r["loss"]) for r in records)
    timed = records[2:]
    tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in timed)
    tflops = statistics.median(r["tflops_per_device"] for r in timed)
    mfus = [r["mfu"] for r in timed if "mfu" in r]
    mfu = f"MFU {statistics.median(mfus):.1%}" if mfus else "no MFU (no bf16 peak listed for this GPU)"
    loads = [value for key, value in records[-1].items() if key.startswith("expert_load/")]
    assert len(loads) == config.num_hidden_layers
    record_property("figure", f"{parameters / 1e9:.2f}B parameters, seq {seq}, {micro_batch} x {micro_batches} "
                              f"micro-batches: {tokens_per_sec:,.0f} tokens/s, {tflops:.0f} TFLOP/s, {mfu}; expert "
                              f"load (busiest / mean) {max(loads):.2f}")
