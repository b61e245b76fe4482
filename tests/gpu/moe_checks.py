"""What the GPU check's mixture-of-experts and latent-attention checks run (tests/gpu/test_moe_gpu.py,
tests/gpu/test_two_gpus.py), apart from the checks so that the CPU suite runs the same steps in fp32, where they
must be exact (tests/test_gpu_check.py): a tiny model of a family converted as a user converts one, the trainer's
evaluation of it (eval_only, launched as a user launches it) against transformers' loss over the same rows, which
path a sparse layer's experts take, and how many times a sparse layer's forward and backward wait for the device."""
import json
import warnings

import torch
from transformers import AutoModelForCausalLM

from checkpoints.hf_to_ds import convert_hf_to_ds
from tests.launch import check_ok, demo_overrides, launch_trainer, read_metrics
from tests.tiny_models import DEEPSEEK_CONFIGS, MOE_CONFIGS, make_model

# softmax routing (Qwen3-MoE); GPT-OSS's transposed, biased, clamped experts and attention sinks; DeepSeek-V3's
# latent attention (MLA) with its sigmoid router and shared expert
FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
EVAL_ROWS, EVAL_SEQ = 8, 32


def family_config(family):
    return {**MOE_CONFIGS, **DEEPSEEK_CONFIGS}[family]()


def converted(family, root, dtype):
    """A tiny model of `family` saved by transformers in `dtype` and converted: {hf, ds}."""
    make_model(family_config(family), str(root / "hf"), dtype=dtype)
    convert_hf_to_ds(str(root / "hf"), str(root / "ds"))
    return {"hf": str(root / "hf"), "ds": str(root / "ds")}


def write_eval_rows(path, vocab_size):
    """EVAL_ROWS rows of EVAL_SEQ token ids each (no padding, every next token labelled): [[ids], ...]."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(3, vocab_size, (EVAL_ROWS, EVAL_SEQ), generator=generator).tolist()
    with open(path, "w") as f:
        f.writelines(json.dumps({"input_ids": row}) + "\n" for row in rows)
    return rows


def trainer_eval_loss(demo_model, model, tmp_path, precision, accelerator):
    """The trainer's eval_loss of `model` ({hf, ds}) on write_eval_rows' rows, one process, the load-balancing loss
    off (its coefficient's term is per micro-batch: transformers' batch of all rows would weigh it otherwise)."""
    eval_file = tmp_path / "eval.jsonl"
    out = tmp_path / "run"
    check_ok(launch_trainer(1, demo_overrides(demo_model, out, **{
        "model_name_or_path": model["ds"], "tokenizer_name_or_path": demo_model["ds"], "train_file": eval_file,
        "eval_file": eval_file, "data.format": "pretokenized", "data.cache_dir": tmp_path / "cache",
        "seq_length": EVAL_SEQ, "micro_batch_size": 2, "num_stages": 1, "eval_only": "true",
        "precision": precision, "zero_stage": 0 if precision == "fp32" else 1, "output_router_logits": "false"}),
        accelerator=accelerator))
    (record,) = [r for r in read_metrics(out) if "eval_loss" in r]
    return record["eval_loss"]


def transformers_eval_loss(hf_dir, rows, device, dtype):
    """transformers' loss over every row's next tokens, the load-balancing loss off."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    model.config.output_router_logits = False
    ids = torch.tensor(rows, device=device)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids, output_router_logits=False).loss.item()


def sparse_layer(family, device, dtype, num_experts=None):
    """A sparse decoder layer of `family` (num_experts of them, when given) on `device`, built in `dtype` as the
    trainer builds a stage, and its input tuple: (layer, inputs)."""
    from models.architecture import architecture_of
    from models.attention import StageAttentionInputs
    from models.pipeline_layers import DecoderLayerPipe, StageTuple
    config = family_config(family)
    if num_experts:
        field = next(name for name in ("num_experts", "num_local_experts", "n_routed_experts") if hasattr(config, name))
        setattr(config, field, num_experts)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = DecoderLayerPipe(config, StageAttentionInputs(config, row_layout="full"),
                                 layer_index=architecture_of(config).sparse_layers.index(True)).to(device)
    finally:
        torch.set_default_dtype(previous)
    batch, seq = 4, 64
    hidden = torch.randn(batch, seq, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    document_ids = torch.ones(batch, seq, dtype=torch.long, device=device)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    return layer, StageTuple(config).start(hidden, document_ids, positions)


def expert_path(family, device, dtype):
    """How a sparse layer's experts run here: 'grouped_mm' (torch's grouped GEMM) or 'one GEMM per expert'."""
    from models.moe import grouped_mm_fits
    layer, (hidden, *_) = sparse_layer(family, device, dtype)
    experts = layer.mlp.experts
    tokens = hidden.detach().reshape(-1, hidden.shape[-1])
    inner = experts.down_proj.shape[-2 if experts.transposed else -1]
    return "grouped_mm" if grouped_mm_fits((tokens, experts.gate_up_proj, experts.down_proj), inner) else \
        "one GEMM per expert"


def cuda_syncs_of_a_sparse_layer(family, dtype, num_experts):
    """The times one forward and backward of a sparse layer (num_experts experts) makes the host wait for the GPU:
    CUDA's own count (torch.cuda.set_sync_debug_mode("warn"): one warning per synchronizing call)."""
    layer, inputs = sparse_layer(family, "cuda", dtype, num_experts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = layer(inputs)[0]
            out.float().pow(2).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
