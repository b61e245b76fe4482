"""Expert parallelism (models/expert_parallel.py): the experts of each sparse layer split over the data-parallel ranks
of a stage. Its parity with transformers (loss, every gradient, the clipping norm, training steps with ZeRO-1 in fp32
and bf16) runs with the other layouts in tests/test_moe.py; here: a checkpoint resumes on another expert-parallel
size with its whole state, twice as many replicas as expert-parallel ranks train, save, resume and export as one
replica does, a save holds at most one shard of the experts above the resident state, each rank reads only its own
experts' bytes, the dispatch equals every expert on every rank, and what cannot split is refused in one line."""
import glob
import json
import os
import re

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


def train(demo_model, model, tmp_path, out, expert_parallel, procs=4, script="trainer_pipe.py", **extra):
    """model on 2 stages (2 decoder layers each) x 2 data-parallel ranks (or as `extra` says, on `procs` ranks),
    ZeRO-1, clipping on, a checkpoint after every step, evaluated at the end (step 4): the output of the trainer
    (or of `script`, run as it)."""
    from tests.test_token_mean import MICRO_BATCH, SEED, SEQ, write_skewed_instructions
    train_file = tmp_path / "train.jsonl"
    if not train_file.exists():
        write_skewed_instructions(demo_model, train_file)
    return check_ok(launch_trainer(procs, script=script, overrides=demo_overrides(demo_model, out, **{
        "model_name_or_path": model["ds"], "train_file": str(train_file), "eval_file": str(train_file),
        "eval_steps": 0,
        "data.format": "instruction", "data.cache_dir": str(tmp_path / "cache"), "seq_length": SEQ,
        "micro_batch_size": MICRO_BATCH, "num_stages": 2, "gradient_accumulation_steps": 2, "zero_stage": 1,
        "max_steps": 4, "logging_steps": 1, "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0,
        "max_grad_norm": 0.05, "seed": SEED, "save_steps": 1, "save_total_limit": 10, "export_hf": "false",
        "partition": "[2,2]",
        "expert_parallel_size": expert_parallel, **extra})))


def saved_state(tag_dir):
    """{(layer, model_states | optim_states): {key: tensor}} of a checkpoint's layer files: the weights and the
    optimizer's master weights and moments, whole: an expert shard's rows joined to the others' in shard order
    (whatever expert-parallel size saved them), a tensor-parallel rank's slice to the others' along its split."""
    from transformers import AutoConfig

    from checkpoints.ds_to_hf import split_dims_of
    from models.lora import NO_LORA
    paths = sorted(glob.glob(os.path.join(tag_dir, "layer_*.pt")))
    slices = max([int(m.group(1)) + 1 for p in paths if (m := re.search(r"-model_(\d+)-", p))], default=1)
    split_dims = split_dims_of(AutoConfig.from_pretrained(tag_dir), slices, NO_LORA) if slices > 1 else {}
    state = {}
    for path in paths:
        name = os.path.basename(path)
        layer = name.split("-")[0]
        entry = state.setdefault((layer, name.rsplit("-", 1)[1]), {})
        for key, tensor in tensors_of(torch.load(path, map_location="cpu", weights_only=True)).items():
            dim = split_dims.get(int(layer.removeprefix("layer_")), {}).get(key.rsplit("/", 1)[1]) or 0
            entry[key] = torch.cat([entry[key], tensor], dim) if key in entry else tensor
    return state


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
        assert ours.keys() == theirs.keys() and any(kind == "optim_states.pt" for _, kind in ours)
        for name, tensors in theirs.items():
            assert ours[name].keys() == tensors.keys(), name
            for key, tensor in tensors.items():
                assert torch.allclose(ours[name][key], tensor, **dict(atol=1e-6, rtol=1e-5)), (resumed, name, key)
    # each rank wrote its own 4 of the 8 experts, weights and optimizer state, and the layer file holds the rest
    for kind, key in (("model", "/mlp.experts.gate_up_proj"), ("optim", "/fp32/mlp.experts.gate_up_proj")):
        shards = [tensors_of(torch.load(split / "global_step4" / f"layer_03-experts_0{shard}-of-02-{kind}_states.pt",
                                        weights_only=True)) for shard in range(2)]
        assert [shard[key].shape[0] for shard in shards] == [4, 4]
        layer = tensors_of(torch.load(split / "global_step4" / f"layer_03-{kind}_states.pt", weights_only=True))
        assert layer and not any(".experts." in name for name in layer)
    assert not glob.glob(str(whole / "global_step4" / "*experts_*"))  # experts whole on each rank: in the layer file


@pytest.fixture(scope="module")
def sparse_moe(demo_model, tmp_path_factory):
    """tests/test_moe.py's demo mixture of experts (Qwen3-MoE, layer 1 dense, the load-balancing loss on): on 2
    stages of 2 decoder layers each holds experts."""
    from tests.tiny_models import MOE_CONFIGS
    return demo_model_of(MOE_CONFIGS["qwen3_moe"](), demo_model, tmp_path_factory.mktemp("sparse_moe"))


def assert_export_holds(hf_dir, tag_dir):
    """The Hugging Face export of a checkpoint holds its weights' bytes: each tensor the one the layer files and
    expert shards hold, an expert's projection its rows of the fused tensor."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from models.layout import expert_piece, layer_of_hf_name
    config = AutoConfig.from_pretrained(hf_dir)
    saved = {layer: tensors for (layer, kind), tensors in saved_state(tag_dir).items() if kind == "model_states.pt"}
    exported = {k: v for path in glob.glob(os.path.join(hf_dir, "*.safetensors")) for k, v in load_file(path).items()}
    assert len(exported) > len(saved)
    for name, tensor in exported.items():
        fused, piece, parts = expert_piece(name, config) or (name, None, None)
        index, key = layer_of_hf_name(fused, config.num_hidden_layers, config.tie_word_embeddings)
        source = saved[f"layer_{index:02d}"][f"/{key}"]
        source = source if piece is None else source[piece // parts].chunk(parts)[piece % parts]
        assert tensor.dtype == source.dtype and torch.equal(tensor, source), name


# name: (the layout: its stages, partition and precision; what its checkpoint resumes on: ranks, expert-parallel
# size, stages; None: not resumed). In bf16 DeepSpeed all-reduces the replicas' fp32 gradient sums in bf16 unless told otherwise (its
# communication_data_type): 2 replicas or 4 then round them differently (seen: losses 1.1e-4 apart by step 3,
# gradient norms 8e-4); reduced in fp32 they are the same sums as in fp32. Another expert-parallel size is another
# bf16 sum (an expert's weight gradient over 4 ranks' tokens in one bf16 GEMM, not 2 GEMMs summed in fp32): bf16
# resumes on another data-parallel size.
REPLICAS = {
    "1stage": (dict(num_stages=1, partition="[4]"), dict(procs=4, expert_parallel=4)),
    "2stages": (dict(num_stages=2, partition="[2,2]"), dict(procs=2, expert_parallel=2, num_stages=1, partition="[4]")),
    "bf16_1stage": ({"num_stages": 1, "partition": "[4]", "precision": "bf16",
                     "+deepspeed.communication_data_type": "fp32"}, dict(procs=2, expert_parallel=2)),
    # tensor parallel 2 beside: its rank 0 writes the experts' shards and every replicated tensor, once (its
    # checkpoint's every tensor against the reference's; the expert shards read on another layout: the cases above,
    # a tensor-parallel checkpoint's slices: tests/test_resume.py). Its reference is 1stage's, without tensor
    # parallelism: in fp32 the split heads and MLP make the same numbers within 1e-6 (seen: 5.7e-7 after 4 steps)
    "tp2_1stage": (dict(num_stages=1, partition="[4]", tensor_parallel_size=2), None),
}


@pytest.fixture(scope="module")
def replica_references(demo_model, sparse_moe, tmp_path_factory):
    """reference(settings): the output directory of data parallel = expert parallel 2 on a layout's stages, without
    its tensor parallelism, trained once for every case that compares against it."""
    runs = {}

    def reference(settings):
        untensored = {key: value for key, value in settings.items() if key != "tensor_parallel_size"}
        key = json.dumps(untensored, sort_keys=True)
        if key not in runs:
            root = tmp_path_factory.mktemp("replica_reference")
            runs[key] = root / "dp_ep"
            train(demo_model, sparse_moe, root, runs[key], 2, procs=2 * untensored["num_stages"],
                  gradient_accumulation_steps=4, **untensored)
        return runs[key]
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("layout", REPLICAS)
def test_twice_as_many_replicas_as_expert_parallel_ranks_equal_one_replica(demo_model, sparse_moe, replica_references,
                                                                         tmp_path, layout):
    """Data parallel 2 x expert parallel 2 (4 ranks a stage: each slice of the experts on 2 replicas, which ZeRO-1
    partitions its optimizer state over and all-reduces its gradients over) against data parallel = expert parallel
    on the same global batches (one sequence a micro-batch, twice the micro-batches a rank), clipping active, the
    load-balancing loss on: every step's loss and gradient norm, the evaluation, and every checkpoint's weights,
    master weights and moments within 1e-6; its export holds its checkpoint's bytes; and its step-2 checkpoint (but
    the tensor-parallel layout's), resumed on another expert-parallel size (4: half of each saved shard a rank) or on
    another stage count and data-parallel size, makes the reference's steps 3 and 4."""
    layout, resumed_on = REPLICAS[layout]
    settings, stages = dict(layout, micro_batch_size=1), layout["num_stages"]
    ranks_a_replica = stages * layout.get("tensor_parallel_size", 1)
    replicas, resumed = (tmp_path / name for name in ("dp_2ep", "resumed"))
    reference = replica_references(settings)
    output = train(demo_model, sparse_moe, tmp_path, replicas, 2, procs=4 * ranks_a_replica,
                   gradient_accumulation_steps=2, export_hf="true",
                   **{**settings, "moe.rank_load_warning": 1.0001}).stdout
    if resumed_on:
        resumed_on = dict(resumed_on)
        procs, expert_parallel = resumed_on.pop("procs"), resumed_on.pop("expert_parallel")
        settings_resumed = {**settings, **resumed_on}
        data_parallel = procs // (settings_resumed["num_stages"] * settings_resumed.get("tensor_parallel_size", 1))
        result = train(demo_model, sparse_moe, tmp_path, resumed, expert_parallel, procs=procs,
                       gradient_accumulation_steps=8 // data_parallel, resume=str(replicas / "global_step2"),
                       **settings_resumed)
        assert f"expert_parallel 2 -> {expert_parallel}" in result.stdout or \
            f"data_parallel 4 -> {data_parallel}" in result.stdout
    runs = {replicas: 0, **({resumed: 2} if resumed_on else {})}  # each run's first step: the reference's index
    records = {out: [r for r in read_metrics(out) if "loss" in r] for out in (reference, *runs)}
    assert [r["step"] for r in records[replicas]] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "aux_loss"):
        expected = [r[key] for r in records[reference]]
        for out, first in runs.items():
            assert [r[key] for r in records[out]] == pytest.approx(expected[first:], **EXACT), (out, key)
    assert min(r["grad_norm"] for r in records[reference]) > 0.05  # clipping acts on every step
    # each sparse layer's busiest expert-parallel rank against a rank's mean (the same counts summed over replicas)
    loads = [{key: value for key, value in r.items() if key.startswith("expert_rank_load/")} for r in records[replicas]]
    assert loads == [{key: r[key] for key in load} for r, load in zip(records[reference], loads)]
    assert all(set(load) == {f"expert_rank_load/layer_{i}" for i in (0, 2, 3)} for load in loads)
    assert "an expert-parallel rank received more than moe.rank_load_warning=1.0001 times" in output
    evaluated = {out: [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r] for out in (reference, *runs)}
    assert len(evaluated[reference]) == 1
    for out, first in runs.items():
        assert evaluated[out] == pytest.approx(evaluated[reference], **EXACT), out
        for step in range(first + 1, 5):
            theirs, ours = saved_state(reference / f"global_step{step}"), saved_state(out / f"global_step{step}")
            assert ours.keys() == theirs.keys()
            for name, tensors in theirs.items():
                assert ours[name].keys() == tensors.keys(), name
                for key, tensor in tensors.items():
                    assert torch.allclose(ours[name][key].float(), tensor.float(), atol=1e-6, rtol=1e-5), \
                        (out, step, name, key)
    assert_export_holds(str(replicas / "hf"), replicas / "global_step4")


@pytest.fixture(scope="module")
def wide_experts(demo_model, tmp_path_factory):
    """The demo Qwen3-MoE with experts 8192 wide: a sparse layer's experts 6.3M parameters, ~8 in 10 of the model."""
    from tests.tiny_models import MOE_CONFIGS
    config = MOE_CONFIGS["qwen3_moe"]()
    config.moe_intermediate_size = 8192
    return demo_model_of(config, demo_model, tmp_path_factory.mktemp("wide_experts"))


@pytest.mark.slow
def test_a_save_takes_at_most_one_shard_above_the_resident_state(demo_model, wide_experts, tmp_path):
    """One stage, its experts split over both ranks (ZeRO-1, fp32), saved after a step: on every rank the peak
    resident set of the save (tests/save_memory_probe.py) is at most the largest file it writes above the resident
    state, beside the checksum's one reused read buffer; that file is one shard of a layer's experts' optimizer
    state, so no rank held a layer's experts whole, which would have taken 2 shards (4 ranks would show the same, at
    twice the launch). The plan's host memory of a save (planner/training_state.py save_host_bytes) is that file's
    bytes."""
    from transformers import AutoConfig

    from checkpoints.integrity import CHUNK_BYTES
    from models.partition import layer_kinds
    from planner.stage_costs import LayerCosts
    from planner.workload import Workload
    ranks = 2
    costs = LayerCosts(AutoConfig.from_pretrained(wide_experts["hf"]), Workload(
        precision="fp32", data_parallel=ranks, expert_parallel=ranks))
    planned = costs.stage_save_bytes(layer_kinds(costs.config))[1]
    out, slack = tmp_path / "run", 2 << 20  # pickling, the engine's small files: seen under 0.5 MiB
    train(demo_model, wide_experts, tmp_path, out, ranks, procs=ranks, num_stages=1, partition="[4]",
          gradient_accumulation_steps=1, max_steps=1, async_save="false",
          script=os.path.join("tests", "save_memory_probe.py"))
    for rank in range(ranks):
        (save,) = json.loads((out / f"save_memory_rank{rank}.json").read_text())
        largest = max(save["files"], key=save["files"].get)
        shard = save["files"][largest]
        assert re.fullmatch(rf"layer_0[1-4]-experts_0{rank}-of-0{ranks}-optim_states\.pt", largest), save["files"]
        assert save["peak"] - save["resident"] <= shard + CHUNK_BYTES + slack, (rank, save)
        assert planned == shard
        assert shard * ranks > shard + CHUNK_BYTES + slack  # a layer's experts whole on a rank would be seen


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


@pytest.mark.slow
def test_replicated_expert_gradients_sum_alike_when_a_rank_routes_no_row(tmp_path):
    """Under tensor parallelism (sequence parallel) with expert parallelism a rank's experts may receive no row in
    a micro-batch: their gradients (zeros, laid out as the parameter) are summed with a peer's from the grouped
    GEMM (the transposed layout of its backward) into the same sums on both ranks, each the two ranks' own."""
    from tests.distributed import spawn
    from tests.expert_parallel_worker import replicated_expert_grads_when_a_rank_routes_no_row
    spawn(replicated_expert_grads_when_a_rank_routes_no_row, 2, str(tmp_path))
    for rank in range(2):
        differences = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(differences) == {"gate_up_proj", "down_proj"} and max(differences.values()) == 0.0, (rank,
                                                                                                        differences)


@pytest.mark.slow
def test_a_checkpointed_sparse_layer_keeps_its_dispatch_for_backward(tmp_path):
    """Under both of DeepSpeed's activation checkpointing functions, a sparse layer whose block keeps its dispatch
    (models/expert_parallel.py keeping_dispatch, as the pipeline checkpoints under expert parallelism) runs 2
    all-to-alls in backward (its exchanges' reverses) and no host sync, where recomputing the dispatch runs 6 and
    syncs once, and keeping its routing alone (moe.checkpoint_keeps_rows=false) 4 and none; outputs and every
    gradient bit-identical to the layer run without checkpointing. Forward: the counts, the tokens with their
    choices, the rows back."""
    from tests.distributed import spawn
    from tests.expert_parallel_worker import checkpointed_dispatch_exchanges
    from models.architecture import architecture_of
    from planner.decoder_costs import DecoderCosts
    from planner.workload import Workload
    from tests.tiny_models import MOE_CONFIGS
    spawn(checkpointed_dispatch_exchanges, 2, str(tmp_path))
    config = MOE_CONFIGS["qwen3_moe"]()
    planned = DecoderCosts(config, Workload(seq_length=12, micro_batch_size=2, precision="fp32", expert_parallel=2),
                           architecture_of(config).sparse_layers.index(True)).checkpoint_kept_bytes
    kept = [json.loads((tmp_path / f"rank{rank}.json").read_text()).pop("kept bytes") for rank in range(2)]
    # The plan counts both kept tensors as a balanced share of the T x k choices: the rows back are exactly that,
    # and the two ranks' received tokens (one per token and destination) at most that.
    assert [back for _, back in kept] == [planned // 2] * 2 and 0 < sum(rows for rows, _ in kept) <= planned
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        results.pop("kept bytes")
        assert results == {"plain": [4, 2, 0, 0.0], "reentrant": [4, 6, 1, 0.0], "non-reentrant": [4, 6, 1, 0.0],
                           "reentrant, its routing kept": [4, 4, 0, 0.0],
                           "non-reentrant, its routing kept": [4, 4, 0, 0.0],
                           "reentrant kept": [4, 2, 0, 0.0], "non-reentrant kept": [4, 2, 0, 0.0]}, (rank, results)
