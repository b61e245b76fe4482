"""The Gated DeltaNet hybrids (Qwen3.5, Qwen3.6, Qwen3.5-MoE, Qwen3-Next) on the pipeline: its layers equal
transformers in one process (loss, every gradient, padded rows); over 1, 2 and 4 stages, data, tensor and expert
parallelism (real processes), the losses and gradients after every reduction equal transformers'; six training
steps with clipping equal a transformers + torch AdamW loop; fp32-stored tensors stay fp32 in training and export.
The single-device model's parity (padded and packed rows, the multimodal checkpoints) is tests/test_single_device.py's.
"""
import pytest
import torch

from tests.test_moe import pipeline_in_one_process
from tests.tiny_models import HYBRID_CONFIGS, make_tiny_model

HYBRIDS = list(HYBRID_CONFIGS)


def assert_gradients_equal(grads, expected, family):
    assert set(grads) == set(expected), family
    for name, grad in grads.items():
        reference = expected[name]
        scale = reference.abs().max().item() or 1.0
        assert (grad - reference).abs().max().item() / scale < 1e-4, (family, name)


@pytest.mark.parametrize("chunk_tokens", [0, 7], ids=["logits", "chunked"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_layers_equal_transformers_in_one_process(tmp_path, family, chunk_tokens):
    """The pipeline's layers run one after the other on padded rows: the loss (with Qwen3.5-MoE's and Qwen3-Next's
    load-balancing term) and every weight's gradient are transformers'."""
    reference = make_tiny_model(family, tmp_path)
    loss, grads, outputs, expected = pipeline_in_one_process(reference.config, reference.train(), chunk_tokens)
    assert loss.item() == pytest.approx(outputs.loss.item(), abs=1e-5)
    expected = {name: grad for name, grad in expected.items()
                if not (reference.config.tie_word_embeddings and name == "lm_head.weight")}
    assert_gradients_equal(grads, expected, family)


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_tensor_parallel_size_that_cannot_split_the_linear_heads_is_refused_in_one_line(family):
    """Gated DeltaNet splits by key and value heads: a size that does not divide them is refused, naming them."""
    from models.tensor_parallel import check_tensor_parallel_split
    config = HYBRID_CONFIGS[family]()
    check_tensor_parallel_split(config, 2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=4 does not divide .*linear_num_key_heads=2") as error:
        check_tensor_parallel_split(config, 4)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_tensor_parallel_shards_cut_the_linear_attention_per_head_and_load_at_any_size(family):
    """Under tensor parallelism 2 each rank's in_proj_qkv and convolution channels are its key heads' q and k and
    its value heads' v (shard_of's blocks), and a layer saved as 2 slices loads whole into an unsplit layer and back
    into each rank's slice: resharding and export join the blocks as they were cut."""
    from checkpoints.layer_files import tensors_for_rank
    from models.pipeline_layers import decoder_on_meta
    from models.tensor_parallel import joined_shards, shard_of
    config = HYBRID_CONFIGS[family]()
    whole, halves = decoder_on_meta(config, 1, layer_index=0), decoder_on_meta(config, 2, layer_index=0)
    state = {key: torch.randn(tensor.shape) for key, tensor in whole.state_dict().items()}
    targets = dict(halves.named_parameters())
    saved = [{key: shard_of(tensor, targets[key].tensor_parallel_dim, rank, 2,
                            getattr(targets[key], "tensor_parallel_blocks", None))
              if getattr(targets[key], "tensor_parallel_dim", None) is not None else tensor
              for key, tensor in state.items()} for rank in range(2)]
    channels = saved[0]["linear_attn.conv1d.weight"][:, 0, 0]
    key_dim, value_dim = 2 * 8, 4 * 8  # 2 key heads and 4 value heads of 8
    q, k, v = state["linear_attn.conv1d.weight"][:, 0, 0].split([key_dim, key_dim, value_dim])
    assert torch.equal(channels, torch.cat([q[:8], k[:8], v[:16]]))  # key head 0, value heads 0 and 1
    loaded = tensors_for_rank(saved, dict(whole.named_parameters()), 0, 1, "test")
    assert all(torch.equal(loaded[key], state[key]) for key in state)
    for rank in range(2):
        again = tensors_for_rank([state], targets, rank, 2, "test")
        assert all(torch.equal(again[key], saved[rank][key]) for key in state)
    dim, blocks = 0, targets["linear_attn.conv1d.weight"].tensor_parallel_blocks
    assert torch.equal(joined_shards([s["linear_attn.conv1d.weight"] for s in saved], dim, blocks),
                       state["linear_attn.conv1d.weight"])


def test_an_adapter_on_in_proj_qkv_splits_its_b_per_block_and_exports_whole():
    """Under tensor parallelism 2 in_proj_qkv's adapter keeps A whole and cuts B per q/k/v block as its projection's
    rows are cut (marked so at any size, so that a checkpoint saved split loads whole), and export joins the blocks
    back as they were cut. Its values against peft: test_loss_and_gradients_equal_transformers_across_processes."""
    from checkpoints.ds_to_hf import split_blocks_of, split_dims_of
    from models.lora import LoraSettings, add_adapters
    from models.pipeline_layers import decoder_on_meta
    config = HYBRID_CONFIGS["qwen3_5"]()
    settings = LoraSettings(rank=4, target_modules=("in_proj_qkv",))
    blocks = (2 * 8, 2 * 8, 4 * 8)  # q, k (2 key heads of 8) and v (4 value heads of 8)
    for size in (1, 2):
        layer = decoder_on_meta(config, size, layer_index=0)
        add_adapters(layer, settings, config, size)
        projection = layer.linear_attn.in_proj_qkv
        assert projection.lora_B.weight.tensor_parallel_blocks == projection.weight.tensor_parallel_blocks == blocks
        assert projection.lora_B.weight.shape == (sum(blocks) // size, 4)
        assert projection.lora_A.weight.shape == (4, config.hidden_size)
    prefix = "linear_attn.in_proj_qkv"
    assert split_blocks_of(config, 2, settings)[1][f"{prefix}.lora_B.weight"] == blocks
    dims = split_dims_of(config, 2, settings)[1]
    assert (dims[f"{prefix}.lora_B.weight"], dims[f"{prefix}.lora_A.weight"]) == (0, None)


# --- many processes ------------------------------------------------------------------------------------------------

LAYOUTS = {  # name: (stages, world size, tensor parallel, {case suffix: options}, families)
    "1stage": (1, 1, 1, {"": {}}, HYBRIDS),
    "2stages": (2, 2, 1, {"": {}}, HYBRIDS),
    "4stages": (4, 4, 1, {"": {}}, HYBRIDS),
    "2stages_x_2dp": (2, 4, 1, {"+checkpointing": {"checkpoint_interval": 1},
                                "+zero_bubble": {"schedule": "zero_bubble"}}, ("qwen3_5", "qwen3_next")),
    "2stages_x_ep2": (2, 4, 1, {"+ep2": {"expert_parallel": 2}}, ("qwen3_5_moe", "qwen3_next")),
    "2stages_x_tp2": (2, 4, 2, {"+sp": {}, "": {"sequence_parallel": False}}, HYBRIDS),
}
# Context 2 sharing a layout's launch, its group on the data axis: {layout: [(family, case suffix, options)]}.
# Qwen3.5-MoE's linear attention (the head all-to-all) beside its experts' load-balancing loss over the group's tokens.
CONTEXT_IN_LAUNCH = {"2stages_x_2dp": [("qwen3_5_moe", "+cp2", {"context_parallel": 2})]}
# the linear attention's projections, whose weight gradients a zero-bubble schedule leaves to W
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
# LoRA cases sharing a layout's launch, checked against peft: under tensor parallelism in_proj_qkv's adapter's B cut
# per q/k/v block (Qwen3.5, with sequence parallelism), Qwen3-Next's fused in_proj_qkvz / in_proj_ba by key heads
LORA_IN_LAUNCH = {"2stages_x_tp2": [
    dict(name="qwen3_5+lora+sp", family="qwen3_5", lora=("q_proj", "v_proj") + LINEAR_PROJECTIONS),
    dict(name="qwen3_next+lora", family="qwen3_next", lora=("o_proj",) + LINEAR_PROJECTIONS,
         sequence_parallel=False)]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_gradients_equal_transformers_across_processes(tiny_hybrid_checkpoints, tmp_path, layout):
    """One launch per layout runs the hybrids, their layer pattern split across the stages wherever the partition
    falls: the per-micro-batch losses (padded rows) and every gradient after the data-parallel (and expert-parallel)
    reductions equal transformers'; each rank reads only its stage's layer files; under the zero-bubble schedule the
    linear attention's projections have their weight gradients computed at W. Context 2's cases (CONTEXT_IN_LAUNCH):
    the group's mean loss and every gradient, the load-balancing loss's included, transformers' on the whole rows."""
    from tests.test_lora import LORA
    from tests.test_moe import assert_parity_across_processes, cases_of
    num_stages, world_size, tensor_parallel, variants, families = LAYOUTS[layout]
    cases = [dict(name=family + suffix, hf_dir=tiny_hybrid_checkpoints[family][0],
                  ds_dir=tiny_hybrid_checkpoints[family][1], **options)
             for suffix, options in variants.items() for family in families]
    cases += cases_of(tiny_hybrid_checkpoints, CONTEXT_IN_LAUNCH.get(layout, ()))
    adapted = [dict({k: v for k, v in case.items() if k not in ("family", "lora")},
                    hf_dir=tiny_hybrid_checkpoints[case["family"]][0],
                    ds_dir=tiny_hybrid_checkpoints[case["family"]][1], lora=dict(LORA, target_modules=case["lora"]))
               for case in LORA_IN_LAUNCH.get(layout, ())]
    ranks = assert_parity_across_processes(cases, tmp_path, num_stages, world_size, tensor_parallel, adapted)
    assert_adapters_match_peft(adapted, ranks)
    for name in {name for rank in ranks for name in rank if name.endswith("+zero_bubble")}:
        projections = {n for rank in ranks for n in rank[name]["param_names"]
                       if ".linear_attn." in n and n.rsplit(".", 2)[-2] in LINEAR_PROJECTIONS}
        deferred = {n for rank in ranks for n in rank[name]["deferred_weights"]}
        # the first stage's first layer computes its weight gradients with the input's (which nothing needs)
        kinds = {n.rsplit(".", 2)[-2] for n in projections}
        assert kinds and kinds == {n.rsplit(".", 2)[-2] for n in projections & deferred}, name


@pytest.mark.slow
def test_adapters_on_the_linear_attention_match_peft(tiny_hybrid_checkpoints, tmp_path):
    """LoRA on every projection of both token mixers (peft's names: Qwen3.5's in_proj_qkv / z / b / a and out_proj,
    Qwen3-Next's fused in_proj_qkvz / in_proj_ba) over 2 stages: one step's loss and every adapter's gradient equal
    peft's on transformers; the base takes no gradient; under zero-bubble the adapters' weight gradients go to W."""
    from models.lora import LINEAR_PROJECTIONS, MLP_PROJECTIONS
    from tests.test_lora import ATTENTION, LORA, run_lora_parity
    targets = ATTENTION + LINEAR_PROJECTIONS + MLP_PROJECTIONS
    cases = [dict(name="qwen3_5", model="qwen3_5", lora=dict(LORA, target_modules=targets)),
             dict(name="qwen3_next+zero_bubble", model="qwen3_next", schedule="zero_bubble",
                  lora=dict(LORA, target_modules=ATTENTION + LINEAR_PROJECTIONS))]
    assert_adapters_match_peft(cases, run_lora_parity(tiny_hybrid_checkpoints, tmp_path, cases, 2, 2))


def assert_adapters_match_peft(cases, ranks):
    """Each LoRA case's loss and every adapter's gradient (on some rank, each rank's slice) equal peft's, equal over
    the tensor-parallel group where replicated; the base takes no gradient; under zero-bubble the adapters' weight
    gradients went to W."""
    for case in cases:
        name = case["name"]
        for rank in ranks:
            result = rank[name]
            assert result["mean_loss"] == pytest.approx(sum(result["ref_losses"]) / len(result["ref_losses"]),
                                                         abs=1e-5), name
            bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
            assert not bad, f"{name}: adapter gradients differ from peft's: {bad}"
            assert result["frozen_unchanged_without_grad"], name
            assert result["replicated_grad_spread"] == 0.0, name
        compared = set().union(*(r[name]["grad_errors"] for r in ranks))
        assert compared == set(ranks[0][name]["ref_param_names"])
        assert any(".linear_attn.in_proj_" in n for n in compared), name
        if case.get("schedule") == "zero_bubble":
            deferred = set().union(*(r[name]["deferred_weights"] for r in ranks))
            assert deferred and all(".lora_" in n for n in deferred), name


# The chunked schedules (two chunks per rank) against 1F1B on 2 ranks, in one launch (tests/schedule_worker.py,
# tests/test_schedule.py's checks): interleaved 1F1B and ZB-V, whose W computes the linear attention's projections'
# weight gradients as ZB-H1's does; the tied Qwen3.5 (ZB-V sums its embedding's and head's gradients on one rank:
# test_schedule.py's 2e-6), Qwen3-Next's fused projections and load-balancing loss. Beside them, in the same launch,
# Gemma's own layers over uneven chunks (6 layers: 2, 2, 1, 1), their tied embedding and soft cap (ZB-V's gradient
# of a q/k norm's weight, a sum over every token and head, seen 2.2e-6 from 1F1B's: 3e-6): Gemma 3, and Gemma 4
# E2B-like with per-layer inputs and shared keys and values, whose tuple differs at each boundary (none after
# chunk 0, layers 2's and 3's after chunk 1, layer 3's after chunk 2: engines/chunked_engine.py sends each
# boundary's own shapes): its losses equal 1F1B's bit for bit, interleaved's gradients within 1.2e-7, ZB-V's second
# step's gradient of layer 0's input norm weight 3.4e-6 from 1F1B's, its first step's gradients within 6.3e-8 (sums
# in another order, the per-layer norm's and the tied embedding's, grown through Adam's first step): 4e-6. Gemma 4
# 31B-like was once 2.2e-6 and once 1.1e-5 from 1F1B under ZB-V (a layer's MLP weight gradient), not yet explained,
# so not held here.
CHUNKED_HYBRIDS = ("qwen3_5_tied", "qwen3_next")
ZBV_TOLERANCES = {"gemma3_text": 3e-6, "gemma4_e2b": 4e-6}
SCHEDULE_CASES = {family: (family, dict(stages=2, schedules=("interleaved_1f1b", "zbv"), virtual_stages=2,
                                        zbv_tolerance=ZBV_TOLERANCES.get(family, 2e-6)))
                  for family in (*CHUNKED_HYBRIDS, *ZBV_TOLERANCES)}


@pytest.mark.slow
def test_chunked_schedules_equal_1f1b(tiny_hybrid_checkpoints, tiny_layer_type_checkpoints, tmp_path):
    """Interleaved 1F1B and ZB-V on the hybrids and on Gemma's own layers (Gemma 4's tuple another at each chunk
    boundary): two steps' losses, the evaluation loss, every gradient (by name across the ranks) and the weights the
    steps leave equal the 1F1B run's."""
    from tests.test_schedule import launch_cases
    ranks = launch_cases(SCHEDULE_CASES, {**tiny_hybrid_checkpoints, **tiny_layer_type_checkpoints}, 2, tmp_path)
    for name in CHUNKED_HYBRIDS:  # ZB-V's W computed every linear-attention projection's weight gradient (on some rank)
        deferred = {n.rsplit(".", 2)[-2] for rank in ranks for n in rank[name]["zbv"]["deferred_weights"]
                    if ".linear_attn." in n}
        expected = {"in_proj_qkvz", "in_proj_ba", "out_proj"} if "next" in name else \
            {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
        assert deferred == expected, name
    # Gemma 4's tuple after chunks 0, 1, 2: hidden states, embedded tokens, document ids, positions, token ids (5),
    # with layers 2's and 3's keys and values (9), with layer 3's (7); ZB-V hands the one after chunk 1 over in place
    for schedule, boundaries in (("interleaved_1f1b", [5, 7, 9]), ("zbv", [5, 7])):
        assert sorted(n for rank in ranks for n in rank["gemma4_e2b"][schedule]["received_tuples"]) == boundaries


# DPO and SimPO on Qwen3.5 against TRL's DPOTrainer and CPOTrainer (tests/test_preference.py's first step:
# FIRST_STEP_REFERENCE as DPO's reference log-probabilities, padded pairs), DPO with full weights and LoRA (the default
# targets, B nonzero), one process (most of its cost the process start and TRL's import, which the cases share). DPO
# on 2 stages x 2 data-parallel, its first step and four steps of the trainer: tests/test_preference.py.
@pytest.mark.slow
def test_dpo_and_simpo_first_step_equal_trl(tmp_path):
    """The first step's loss, rewards and every gradient (the linear attention's included; the adapters' under
    LoRA) within 1e-5 of TRL's DPOTrainer on transformers (peft under LoRA), and of its CPOTrainer under SimPO
    (loss_type="simpo": each response's length-normalised log-probability, the margin gamma)."""
    from tests.distributed import spawn
    from tests.test_preference import FIRST_STEP_REFERENCE, LORA_RANK, assert_first_step_matches_trl, \
        chat_preference_checkpoint
    model = chat_preference_checkpoint(tmp_path / "qwen3_5", HYBRID_CONFIGS["qwen3_5"](), "qwen3",
                                       len(FIRST_STEP_REFERENCE))
    spawn(preference_first_steps, 1, model, tmp_path)
    for case, rank in (("full", 0), ("lora", LORA_RANK)):
        assert_first_step_matches_trl(model, tmp_path, case, 1, 1, lora_rank=rank)
    assert_first_step_matches_trl(model, tmp_path, "simpo", 1, 1, objective="simpo")


def preference_first_steps(rank, model, root):
    import torch.distributed
    from cluster.distributed import init_distributed
    from tests.test_preference import LORA_RANK, pipeline_first_step
    init_distributed(timeout_minutes=2)
    pipeline_first_step(rank, model, root, "full")
    pipeline_first_step(rank, model, root, "lora", lora_rank=LORA_RANK)
    pipeline_first_step(rank, model, root, "simpo", objective="simpo")
    torch.distributed.destroy_process_group()


# --- training ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_hybrids(demo_model, tmp_path_factory):
    """Tiny Qwen3.5 and Qwen3.5-MoE (the load-balancing loss on) over the demo model's tokenizer: {family: {hf, ds}}."""
    from tests.test_moe import demo_model_of
    return {family: demo_model_of(HYBRID_CONFIGS[family](), demo_model, tmp_path_factory.mktemp(family))
            for family in ("qwen3_5", "qwen3_5_moe")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1_process", "2stages", "2stages_x_2dp"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_training_steps_equal_transformers(demo_model, demo_hybrids, tmp_path, family, layout, monkeypatch):
    """Six steps of the trainer on instruction data (padded rows), clipping active: the logged loss and the step-1
    gradient norm are those of transformers + torch AdamW on the same global batches (2 x 2: ZeRO-1)."""
    import tests.test_moe as moe_tests
    # The demo tokenizer named explicitly: AutoTokenizer maps model_type qwen3_5_moe_text to Qwen3_5Tokenizer
    # whatever tokenizer_config.json says, which would tokenize the run's data unlike the reference's.
    procs, settings = moe_tests.TRAIN_LAYOUTS[layout]
    monkeypatch.setitem(moe_tests.TRAIN_LAYOUTS, layout,
                        (procs, {**settings, "tokenizer_name_or_path": demo_model["hf"]}))
    records, losses, norms, _ = moe_tests.trained_and_transformers(demo_model, demo_hybrids[family], tmp_path,
                                                                   layout)
    assert min(norms) > moe_tests.MAX_GRAD_NORM  # clipping acts on every step
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-4, rel=0)
    assert records[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-4)


# --- dtypes as stored, the multimodal checkpoint trained and exported ------------------------------------------------

def multimodal_hub_checkpoint(demo_model, root, fp32):
    """A tiny Qwen3.5 multimodal checkpoint as the hub ships it, over the demo model's tokenizer: bf16, the names in
    `fp32` stored in fp32 (Qwen3.5's; Qwen3.6: none), a vision tower and the MTP layer; converted. {hf, ds}."""
    import os
    import shutil
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from checkpoints.hf_to_ds import convert_hf_to_ds
    from tests.hub_checkpoints import QWEN_VISION, hf_weights, mtp, rewrite_shards
    tokens = AutoConfig.from_pretrained(demo_model["hf"])
    text = {**HYBRID_CONFIGS["qwen3_5"]().to_dict(), "max_position_embeddings": 128,
            **{field: getattr(tokens, field) for field in ("vocab_size", "bos_token_id", "eos_token_id",
                                                          "pad_token_id")}}
    config = Qwen3_5Config(text_config=text, vision_config=QWEN_VISION, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(std=0.1)
            if name.endswith(fp32):
                param.data = param.data.float()
    hf, ds = root / "hf", root / "ds"
    model.save_pretrained(hf, max_shard_size="20KB")
    rewrite_shards(hf, {**hf_weights(hf), **mtp()})
    for name in os.listdir(demo_model["hf"]):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(demo_model["hf"], name), hf)
    convert_hf_to_ds(str(hf), str(ds))
    return {"hf": str(hf), "ds": str(ds)}


@pytest.mark.slow
@pytest.mark.parametrize("release", ["qwen3_5", "qwen3_6"])
def test_bf16_training_keeps_each_tensor_as_stored_through_checkpoint_and_export(demo_model, tmp_path, release):
    """The multimodal checkpoint trained in bf16 over 2 stages (its text model; the vision tower and the MTP layer
    carried): the fp32-stored A_log and gated-norm weights (Qwen3.5) stay fp32 in the training checkpoint's layer
    files and in the export, and train; Qwen3.6's bf16 ones stay bf16; every other tensor keeps its dtype, the carried ones their
    bits; the export loads in transformers as the original did."""
    from transformers import Qwen3_5ForConditionalGeneration
    from checkpoints.layer_files import mapped
    from models.layout import layer_file_path
    from tests.hub_checkpoints import FP32_AS_STORED, hf_weights
    from tests.launch import check_ok, demo_overrides, launch_trainer
    fp32 = FP32_AS_STORED if release == "qwen3_5" else ()
    dirs = multimodal_hub_checkpoint(demo_model, tmp_path / "model", fp32)
    out = tmp_path / "run"
    check_ok(launch_trainer(2, demo_overrides(demo_model, out, model_name_or_path=dirs["ds"], precision="bf16",
                                              zero_stage=1, max_steps=2, save_steps=2, eval_steps=0, logging_steps=1,
                                              learning_rate=1e-2, lr_scheduler="constant", warmup_steps=0,
                                              export_hf="true")))
    layer = mapped(layer_file_path(str(out / "global_step2"), 1))  # a linear-attention layer
    expected = torch.float32 if fp32 else torch.bfloat16
    assert layer["linear_attn.A_log"].dtype == layer["linear_attn.norm.weight"].dtype == expected
    assert layer["linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16
    before, after = hf_weights(dirs["hf"]), hf_weights(out / "hf")
    assert set(after) == set(before)
    assert {name: t.dtype for name, t in after.items()} == {name: t.dtype for name, t in before.items()}
    assert all(torch.equal(after[name], before[name]) for name in before if name.startswith(("model.visual.", "mtp.")))
    for trained in ("layers.0.linear_attn.A_log", "layers.0.linear_attn.in_proj_qkv.weight"):
        name = f"model.language_model.{trained}"
        assert not torch.equal(after[name], before[name]), name
    exported, info = Qwen3_5ForConditionalGeneration.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_tensor_parallel_checkpoint_reloads_and_exports_bit_identical(tiny_hybrid_checkpoints, tmp_path, family):
    """Saved by 2 tensor-parallel ranks (in_proj_qkv and the convolution's channels cut per q/k/v block), the
    checkpoint reloads into the same ranks, merges into 2 stages without tensor parallelism equal to the converted
    layer files, and exports to the original Hugging Face tensors bit for bit."""
    import glob
    import json
    import os
    from safetensors.torch import load_file
    from tests.distributed import spawn
    from tests.test_tensor_parallel import save_and_export_worker
    hf_dir, ds_dir = tiny_hybrid_checkpoints[family]
    spawn(save_and_export_worker, 2, hf_dir, ds_dir, str(tmp_path))
    assert (tmp_path / "ckpt" / "tp2" / "layer_01-model_01-model_states.pt").is_file()
    assert all(json.load(open(tmp_path / f"reloaded{rank}.json")) for rank in range(2))
    merged = {k: v for rank in range(2) for k, v in json.load(open(tmp_path / f"merged{rank}.json")).items()}
    assert merged and all(merged.values()), merged
    original = {k: v for p in glob.glob(os.path.join(hf_dir, "*.safetensors")) for k, v in load_file(p).items()}
    exported = {k: v for p in glob.glob(str(tmp_path / "hf" / "*.safetensors")) for k, v in load_file(p).items()}
    assert sorted(exported) == sorted(original)
    assert all(exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor)
               for key, tensor in original.items())
