"""The GPU check on one GPU (bash scripts/gpu_check.sh): conversion, the trainer and the exporter launched as a user
would, in bf16 on CUDA, and the attention and loss kernels of a 1B model's shape. One bf16 run serves the training,
resume, offload and export checks; each check records its key figure for the report (tests/gpu/conftest.py)."""
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from tests.conftest import ROOT
from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics
from tests.test_conversion import assert_bit_identical, load_hf_weights
from tests.tiny_models import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# 1 stage, 8 bf16 steps of 8 sequences (2 x 4 micro-batches) at a constant learning rate, so that a shorter run
# takes the same steps; checkpoints at steps 4 and 8.
BF16_RUN = dict(num_stages=1, precision="bf16", zero_stage=1, max_steps=8, save_steps=4, save_total_limit=2,
                logging_steps=1, learning_rate=1e-3, lr_scheduler="constant", warmup_steps=0, eval_file="null",
                export_hf="false")
# The same steps' losses under another reduction order, measured on one H200 in three runs (bench/README.md, "GPU
# check"): resume 6.5e-5, 1.0e-4, 3.2e-5; offload 9.1e-5, 1.0e-4, 8.2e-5 (on CPU 9.3e-5 at most, docs/checkpoints.md).
# Allowed: 5x the largest, for other GPUs' kernel choices (cuBLAS picks by shape and GPU).
BF16_LOSS_TOLERANCE = 5e-4
# Launched as the trainer, with a record of the optimizer the engine stepped (tests/gpu/optimizer_probe.py).
OPTIMIZER_PROBE = os.path.join("tests", "gpu", "optimizer_probe.py")


def run_script(*args):
    """A project script as a user runs it, from the repository root."""
    return check_ok(subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                                   timeout=300))


def loss_difference(losses, reference):
    assert len(losses) == len(reference), (losses, reference)
    return max(abs(a - b) for a, b in zip(losses, reference))


def one_billion_config():
    """TinyLlama-1.1B's published shape: LLaMA-2's layout, grouped-query attention (32 heads, 4 key/value heads)."""
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """The in-process checks leave torch's allocator cache on the GPU that the launched trainers need."""
    yield
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def bf16_model(demo_model, tmp_path_factory):
    """The demo model's config with random weights saved in bf16, converted by convert2ckpt.py with the demo's
    tokenizer: demo_model's paths with this hf and ds."""
    root = tmp_path_factory.mktemp("bf16_model")
    make_model(AutoConfig.from_pretrained(demo_model["hf"]), str(root / "hf"), dtype=torch.bfloat16)
    run_script("convert2ckpt.py", "--model_name_or_path", root / "hf", "--output_dir", root / "ds",
               "--tokenizer_name_or_path", demo_model["hf"])
    return dict(demo_model, hf=str(root / "hf"), ds=str(root / "ds"))


@pytest.fixture(scope="module")
def bf16_run(bf16_model, tmp_path_factory):
    """BF16_RUN on 1 GPU, evaluated and exported to Hugging Face at the end: the run the resume, offload and export
    checks go on from."""
    out = tmp_path_factory.mktemp("bf16_run") / "run"
    check_ok(launch_trainer(1, demo_overrides(bf16_model, out, **dict(BF16_RUN, eval_file=bf16_model["eval"],
                                                                      export_hf="true")),
                            script=OPTIMIZER_PROBE, accelerator="cuda"))
    return out


def stepped_optimizer(run, steps):
    """What the run's engine stepped (tests/gpu/optimizer_probe.py), checked to have stepped its master weights
    `steps` times: a step at the constant learning rate moves the largest master weight by about that rate."""
    optimizer = json.loads((run / "optimizer.json").read_text())
    assert optimizer["steps"] == [steps], optimizer
    assert optimizer["master_moved"] > BF16_RUN["learning_rate"] / 2, optimizer
    return optimizer


def test_bf16_conversion(bf16_model, tmp_path, record_property):
    layer_files = glob.glob(os.path.join(bf16_model["ds"], "global_step0", "layer_*-model_states.pt"))
    assert {t.dtype for path in layer_files for t in torch.load(path, weights_only=True).values()} == {torch.bfloat16}
    run_script("convert2ckpt.py", "--to_hf", "--ckpt_dir", bf16_model["ds"], "--output_dir", tmp_path / "hf")
    weights = load_hf_weights(bf16_model["hf"])
    assert_bit_identical(weights, load_hf_weights(str(tmp_path / "hf")))
    record_property("figure", f"{len(weights)} bf16 tensors in {len(layer_files)} layer files; HF -> DS -> HF "
                              f"bit-identical")


def test_bf16_training_with_fused_adamw(bf16_run, record_property):
    """The default optimizer, as the engine built it: torch's fused AdamW, its master weights on the GPU."""
    optimizer = stepped_optimizer(bf16_run, steps=8)
    assert (optimizer["optimizer"], optimizer["fused"], optimizer["master_devices"]) == ("AdamW", True, ["cuda:0"]), \
        optimizer
    losses = per_step_losses(bf16_run)
    assert len(losses) == 8 and all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    (eval_loss,) = [r["eval_loss"] for r in read_metrics(bf16_run) if "eval_loss" in r]
    assert math.isfinite(eval_loss)
    record_property("figure", f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in 8 steps, eval loss {eval_loss:.3f}; "
                              f"fused AdamW stepped 8 times")


def sdpa_nodes(grad_fn):
    """Names of the scaled-dot-product attention nodes in an autograd graph (the kernel SDPA chose)."""
    names, seen, pending = set(), set(), [grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "ScaledDotProduct" in node.name():
            names.add(node.name())
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_attention_runs_a_fused_sdpa_kernel(record_property):
    """A decoder layer of the 1B shape on rows that are each one unpadded document (packed text, pre-tokenized rows
    of seq_length): no mask tensor, and SDPA on flash or memory-efficient attention, which sdpa_kernel makes an
    error rather than a silent fall-back to the math kernel (a seq x seq score matrix per head)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.attention import StageAttentionInputs
    from models.pipeline_layers import DecoderLayerPipe
    config = one_billion_config()
    stage_inputs = StageAttentionInputs(config, row_layout="full")  # the run's rows: one document each
    layer = DecoderLayerPipe(config, stage_inputs).to("cuda", torch.bfloat16)
    batch, seq = 2, config.max_position_embeddings
    hidden = torch.randn(batch, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    document_ids = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    position_ids = torch.arange(seq, device="cuda").expand(batch, seq)
    assert stage_inputs(hidden, document_ids, position_ids)[2] is None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = layer((hidden, document_ids, position_ids))[0]
        out.float().pow(2).mean().backward()
    kernels = sdpa_nodes(out.grad_fn)
    assert any(kind in name for name in kernels for kind in ("Flash", "Efficient")), kernels
    assert bool(torch.isfinite(hidden.grad).all())
    record_property("figure", f"{', '.join(sorted(kernels))}; mask None; {batch} x {seq} tokens, GQA "
                              f"{config.num_attention_heads}/{config.num_key_value_heads}")


def test_chunked_loss_equals_the_logits_head(record_property):
    """The 1B shape's head and loss on 2 x 2048 tokens in bf16, in conf/base.yaml's chunks of 1024 tokens against the
    full logits: the loss, and the gradients of the head's input and weight (‖chunked - logits‖ / ‖logits‖; bf16
    keeps 2^-8 of each element and the chunks' weight gradient is summed in bf16: 4.7e-3 measured on CPU)."""
    from models.pipeline_layers import LMHeadPipe
    from models.loss import CausalLMLoss
    config = one_billion_config()
    torch.manual_seed(0)
    head = LMHeadPipe(config).to("cuda", torch.bfloat16)
    hidden = torch.randn(2, 2048, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, config.vocab_size, (2, 2048), device="cuda")
    labels[:, :100] = -100  # prompt tokens, not learned
    results = {}
    for chunk_tokens in (0, 1024):
        head.chunked_loss, head.weight.grad = chunk_tokens > 0, None
        inputs = hidden.clone().requires_grad_()
        loss = CausalLMLoss(chunk_tokens=chunk_tokens)(head(inputs), labels)
        loss.backward()
        results[chunk_tokens] = loss.item(), inputs.grad.float(), head.weight.grad.float()
    (logits_loss, *reference), (chunked_loss, *chunked) = results[0], results[1024]
    errors = [((c - r).norm() / r.norm()).item() for c, r in zip(chunked, reference)]
    assert abs(chunked_loss - logits_loss) <= 1e-3 and max(errors) <= 2e-2, (chunked_loss, logits_loss, errors)
    record_property("figure", f"loss {chunked_loss:.5f} vs {logits_loss:.5f}; gradient error input {errors[0]:.1e}, "
                              f"weight {errors[1]:.1e}")


def calibration_memory_bound(config, seq_length):
    """What partition_costs=measured's calibration holds at most by the plan (planner/stage_costs.py), in bf16: the
    three units' weights and gradients, the chunked head's fp32 weight-gradient sum, and a decoder layer's
    activations, backward workspace and the tensors waiting for its W, or the head's chunk of logits."""
    from planner.stage_costs import LayerCosts
    from planner.workload import Workload
    layers = LayerCosts(config, Workload(seq_length=seq_length, micro_batch_size=1, precision="bf16"))
    weights = sum(layers.parameters[kind] for kind in ("embedding", "decoder", "head"))
    decoder_workspace = layers.backward_bytes["decoder"] + layers.weight_grad_bytes["decoder"]
    workspace = max(decoder_workspace, layers.backward_bytes["head"])
    return 4 * weights + 4 * layers.parameters["head"] + layers.saved_bytes["decoder"] + workspace


def test_partition_cost_calibration_in_its_memory(record_property):
    """partition_costs=measured's start-up calibration (engines/cost_calibration.py) on the 1B shape in bf16 at seq
    2048: CUDA events time every decoder pass (each > 0, B + W within 1.5x a whole backward), and its peak memory
    stays within 1.5x of what its units take by the plan (a regression that kept more alive, or ran it in fp32,
    would not)."""
    from omegaconf import OmegaConf

    from training.config_checks import checked_config
    from engines.cost_calibration import timed_unit_costs
    config = one_billion_config()
    cfg = checked_config(OmegaConf.create(dict(precision="bf16", zero_stage=1, seq_length=2048, micro_batch_size=1,
                                               pipeline_schedule="zbv", num_stages=2)))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before, started = torch.cuda.memory_allocated(), time.perf_counter()
    units = timed_unit_costs(cfg, config)
    seconds, peak = time.perf_counter() - started, torch.cuda.max_memory_allocated() - before
    bound = calibration_memory_bound(config, cfg.seq_length)
    decoder = units.seconds["decoder"]
    assert min(decoder.values()) > 0 and decoder["B"] + decoder["W"] <= 1.5 * decoder["BW"], units.describe()
    assert peak <= 1.5 * bound, (peak, bound)
    record_property("figure", f"{units.describe()}; peak {peak / 2**30:.2f} GiB (plan {bound / 2**30:.2f}); "
                              f"{seconds:.1f} s")


def test_host_syncs_per_step_do_not_grow_with_micro_batches_or_chunks(record_property):
    """bench/host_syncs.py on the GPU: the times one training step makes the host wait for the device (CUDA's own
    count, torch.cuda.set_sync_debug_mode) are the same for 1 and 4 micro-batches and 1 and 8 loss chunks each."""
    result = check_ok(subprocess.run([sys.executable, "bench/host_syncs.py", "--steps", "2"], cwd=ROOT,
                                     env=dict(os.environ, DS_ACCELERATOR="cuda"), capture_output=True, text=True,
                                     timeout=600))
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert len({count for steps in counts.values() for count in steps}) == 1, counts
    record_property("figure", f"{next(iter(counts.values()))[0]} host syncs per step in every case")


def test_bf16_resume_on_another_micro_batch_layout(bf16_model, bf16_run, tmp_path, record_property):
    """bf16_run's step-4 checkpoint goes on in micro-batches of 4 sequences, 2 a step (it ran 2 x 4): the steps of
    the run that never stopped (tests/test_resume.py does this exactly in fp32 on CPU)."""
    out = tmp_path / "run"
    check_ok(launch_trainer(1, demo_overrides(bf16_model, out, **dict(
        BF16_RUN, micro_batch_size=4, gradient_accumulation_steps=2, resume=bf16_run / "global_step4")),
        accelerator="cuda"))
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [5, 6, 7, 8]
    difference = loss_difference(per_step_losses(out), per_step_losses(bf16_run)[4:])
    assert difference <= BF16_LOSS_TOLERANCE, difference
    record_property("figure", f"steps 5-8 on 4 x 2 micro-batches: max |loss difference| {difference:.1e} "
                              f"(allowed {BF16_LOSS_TOLERANCE:g})")


def test_optimizer_offload_to_cpu_adam(bf16_model, bf16_run, tmp_path, record_property):
    """offload_optimizer=cpu (ZeRO-1's fp32 master weights and Adam moments in host memory, stepped by DeepSpeed's CPU
    Adam, built on first use): the engine stepped CPU Adam on host master weights 4 times, and the losses are
    bf16_run's first 4 steps, which fused AdamW ran on the GPU."""
    out = tmp_path / "run"
    check_ok(launch_trainer(1, demo_overrides(bf16_model, out, **dict(BF16_RUN, max_steps=4, offload_optimizer="cpu")),
                            script=OPTIMIZER_PROBE, accelerator="cuda", timeout=600))
    optimizer = stepped_optimizer(out, steps=4)
    assert (optimizer["optimizer"], optimizer["master_devices"]) == ("DeepSpeedCPUAdam", ["cpu"]), optimizer
    difference = loss_difference(per_step_losses(out), per_step_losses(bf16_run)[:4])
    assert difference <= BF16_LOSS_TOLERANCE, difference
    record_property("figure", f"DeepSpeedCPUAdam stepped 4 times on host masters (largest move "
                              f"{optimizer['master_moved']:.1e}); max |loss difference| from the GPU's AdamW "
                              f"{difference:.1e} (allowed {BF16_LOSS_TOLERANCE:g})")


def test_lora_trains_and_exports_a_peft_adapter(bf16_model, tmp_path, record_property):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    check_ok(launch_trainer(1, demo_overrides(bf16_model, out, **dict(
        BF16_RUN, max_steps=6, learning_rate=1e-2, export_hf="true", **{"lora.rank": 4})), accelerator="cuda"))
    losses = per_step_losses(out)
    assert len(losses) == 6 and all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    assert json.loads((out / "hf" / "adapter_config.json").read_text())["r"] == 4
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16_model["hf"]), out / "hf")
    trained_b = [p for n, p in adapter.named_parameters() if "lora_B" in n]
    assert trained_b and any(bool(p.any()) for p in trained_b)  # peft starts B at zero
    record_property("figure", f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in 6 steps; peft loads the adapter "
                              f"(r=4, {2 * len(trained_b)} tensors)")


def test_export_generates_with_transformers(bf16_run, record_property):
    result = run_script("scripts/generate.py", "--model_dir", bf16_run / "hf", "--prompt", "The big sailor",
                        "--max_new_tokens", "8")
    generated = [line for line in result.stdout.splitlines() if line.startswith("generated: ")]
    assert generated, result.stdout
    record_property("figure", generated[0])


def test_throughput_of_a_1b_model(tmp_path, record_property):
    """The 1B shape with random weights, trained 8 steps on 1 GPU as the GPU configs do (bf16, ZeRO-1, fused AdamW,
    chunked loss) but without activation checkpointing: the trainer's logged tokens/s, TFLOP/s and MFU (the GPU's
    bf16 peak, training/metrics.py) over the steps after the first two, which allocate and tune kernels."""
    config, seq, micro_batch, micro_batches, steps = one_billion_config(), 2048, 4, 8, 8
    parameters = sum(p.numel() for p in make_model(config, str(tmp_path / "hf"), dtype=torch.bfloat16).parameters())
    run_script("convert2ckpt.py", "--model_name_or_path", tmp_path / "hf", "--output_dir", tmp_path / "ds")
    rows = torch.randint(0, config.vocab_size, (steps * micro_batch * micro_batches, seq)).tolist()
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": row}) + "\n" for row in rows)
    out = tmp_path / "run"
    check_ok(launch_trainer(1, [f"{k}={v}" for k, v in dict(
        model_name_or_path=tmp_path / "ds", train_file=tmp_path / "train.jsonl", output_dir=out, seq_length=seq,
        micro_batch_size=micro_batch, gradient_accumulation_steps=micro_batches, max_steps=steps, logging_steps=1,
        **{"data.format": "pretokenized"}).items()], config="base", accelerator="cuda", timeout=600))
    records = [r for r in read_metrics(out) if "loss" in r]
    assert len(records) == steps and all(math.isfinite(r["loss"]) for r in records)
    timed = records[2:]
    tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in timed)
    tflops = statistics.median(r["tflops_per_device"] for r in timed)
    mfus = [r["mfu"] for r in timed if "mfu" in r]
    mfu = f"MFU {statistics.median(mfus):.1%}" if mfus else "no MFU (no bf16 peak listed for this GPU)"
    record_property("figure", f"{parameters / 1e9:.2f}B parameters, seq {seq}, {micro_batch} x {micro_batches} "
                              f"micro-batches: {tokens_per_sec:,.0f} tokens/s, {tflops:.0f} TFLOP/s, {mfu}")
