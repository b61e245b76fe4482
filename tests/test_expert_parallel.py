"""Expert parallelism (models/expert_parallel.py): the experts of each sparse layer split over the data-parallel ranks
of a stage. Its parity with transformers (loss, every gradient, the clipping norm, training steps with ZeRO-1 in fp32
and bf16) runs with the other layouts in tests/test_moe.py; here: a checkpoint resumes on another expert-parallel
size with its whole state, each rank reads only its own experts' bytes, the dispatch takes one host sync per layer
and micro-batch, and what cannot split is refused in one line."""
import glob
import os

import pytest
import torch

from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics, tensors_of
from tests.test_moe import demo_model_of, run_spec_of

EXACT = dict(abs=1e-6, rel=1e-5)  # fp32: the same sums over other ranks


@pytest.fixture(scope="module")
def dense_first_moe(demo_model, tmp_path_factory):
    """tests/test_moe.py's demo mixture of experts with its first two layers dense: on 2 stages, the first holds no
    expert (its ranks run none of the experts' collectives or groups)."""
    from tests.tiny_models import MOE_CONFIGS
    config = MOE_CONFIGS["qwen3_moe"]()
    config.mlp_only_layers = [0, 1]
    return demo_model_of(config, demo_model, tmp_path_factory.mktemp("dense_first_moe"))


def train(demo_model, model, tmp_path, out, expert_parallel, **extra):
    """model on 2 stages (2 decoder layers each) x 2 data-parallel ranks, ZeRO-1, clipping on, a checkpoint after
    every step, evaluated at the end (step 4): the trainer's output."""
    from tests.test_token_mean import MICRO_BATCH, SEED, SEQ, write_skewed_instructions
    train_file = tmp_path / "train.jsonl"
    if not train_file.exists():
        write_skewed_instructions(demo_model, train_file)
    return check_ok(launch_trainer(4, demo_overrides(demo_model, out, **{
        "model_name_or_path": model["ds"], "train_file": str(train_file), "eval_file": str(train_file),
        "eval_steps": 0,
        "data.format": "instruction", "data.cache_dir": str(tmp_path / "cache"), "seq_length": SEQ,
        "micro_batch_size": MICRO_BATCH, "num_stages": 2, "gradient_accumulation_steps": 2, "zero_stage": 1,
        "max_steps": 4, "logging_steps": 1, "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0,
        "max_grad_norm": 0.05, "seed": SEED, "save_steps": 1, "save_total_limit": 10, "export_hf": "false",
        "partition": "[2,2]",
        "expert_parallel_size": expert_parallel, **extra})))


def saved_state(tag_dir):
    """{file: {key: tensor}} of a checkpoint's layer files: the weights and the optimizer's master weights and
    moments, every expert whole."""
    return {os.path.basename(path): tensors_of(torch.load(path, map_location="cpu", weights_only=True))
            for path in sorted(glob.glob(os.path.join(tag_dir, "layer_*.pt")))}


@pytest.mark.slow
def test_resume_on_another_expert_parallel_size_holds_the_whole_state(demo_model, dense_first_moe, tmp_path):
    """Experts split over 2 ranks, then whole on each (from step 2), then split again (from step 3), a stage without
    experts beside one with: the losses and the final evaluation are the run's that never changed, clipped alike,
    and so is every checkpoint's every weight, master weight and Adam moment."""
    split = tmp_path / "ep2"
    train(demo_model, dense_first_moe, tmp_path, split, 2)
    whole = tmp_path / "ep1"
    result = train(demo_model, dense_first_moe, tmp_path, whole, 1, resume=str(split / "global_step2"))
    assert "with another layout (expert_parallel 2 -> 1)" in result.stdout
    again = tmp_path / "ep2_again"
    result = train(demo_model, dense_first_moe, tmp_path, again, 2, resume=str(whole / "global_step3"))
    assert "with another layout (expert_parallel 1 -> 2)" in result.stdout
    losses = per_step_losses(split)
    assert per_step_losses(whole) == pytest.approx(losses[2:], **EXACT)
    assert per_step_losses(again) == pytest.approx(losses[3:], **EXACT)
    evaluated = [[r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r] for out in (split, whole, again)]
    assert evaluated[1] == pytest.approx(evaluated[0], **EXACT) and evaluated[2] == pytest.approx(evaluated[0], **EXACT)
    assert len(evaluated[0]) == 1
    for resumed, step in ((whole, 3), (whole, 4), (again, 4)):
        theirs, ours = saved_state(split / f"global_step{step}"), saved_state(resumed / f"global_step{step}")
        assert ours.keys() == theirs.keys() and any("optim_states" in name for name in ours)
        for name, tensors in theirs.items():
            assert ours[name].keys() == tensors.keys(), name
            for key, tensor in tensors.items():
                assert torch.allclose(ours[name][key], tensor, **dict(atol=1e-6, rtol=1e-5)), (resumed, name, key)
    experts = saved_state(split / "global_step4")["layer_03-model_states.pt"]["/mlp.experts.gate_up_proj"]
    assert experts.shape[0] == 8  # every expert in the file, though each rank held 4


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_a_rank_reads_only_its_own_experts_bytes(tmp_path, monkeypatch, family):
    """A sparse layer's file holds every expert; loaded on rank 1 of expert parallelism 2, it reads the layer's
    other tensors whole and half of each expert tensor (its experts' rows, by pread straight into the parameter):
    exactly those bytes, no more."""
    from checkpoints import layer_files
    from models.architecture import architecture_of
    from models.expert_parallel import ExpertParallel
    from models.attention import StageAttentionInputs
    from models.pipeline_layers import DecoderLayerPipe, StagePlan
    from tests.tiny_models import MOE_CONFIGS
    config = MOE_CONFIGS[family]()
    inputs, layer_index = StageAttentionInputs(config), architecture_of(config).sparse_layers.index(True)
    torch.manual_seed(0)
    whole = DecoderLayerPipe(config, inputs, layer_index=layer_index).state_dict()
    torch.save(whole, tmp_path / "layer_01-model_states.pt")
    mine = DecoderLayerPipe(config, inputs, layer_index, StagePlan(experts=ExpertParallel(size=2, rank=1)))
    reads = []
    read_exactly = layer_files.read_exactly
    monkeypatch.setattr(layer_files, "read_exactly", lambda fd, buffer, offset: reads.append(buffer.nbytes) or
                        read_exactly(fd, buffer, offset))
    layer_files.load_layer_slice(mine, [str(tmp_path / "layer_01-model_states.pt")], 0, 1)
    experts = {key for key in whole if ".experts." in key}
    assert experts and all(mine.state_dict()[key].shape[0] * 2 == whole[key].shape[0] for key in experts)
    for key, tensor in mine.state_dict().items():
        expected = whole[key][tensor.shape[0]:] if key in experts else whole[key]
        assert torch.equal(tensor, expected), key
    expert_bytes = sum(whole[key].nbytes for key in experts)
    assert sum(reads) == sum(tensor.nbytes for tensor in whole.values()) - expert_bytes // 2


@pytest.mark.parametrize("model,overrides,world_size,message", [
    ("qwen3_moe", ["expert_parallel_size=3"], 4,
     r"^expert_parallel_size=3 does not divide the 2 data-parallel ranks of a stage: launch a multiple of 3 "
     r"data-parallel replicas or set expert_parallel_size to a divisor of 2\.$"),
    ("qwen2_moe", ["expert_parallel_size=8", "num_stages=1"], 8,
     r"^expert_parallel_size=8 does not divide the model's 4 experts per layer: set expert_parallel_size to a "
     r"divisor of 4 \(and of the 8 data-parallel ranks\)\.$"),
    ("llama", ["expert_parallel_size=2"], 4,
     r"^expert_parallel_size=2 splits the experts of a mixture of experts, and this model has none; set "
     r"expert_parallel_size=1\.$"),
    ("qwen3_moe", ["expert_parallel_size=2", "zero_stage=1", "offload_optimizer=cpu"], 4,
     r"^offload_optimizer=cpu with expert_parallel_size=2: not tested with experts split across ranks yet; use "
     r"offload_optimizer=none or expert_parallel_size=1 \(docs/moe\.md\)\.$"),
    ("qwen3_moe", ["expert_parallel_size=2", "nan_policy=skip"], 4, r"^nan_policy=skip with expert_parallel_size=2: "),
    ("qwen3_moe", ["expert_parallel_size=2", "lora.rank=4"], 4,
     r"^lora\.rank=4 with expert_parallel_size=2: not tested with experts split across ranks yet; train without LoRA "
     r"\(lora\.rank=0\) or expert_parallel_size=1 \(docs/moe\.md\)\.$"),
    ("qwen3_moe", ["expert_parallel_size=0"], 4, r"^expert_parallel_size=0 must be at least 1"),
], ids=["data_parallel", "experts", "dense_model", "offload", "nan_skip", "lora", "zero"])
def test_an_expert_parallel_size_that_cannot_split_is_refused_in_one_line(demo_model, tiny_moe_checkpoints, tmp_path,
                                                                          model, overrides, world_size, message):
    """Before any process group exists or any weight is read."""
    from errors import ConfigError
    model_dir = demo_model["ds"] if model == "llama" else tiny_moe_checkpoints[model][1]
    with pytest.raises(ConfigError, match=message):
        run_spec_of(demo_model, model_dir, tmp_path, "num_stages=2", *overrides, world_size=world_size)


def test_the_plan_counts_each_ranks_slice_of_the_experts(capsys):
    """Qwen3-30B-A3B's shipped plan (8 stages x 2 data-parallel, ZeRO-1) with its experts split over the 2: each
    decoder stage holds half its experts' weights and gradients, and the same optimizer state (ZeRO-1 shards a
    slice over the ranks holding it: 1 of them, where every expert was sharded over 2)."""
    from models.architecture import architecture_of
    from models.partition import expert_parameters
    from planner.memory_plan import print_memory_plan
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec
    whole = print_memory_plan(plan_spec(run_config("qwen3_30b_a3b")))
    spec = plan_spec(run_config("qwen3_30b_a3b", "expert_parallel_size=2"))
    split = print_memory_plan(spec)
    assert "data-parallel 2 (experts split over 2)" in capsys.readouterr().out
    config = spec.model_config
    experts = architecture_of(config).moe.num_experts * expert_parameters(architecture_of(config).moe,
                                                                          config.hidden_size)
    for before, after in zip(whole, split):
        halved = before["decoder_layers"] * experts // 2  # its decoder layers' experts, half of each
        assert halved and before["parameters"] - after["parameters"] == pytest.approx(halved, rel=0.01)
        assert before["weights_bytes"] - after["weights_bytes"] == pytest.approx(2 * halved, rel=0.01)  # bf16
        assert before["optimizer_bytes"] == after["optimizer_bytes"]


@pytest.mark.slow
def test_the_all_to_all_dispatch_equals_every_expert_on_every_rank(tmp_path):
    """Outputs and every gradient of the all-to-all dispatch equal LocalExperts' with the whole layer (the experts'
    gradients summed over the ranks: each rank's tokens reach both halves), a rank that receives no row included."""
    import json

    from tests.distributed import spawn
    from tests.expert_parallel_worker import dispatch_against_local_experts
    spawn(dispatch_against_local_experts, 2, str(tmp_path))
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 4
        for case, differences in results.items():
            assert max(differences) < 1e-6, (rank, case, differences)
