"""LoRA: adapters' gradients against peft on transformers under stages, tensor parallelism, zero-bubble and
checkpointing; training steps against a plain peft + torch AdamW loop; checkpoints without the base; export to a
peft adapter and a merged model; the memory plan; bad input."""
import glob
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from models.lora import PROJECTIONS, LoraSettings, adapter_parameter_count
from tests import parity_worker
from tests.distributed import spawn
from tests.launch import (check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics, run_in_process,
                          run_python, tensors_of)
from tests.lora_reference import hf_eval_loss
from tests.test_parity import GAS, MICRO_BATCH, SEQ

LORA = {"rank": 4, "alpha": 8.0}


def run_lora_parity(checkpoints, tmp_path, cases, num_stages, world_size, tensor_parallel=1):
    cases = [dict(case, hf_dir=checkpoints[case["model"]][0], ds_dir=checkpoints[case["model"]][1]) for case in cases]
    spawn(parity_worker.run, world_size, cases, num_stages, MICRO_BATCH, GAS, SEQ, str(tmp_path), tensor_parallel)
    return [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank*.json")))]


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # DeepSeek-V3's attention
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # peft's target_parameters
GRADIENT_CASES = {  # (stages, world size, tensor parallel): cases
    # Mixtures of experts, each family: the defaults (Qwen3-MoE, OLMoE, GLM-4.5: peft reads the MLP names as the
    # experts', gate_up_proj at twice the rank), the experts as peft's target_parameters (Mixtral, GPT-OSS beside
    # its sinks), DeepSeek-V3's latent attention with its experts under zero-bubble, Qwen2-MoE's dense layers,
    # shared expert and experts; with checkpointing.
    (2, 2, 1): [dict(name="qwen3_moe", model="qwen3_moe", lora=LORA), dict(name="olmoe", model="olmoe", lora=LORA),
                dict(name="glm4_moe+checkpointing", model="glm4_moe", lora=LORA, checkpoint_interval=1),
                dict(name="mixtral", model="mixtral", lora=dict(LORA, target_modules=("q_proj", "v_proj") + EXPERTS)),
                dict(name="gpt_oss", model="gpt_oss", lora=dict(LORA, target_modules=ATTENTION + EXPERTS)),
                dict(name="deepseek_v3+zero_bubble", model="deepseek_v3", schedule="zero_bubble",
                     lora=dict(LORA, target_modules=LATENT + ("gate_proj", "up_proj", "down_proj"))),
                dict(name="qwen2_moe", model="qwen2_moe", lora=dict(LORA, target_modules=PROJECTIONS + EXPERTS)),
                dict(name="llama3", model="llama3", lora=LORA),
                dict(name="tied+checkpointing", model="tied", lora=LORA, checkpoint_interval=1),
                dict(name="qwen2+zero_bubble", model="qwen2", lora=LORA, schedule="zero_bubble"),
                dict(name="attention_only", model="llama2", lora=dict(LORA, target_modules=("q_proj", "v_proj"))),
                dict(name="qwen3", model="qwen3", lora=LORA), dict(name="granite", model="granite", lora=LORA),
                dict(name="phi3", model="phi3", lora=LORA)],  # one adapter on each fused projection, as peft
    # MLA split by heads: the latent projections' adapters whole on every rank, q_b_proj's and kv_b_proj's A whole
    # (its gradient summed over the group), B split; the experts' whole, each rank routing its tokens.
    (2, 4, 2): [dict(name="deepseek_v3+sp", model="deepseek_v3", lora=dict(LORA, target_modules=LATENT + EXPERTS),
                     sequence_parallel=True),
                dict(name="deepseek_v3_q_proj", model="deepseek_v3_q_proj", sequence_parallel=False,
                     lora=dict(LORA, target_modules=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                                     "experts.gate_up_proj"))),
                dict(name="qwen3_moe+sp", model="qwen3_moe", lora=LORA, sequence_parallel=True),
                dict(name="llama3+sp", model="llama3", lora=LORA, sequence_parallel=True),
                dict(name="olmo2+sp", model="olmo2", lora=LORA, sequence_parallel=True),
                dict(name="phi3+sp", model="phi3", lora=LORA, sequence_parallel=True),
                dict(name="qwen2", model="qwen2", lora=LORA, sequence_parallel=False),
                dict(name="tied+sp+zero_bubble", model="tied", lora=LORA, schedule="zero_bubble")],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(GRADIENT_CASES), ids=["2stages", "2stages_x_tp2"])
def test_adapter_gradients_match_peft(tiny_checkpoints, tiny_moe_checkpoints, tiny_deepseek_checkpoints, tmp_path,
                                      layout):
    """One step's loss and every adapter's gradient equal peft's on transformers (B nonzero, so A's gradients are
    too); the base takes no gradient and does not change."""
    num_stages, world_size, tensor_parallel = layout
    checkpoints = {**tiny_checkpoints, **tiny_moe_checkpoints, **tiny_deepseek_checkpoints}
    ranks = run_lora_parity(checkpoints, tmp_path, GRADIENT_CASES[layout], num_stages, world_size, tensor_parallel)
    for case in GRADIENT_CASES[layout]:
        name = case["name"]
        for rank in ranks:
            result = rank[name]
            ref = result["ref_losses"]
            assert result["mean_loss"] == pytest.approx(sum(ref) / len(ref), abs=1e-5), name
            bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
            assert not bad, f"{name}: adapter gradients differ from peft's: {bad}"
            assert result["frozen_unchanged_without_grad"], name
            assert result["replicated_grad_spread"] == 0.0, name
            assert all(".lora_" in n for n in result["grad_errors"]), name
        # Every adapter of the peft model was compared on some rank.
        assert set().union(*(r[name]["grad_errors"] for r in ranks)) == set(ranks[0][name]["ref_param_names"])
        if case.get("schedule") == "zero_bubble":  # the adapters' weight gradients were deferred to W
            deferred = set().union(*(r[name]["deferred_weights"] for r in ranks))
            assert deferred and all(".lora_" in n for n in deferred), name


# 6 fp32 steps of 8 sequences at a constant learning rate, clipped at 1.0; LoRA rank 4 on every projection.
TRAINING = dict(num_stages=1, gradient_accumulation_steps=4, max_steps=6, logging_steps=1, learning_rate=1e-3,
                lr_scheduler="constant", warmup_steps=0, zero_stage=0, **{"lora.rank": 4, "lora.alpha": 8})


@pytest.fixture(scope="module")
def peft_run(demo_model):
    """The plain peft + transformers + torch AdamW loop the trainer's LoRA runs must equal: per-step losses and
    the trained peft model."""
    from tests.lora_reference import peft_training_losses
    return peft_training_losses(demo_model["hf"], demo_model["train"], demo_model["ds"], LoraSettings(4, 8.0),
                                steps=6, seed=42, seq_length=64, micro_batch_size=2, micro_batches=4,
                                learning_rate=1e-3, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0,
                                cache_dir=str(demo_model["root"] / "peft_cache"))


@pytest.fixture(scope="module")
def lora_run(demo_model, tmp_path_factory):
    """1 process: 6 LoRA steps, checkpoints at 3 and 6, evaluated at the end and exported as a peft adapter."""
    out = tmp_path_factory.mktemp("lora") / "run"
    check_ok(launch_trainer(1, demo_overrides(demo_model, out, **TRAINING, save_steps=3, save_total_limit=2,
                                              export_hf="true")))
    return out


@pytest.mark.slow
def test_lora_training_equals_peft_and_its_export_loads_in_peft(demo_model, peft_run, lora_run, tmp_path):
    ref_losses, ref_model = peft_run
    assert per_step_losses(lora_run) == pytest.approx(ref_losses, abs=1e-4)
    assert [r["lr"] for r in read_metrics(lora_run) if "loss" in r] == [1e-3] * 6
    # The exported adapter, loaded by peft onto the original Hugging Face model, has the pipeline's eval loss.
    from peft import PeftModel
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model["hf"]), lora_run / "hf")
    (pipeline_eval,) = [r["eval_loss"] for r in read_metrics(lora_run) if "eval_loss" in r]
    eval_loss = hf_eval_loss(exported, demo_model["eval"], demo_model["ds"], 64, str(demo_model["root"] / "peft_cache"))
    assert eval_loss == pytest.approx(pipeline_eval, abs=1e-5)
    trained = {n: p for n, p in exported.named_parameters() if "lora_" in n}
    assert len(trained) == 4 * 7 * 2
    for name, param in ref_model.named_parameters():
        if param.requires_grad:
            assert torch.allclose(trained[name], param, atol=1e-5), name



@pytest.mark.slow
def test_a_killed_lora_run_resumes_to_the_straight_runs_adapters(demo_model, lora_run, tmp_path):
    """lora_run's 6 steps, SIGKILLed at step 5 (latest: step 3) and resumed: the losses and the final adapters and
    their optimizer state are the uninterrupted run's, bit for bit."""
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, **TRAINING, save_steps=3, eval_file="null")
    killed = launch_trainer(1, overrides, script="tests/fault_injection.py", env={"FAULT": "sigkill:0:5"})
    assert killed.returncode != 0 and "FAULT sigkill AT 5" in killed.stdout, killed.stderr[-3000:]
    check_ok(launch_trainer(1, overrides + ["resume=auto"]))
    names = sorted(path.name for path in (lora_run / "global_step6").iterdir() if path.name.startswith("layer_"))
    assert names
    for name in names:
        expected, got = (tensors_of(torch.load(run / "global_step6" / name, weights_only=True))
                         for run in (lora_run, out))
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
    assert per_step_losses(out) == per_step_losses(lora_run)


@pytest.mark.slow
def test_data_and_tensor_parallel_runs_and_a_resume_on_another_layout_equal_peft(demo_model, peft_run, lora_run,
                                                                                tmp_path):
    """The same 6 steps on 2 stages x 2 data-parallel ranks (ZeRO-1) and on 1 stage x tensor parallel 2; the first's
    step-3 checkpoint resumed on 1 process goes on as the peft loop; the tensor-parallel run's slices export as the
    single process's adapter."""
    ref_losses, _ = peft_run
    runs = {"2x2": (4, dict(num_stages=2, gradient_accumulation_steps=2, zero_stage=1)),
            "tp2": (2, dict(tensor_parallel_size=2))}
    for name, (procs, layout) in runs.items():
        check_ok(launch_trainer(procs, demo_overrides(demo_model, tmp_path / name, **{
            **TRAINING, **layout, "save_steps": 3, "eval_file": "null"})))
        assert per_step_losses(tmp_path / name) == pytest.approx(ref_losses, abs=1e-4), name
    assert (tmp_path / "tp2" / "global_step6" / "layer_01-model_01-model_states.pt").is_file()
    resumed = tmp_path / "resumed"
    result = check_ok(launch_trainer(1, demo_overrides(demo_model, resumed, **{
        **TRAINING, "eval_file": "null", "resume": str(tmp_path / "2x2" / "global_step3")})))
    assert "resuming" in result.stdout and "num_stages 2 -> 1" in result.stdout
    assert per_step_losses(resumed) == pytest.approx(ref_losses[3:], abs=1e-4)

    from checkpoints.ds_to_hf import convert_ds_to_hf
    convert_ds_to_hf(str(tmp_path / "tp2"), str(tmp_path / "tp2_adapter"))
    single, sliced = (load_file(str(d / "adapter_model.safetensors")) for d in (lora_run / "hf", tmp_path / "tp2_adapter"))
    assert sorted(sliced) == sorted(single)
    for key, tensor in single.items():
        assert torch.allclose(sliced[key], tensor, atol=1e-5), key


def test_checkpoint_holds_the_adapters_and_points_at_its_base(demo_model, lora_run):
    from checkpoints.integrity import manifest_digest
    tag = lora_run / "global_step6"
    adapter_keys = {f"{'self_attn' if i < 4 else 'mlp'}.{name}.lora_{factor}.weight"
                    for i, name in enumerate(PROJECTIONS) for factor in "AB"}
    for index in range(1, 5):
        assert set(torch.load(tag / f"layer_{index:02d}-model_states.pt")) == adapter_keys
        optimizer_state = torch.load(tag / f"layer_{index:02d}-optim_states.pt")
        assert {key: set(values) for key, values in optimizer_state.items()} == {
            key: adapter_keys for key in ("fp32", "exp_avg", "exp_avg_sq")}
    for index in (0, 5, 6):  # embedding, final norm, LM head: frozen, nothing saved
        assert torch.load(tag / f"layer_{index:02d}-model_states.pt") == {}
        assert not (tag / f"layer_{index:02d}-optim_states.pt").exists()
    # The saved weights are the adapters' parameters and nothing else: a fifth of the base's bytes here.
    config = AutoConfig.from_pretrained(demo_model["hf"])
    saved = sum(t.numel() for i in range(1, 5) for t in torch.load(tag / f"layer_{i:02d}-model_states.pt").values())
    assert saved == 4 * adapter_parameter_count(config, LoraSettings(4, 8.0))
    base_tag = f"{demo_model['ds']}/global_step0"
    weights = sum(f.stat().st_size for f in tag.glob("layer_*-model_states.pt"))
    assert weights < sum(f.stat().st_size for f in Path(base_tag).glob("layer_*")) / 5
    state = json.loads((tag / "trainer_state.json").read_text())
    assert state["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": list(PROJECTIONS)}
    assert state["base_model"] == {"path": demo_model["ds"], "tag": "global_step0",
                                   "manifest_xxh3_128": manifest_digest(base_tag)}


@pytest.mark.slow
def test_merged_export_equals_peft_merge(demo_model, lora_run, tmp_path):
    from peft import PeftModel
    result = run_python(["convert2ckpt.py", "--to_hf", "--merge_lora", "--ckpt_dir", lora_run, "--output_dir",
                         tmp_path / "merged"])
    assert result.returncode == 0, result.stderr
    original = AutoModelForCausalLM.from_pretrained(demo_model["hf"]).state_dict()
    peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model["hf"]),
                                            lora_run / "hf").merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert sorted(merged) == sorted(peft_merged)
    changed = 0
    for key, tensor in merged.items():
        assert torch.allclose(tensor, peft_merged[key], atol=1e-6, rtol=0), key
        if not any(f".{name}." in key for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj")):
            assert torch.equal(tensor, original[key]), key  # embedding, norms, LM head: the base's bits
        changed += not torch.equal(tensor, original[key])
    assert changed == 4 * 7


@pytest.mark.parametrize("overrides,message", [
    ({"lora.rank": 4, "lora.target_modules": "[q_proj,qkv_proj]"},
     r"lora.target_modules \['q_proj', 'qkv_proj'\]: \['qkv_proj'\] matches no layer; the layers that take adapters "
     r"are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
     r"kv_b_proj, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, in_proj_qkvz, in_proj_ba, out_proj, "
     r"experts\.gate_up_proj, experts\.down_proj\."),
    ({"lora.rank": 4, "lora.target_modules": "[q_a_proj,experts.down_proj]"},
     r"lora.target_modules \['q_a_proj', 'experts\.down_proj'\] matches nothing of this llama model; it takes adapters "
     r"on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj\."),
    ({"lora.rank": 48}, r"lora.rank=48 does not fit k_proj \(smallest side 32\), v_proj \(smallest side 32\): a rank "
                        r"must be below a projection's smaller side; lower lora.rank."),
    ({"lora.rank": -1}, r"lora.rank=-1 must be an integer >= 0 \(0: full fine-tuning\)."),
    ({"++lora.ranks": 4}, r"unknown config key 'lora.ranks': did you mean lora.rank\?"),
    ({"lora.rank": 4, "num_stages": 2, "partition": "[4,0]"},
     r"partition \[4, 0\] \(decoder layers per stage\) leaves stage 1 without a decoder layer: under LoRA it would "
     r"hold no adapter, nothing to train; give every stage at least one decoder layer."),
], ids=["unknown_target", "target_the_model_lacks", "rank_too_wide", "negative_rank", "unknown_key",
        "stage_without_adapters"])
def test_bad_lora_config_is_refused_before_any_work(demo_model, tmp_path, overrides, message):
    overrides = {"num_stages": 1, **overrides}
    with pytest.raises(ValueError, match=message):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), overrides["num_stages"])
    assert not (tmp_path / "run").exists()


def test_lora_on_part_of_a_phi3_fused_projection_is_refused_before_any_work(demo_model, tiny_checkpoints, tmp_path):
    overrides = {"num_stages": 1, "lora.rank": 4, "lora.target_modules": "[q_proj,v_proj]",
                 "model_name_or_path": tiny_checkpoints["phi3"][1], "tokenizer_name_or_path": demo_model["ds"]}
    with pytest.raises(ValueError, match=r"lora.target_modules \['q_proj', 'v_proj'\]: a phi3 model fuses q_proj, "
                                         r"k_proj, v_proj into qkv_proj, which takes one adapter; target all of them "
                                         r"or none\."):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), 1)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_resume_refuses_another_base_and_a_full_fine_tuning_run(demo_model, lora_run, tmp_path):
    from checkpoints.hf_to_ds import convert_hf_to_ds
    other_hf, other_ds = tmp_path / "other_hf", tmp_path / "other_ds"
    model = AutoModelForCausalLM.from_pretrained(demo_model["hf"])
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3)  # the same shapes, other weights
    model.save_pretrained(other_hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (other_hf / name).write_bytes((Path(demo_model["hf"]) / name).read_bytes())
    convert_hf_to_ds(str(other_hf), str(other_ds))
    start = str(lora_run / "global_step3")
    runs = {
        "another base": (dict(TRAINING, model_name_or_path=str(other_ds), resume=start),
                         f"checkpoint {start} holds adapters trained on the base {demo_model['ds']} .*, but "
                         f"model_name_or_path {other_ds} has checksum .*: another base"),
        "full fine-tuning": ({"resume": start, "num_stages": 1},
                             rf"checkpoint {start} holds LoRA adapters, not a whole model: resume it as LoRA with "
                             r"lora.rank=4 lora.alpha=8.0 lora.target_modules=\[q_proj,k_proj,v_proj,o_proj,"
                             r"gate_proj,up_proj,down_proj\]"),
        "another rank": (dict(TRAINING, resume=start, **{"lora.rank": 8}),
                         rf"checkpoint {start} holds adapters with lora.rank=4 .*; this run has lora.rank=8"),
    }
    for name, (overrides, message) in runs.items():
        with pytest.raises(ValueError, match=message):
            run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), 1)
        assert not (tmp_path / "run").exists(), name
    result = run_python(["convert2ckpt.py", "--to_hf", "--merge_lora", "--ckpt_dir", demo_model["ds"],
                         "--output_dir", tmp_path / "merged"])
    assert result.returncode == 1 and "holds no LoRA adapters (it is a whole model); export it without --merge_lora" \
        in result.stderr


def test_memory_plan_counts_the_frozen_base_and_the_adapters():
    """llama3_70b_lora on one node of 8 x 80 GB: the bf16 base's weights, the adapters' gradients (bf16, summed in
    fp32 beside them) and their fp32 master and Adam moments; full fine-tuning on the same devices does not fit even
    offloading nothing."""
    from planner.memory_plan import memory_plan
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec
    spec = plan_spec(run_config("llama3_70b_lora"), 8)
    rows = memory_plan(spec)
    adapters = adapter_parameter_count(spec.model_config, spec.lora)  # per decoder layer
    # rank x (in + out) per projection: q and o 8192 + 8192, k and v 8192 + 1024, gate, up and down 8192 + 28672
    assert adapters == 16 * (2 * 16384 + 2 * 9216 + 3 * 36864)
    for row in rows:
        decoders = row["decoder_layers"]
        assert row["gradients_bytes"] == decoders * adapters * 6
        assert row["optimizer_bytes"] == decoders * adapters * 12
        assert row["fits"] and row["memory_bytes"] < 30 * 2**30
    full = memory_plan(plan_spec(run_config("llama3_70b_lora", "lora.rank=0", "offload_optimizer=none"), 8))
    assert not any(row["fits"] for row in full)


@pytest.mark.slow
def test_lora_trains_on_packed_chat_on_two_stages_with_zero_bubble_and_offload(demo_model, tmp_path):
    """Chat data, packing, 2 stages, the zero-bubble schedule, checkpointing and the offloaded optimizer together: the
    loss falls and the run exports a peft adapter (parity with peft: the tests above; evaluation of packed chat:
    tests/test_packing.py)."""
    from tests.chat_tokenizers import write_chat_files
    data, template = write_chat_files(tmp_path, 64)
    out = tmp_path / "run"
    check_ok(launch_trainer(2, demo_overrides(
        demo_model, out, num_stages=2, train_file=data, eval_file="null", seq_length=256, max_steps=6,
        learning_rate=1e-2, logging_steps=1, pipeline_schedule="zero_bubble", activation_checkpoint_interval=1,
        export_hf="true", offload_optimizer="cpu", zero_stage=1,
        **{"lora.rank": 4, "data.format": "chat", "data.chat_template": template, "data.packing": "true",
           "data.cache_dir": tmp_path / "cache"})))
    losses = [record["loss"] for record in read_metrics(out) if "loss" in record]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert json.loads((out / "hf" / "adapter_config.json").read_text())["r"] == 4


def test_phi3_adapters_export_on_the_fused_projections_and_load_in_peft(tiny_checkpoints, tmp_path):
    """A LoRA checkpoint of Phi-3 (its layer files as training saves them: the adapters of the split projections, the
    parts of a fused one sharing A) exports as peft's adapter on qkv_proj and gate_up_proj: peft loads it onto the
    Hugging Face model with every adapter's value, the stacked B of each fused projection and its one A."""
    from peft import PeftModel
    from transformers import AutoConfig

    from checkpoints.ds_to_hf import convert_ds_to_hf
    from models.layout import hf_name_of_layer_key
    from models.pipeline_layers import DecoderLayerPipe
    from models.lora import add_adapters, is_adapter_key
    from tests.lora_reference import hf_name_of_peft

    hf_dir = tiny_checkpoints["phi3"][0]
    config, settings = AutoConfig.from_pretrained(hf_dir), LoraSettings(rank=4, alpha=8.0)
    tag_dir = tmp_path / "ckpt" / "global_step1"
    tag_dir.mkdir(parents=True)
    config.save_pretrained(tag_dir)
    for index in (0, config.num_hidden_layers + 1, config.num_hidden_layers + 2):  # frozen: saved without weights
        torch.save({}, tag_dir / f"layer_{index:02d}-model_states.pt")
    pipeline = {}
    for index in range(1, config.num_hidden_layers + 1):
        layer = DecoderLayerPipe(config, stage_inputs=None)
        add_adapters(layer, settings, config, seed=3, index=index)
        with torch.no_grad():  # B nonzero, so that every part's rows show in the fused B
            for name, param in layer.named_parameters():
                if name.endswith("lora_B.weight"):
                    param.normal_()
        adapters = {k: v for k, v in layer.state_dict().items() if is_adapter_key(k)}
        torch.save(adapters, tag_dir / f"layer_{index:02d}-model_states.pt")
        pipeline.update({hf_name_of_layer_key(index, k, config.num_hidden_layers): v for k, v in adapters.items()})
    (tag_dir / "trainer_state.json").write_text(json.dumps(
        {"lora": settings.as_dict(), "base_model": {"path": hf_dir, "tag": "global_step0"}}))
    convert_ds_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "adapter"), tag="global_step1", verify_checksums=False)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), tmp_path / "adapter")
    loaded = {hf_name_of_peft(n): p for n, p in model.named_parameters() if "lora_" in n}
    layer0 = "model.layers.0"
    assert sorted(n.removeprefix(f"{layer0}.") for n in loaded if n.startswith(f"{layer0}.")) == sorted(
        f"{module}.lora_{factor}.weight" for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                       "mlp.down_proj") for factor in "AB")
    assert torch.equal(loaded[f"{layer0}.self_attn.qkv_proj.lora_A.weight"],
                       pipeline[f"{layer0}.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(loaded[f"{layer0}.self_attn.qkv_proj.lora_B.weight"], torch.cat(
        [pipeline[f"{layer0}.self_attn.{p}_proj.lora_B.weight"] for p in "qkv"]))
    assert torch.equal(loaded[f"{layer0}.mlp.gate_up_proj.lora_B.weight"], torch.cat(
        [pipeline[f"{layer0}.mlp.{p}_proj.lora_B.weight"] for p in ("gate", "up")]))
    assert torch.equal(loaded[f"{layer0}.mlp.down_proj.lora_A.weight"], pipeline[f"{layer0}.mlp.down_proj.lora_A.weight"])


# Mixtures of experts: {family: targets}, every way peft 0.21 reaches a family's weights. Qwen3-MoE's defaults (the
# MLP names read as its experts: gate_up_proj at twice the rank); Mixtral's experts by peft's target_parameters
# (both, so nested) beside its attention; GPT-OSS's transposed experts, gate_up_proj alone; DeepSeek-V3's latent
# attention beside its experts' down_proj; Qwen2-MoE's shared expert and dense MLPs beside its experts.
MOE_EXPORTS = {"qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               "mixtral": ("q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"),
               "gpt_oss": ("q_proj", "experts.gate_up_proj"),
               "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                               "experts.down_proj"),
               "qwen2_moe": ("o_proj", "gate_proj", "up_proj", "down_proj", "experts.gate_up_proj",
                             "experts.down_proj")}


def lora_checkpoint(config, settings, adapters, base_dir, root):
    """A LoRA training checkpoint of `adapters` ({the pipeline's HF name: value}), its layer files as training saves
    them, on the converted base `base_dir`: the checkpoint directory."""
    from checkpoints.integrity import manifest_digest
    from models.layout import layer_of_hf_name
    tag_dir = root / "ckpt" / "global_step1"
    tag_dir.mkdir(parents=True)
    config.save_pretrained(tag_dir)
    files = {index: {} for index in range(config.num_hidden_layers + 3)}
    for name, value in adapters.items():
        index, key = layer_of_hf_name(name, config.num_hidden_layers, config.tie_word_embeddings)
        files[index][key] = value
    for index, state in files.items():
        if index < config.num_hidden_layers + 2 or not config.tie_word_embeddings:
            torch.save(state, tag_dir / f"layer_{index:02d}-model_states.pt")
    base_tag = f"{base_dir}/global_step0"
    (tag_dir / "trainer_state.json").write_text(json.dumps({"lora": settings.as_dict(), "base_model": {
        "path": base_dir, "tag": "global_step0", "manifest_xxh3_128": manifest_digest(base_tag)}}))
    (root / "ckpt" / "latest").write_text("global_step1")
    return root / "ckpt"


def pipeline_logits(config, hf_model, settings, adapters, input_ids):
    """The pipeline's layers holding hf_model's weights and `adapters` (of `settings`), run in one process on
    input_ids."""
    from models.layout import hf_name_of_layer_key, layer_of_hf_name
    from models.pipeline_layers import DecoderLayerPipe, lm_head
    from models.lora import add_adapters
    from models.pipeline import build_pipeline_layers
    layers = [spec.build() for spec in build_pipeline_layers(config)]
    state = {}
    for name, tensor in hf_model.state_dict().items():
        index, key = layer_of_hf_name(name, config.num_hidden_layers, config.tie_word_embeddings)
        state.setdefault(index, {})[key] = tensor
    for index, layer in enumerate(layers):
        if isinstance(layer, DecoderLayerPipe):
            add_adapters(layer, settings, config, index=index)
            state[index].update({key: adapters[hf_name_of_layer_key(index, key, config.num_hidden_layers)]
                                 for key, _ in layer.named_parameters() if ".lora_" in key})
        if index in state:
            layer.load_state_dict(state[index])
    x = (input_ids, torch.ones_like(input_ids), torch.arange(input_ids.shape[1]).expand_as(input_ids))
    with torch.no_grad():
        for layer in layers[:-1]:
            x = layer(x)
        return (lm_head(layers[0], x) if config.tie_word_embeddings else layers[-1](x))[0]


SETTINGS_OF = {family: LoraSettings(rank=2, alpha=6.0, target_modules=targets)
               for family, targets in MOE_EXPORTS.items()}


@pytest.mark.parametrize("family", MOE_EXPORTS)
def test_moe_adapters_export_as_peft_loads_them_and_merge_as_peft_merges(tiny_moe_checkpoints,
                                                                       tiny_deepseek_checkpoints, tmp_path, family):
    """A LoRA checkpoint of a mixture of experts (random adapters, B nonzero; the experts' in the pipeline's [E, rank,
    in] / [E, out, rank]) exports as a peft adapter that peft 0.21 loads onto transformers' model with no missing or
    unexpected key, whose logits are the pipeline's with those adapters; its merged export equals peft's
    merge_and_unload and loads in transformers with no missing or unexpected key."""
    from peft import PeftModel

    from checkpoints.ds_to_hf import convert_ds_to_hf
    from tests.lora_reference import adapter_values
    hf_dir, ds_dir = {**tiny_moe_checkpoints, **tiny_deepseek_checkpoints}[family]
    config, settings = AutoConfig.from_pretrained(hf_dir), SETTINGS_OF[family]
    adapters = adapter_values(config, settings, seed=3, nonzero_b=True)
    checkpoint = lora_checkpoint(config, settings, adapters, ds_dir, tmp_path)
    convert_ds_to_hf(str(checkpoint), str(tmp_path / "adapter"), verify_checksums=False)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    input_ids = torch.arange(3, 19).view(1, 16) % config.vocab_size
    expected = pipeline_logits(config, base, settings, adapters, input_ids)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                      tmp_path / "adapter")
    loaded = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(loaded) == len(adapters)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == \
        sum(t.numel() for t in adapters.values())
    with torch.no_grad():
        logits = model(input_ids).logits[0]
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    assert not torch.allclose(logits, base(input_ids).logits[0], atol=1e-3)  # the adapters move the logits

    convert_ds_to_hf(str(checkpoint), str(tmp_path / "merged"), merge_lora=True, verify_checksums=False)
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info
    peft_merged = model.merge_and_unload().state_dict()
    for key, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, peft_merged[key], atol=1e-6, rtol=0), key
