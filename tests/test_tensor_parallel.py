"""Tensor parallelism inside stages (real processes, gloo): loss and gradient parity with transformers, checkpoint
and export round trips, the same-batch check, config errors, and training parity through the launcher."""
import glob
import json
import os

import pytest
import torch
from transformers import AutoConfig

from checkpoints.layer_files import load_layer_slice
from models.layout import layer_indices_with_files
from tests import parity_worker
from tests.distributed import spawn
from tests.launch import (SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, lm_eval_overrides, per_step_losses,
                          read_metrics, run_in_process)
from tests.test_lm_eval import assert_loop_equals_lm_eval
from tests.test_parity import GAS, MICRO_BATCH, SEQ, assert_rank_equals_transformers

TP_CONFIGS = ("llama3", "tied", "qwen2")  # grouped-query attention; embedding tied to the LM head; q/k/v biases
VARIANTS = {  # case suffix: tensor-parallel options
    "": {"sequence_parallel": False},
    "+sp": {"sequence_parallel": True},
    "+sp+recompute": {"sequence_parallel": True, "recompute_sequence_gather": True},
    "+sp+recompute+checkpointing": {"sequence_parallel": True, "recompute_sequence_gather": True,
                                    "checkpoint_interval": 1},
}
# The other families, each where its layer differs under tensor parallelism: Qwen3's per-head norms (gradient summed
# over the group) and OLMo 2's whole-projection norms (mean of squares over the group) with and without sequence
# parallelism; the rest under the trainer's default. On 1 stage: a family's layers split over the group the same way on
# any stage, its stage split is test_parity.py's test_loss_gradients_and_file_reads (every family on 2 and 4 stages),
# and TP_CONFIGS carry 2 stages x tensor parallel 2 (the tied embedding across stages included).
FAMILY_CASES = {"qwen3": ("", "+sp"), "olmo2": ("", "+sp"), "granite": ("+sp",), "smollm3": ("+sp",),
                "phi3": ("+sp",), "mistral": ("+sp",)}


@pytest.mark.slow
@pytest.mark.parametrize("num_stages,world_size", [(1, 2), (2, 4)], ids=["tp2", "2stages_x_tp2"])
def test_loss_and_gradients_match_transformers(tiny_checkpoints, tmp_path, num_stages, world_size):
    families = FAMILY_CASES if num_stages == 1 else {}
    variants = {**{name: VARIANTS for name in TP_CONFIGS},
                **{name: {suffix: VARIANTS[suffix] for suffix in suffixes} for name, suffixes in families.items()}}
    cases = [dict(name=name + suffix, hf_dir=tiny_checkpoints[name][0], ds_dir=tiny_checkpoints[name][1], **options)
             for name, name_variants in variants.items() for suffix, options in name_variants.items()]
    spawn(parity_worker.run, world_size, cases, num_stages, MICRO_BATCH, GAS, SEQ, str(tmp_path), 2)
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(ranks) == world_size
    for case in cases:
        name = case["name"]
        for rank in ranks:
            result = rank[name]
            assert_rank_equals_transformers(result, name, num_stages, case["ds_dir"])
            # Norms are whole on every rank of the group and must stay identical there.
            assert result["replicated_grad_spread"] == 0.0, name
        assert set().union(*(r[name]["grad_errors"] for r in ranks)) == set(ranks[0][name]["ref_param_names"])


def save_and_export_worker(rank, hf_dir, ds_dir, out_dir):
    """One of 2 tensor-parallel ranks: load the converted model, save a checkpoint (one file per rank and layer),
    load it back over zeroed weights, (rank 0) export it to Hugging Face, then load it into 2 stages at T=1."""
    import deepspeed
    import torch
    from transformers import AutoConfig

    from checkpoints.ds_to_hf import convert_ds_to_hf
    from checkpoints.files import copy_model_side_files, read_latest
    from models.pipeline import build_pipeline_module
    from cluster.distributed import init_distributed, parallel_topology

    init_distributed(timeout_minutes=2)
    module = build_pipeline_module(AutoConfig.from_pretrained(hf_dir), parallel_topology(1, 2),
                                   layer_loader=load_layer_slice)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
    engine.load_checkpoint(ds_dir, load_module_only=True)
    loaded = {n: p.detach().clone() for n, p in module.named_parameters()}
    ckpt = os.path.join(out_dir, "ckpt")
    engine.save_checkpoint(ckpt, tag="tp2")
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    engine.load_checkpoint(ckpt, tag="tp2", load_module_only=True)
    reloaded = all(torch.equal(p, loaded[n]) for n, p in module.named_parameters())
    with open(os.path.join(out_dir, f"reloaded{rank}.json"), "w") as f:
        json.dump(reloaded, f)
    torch.distributed.barrier()
    if rank == 0:
        copy_model_side_files(hf_dir, ckpt)
        convert_ds_to_hf(ckpt, os.path.join(out_dir, "hf"), tag="tp2")
    # The same checkpoint read by 2 stages without tensor parallelism (resume_weights_only after changing T): each
    # rank's layers are merged from the saved slices and must equal the converted whole-layer files.
    stages = build_pipeline_module(AutoConfig.from_pretrained(hf_dir), parallel_topology(2, 1),
                                   layer_loader=load_layer_slice)
    stages.load_state_dir(os.path.join(ckpt, "tp2"), checkpoint_engine=None)
    converted = os.path.join(ds_dir, read_latest(ds_dir))
    merged = {}
    for local_index, layer in enumerate(stages.forward_funcs):
        if hasattr(layer, "state_dict"):
            index = int(stages._local_start) + local_index
            whole = torch.load(os.path.join(converted, f"layer_{index:02d}-model_states.pt"))
            merged[index] = sorted(whole) == sorted(layer.state_dict()) and all(
                torch.equal(whole[k], v) for k, v in layer.state_dict().items())
    with open(os.path.join(out_dir, f"merged{rank}.json"), "w") as f:
        json.dump(merged, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # both leave the group together: no rank exits mid-collective


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_CONFIGS + ("phi3",))  # Phi-3: the fused weights rebuilt from per-rank slices
def test_save_reload_and_export_are_bit_identical(tiny_checkpoints, tmp_path, name):
    from safetensors.torch import load_file

    hf_dir, ds_dir = tiny_checkpoints[name]
    spawn(save_and_export_worker, 2, hf_dir, ds_dir, str(tmp_path))
    tag_dir = tmp_path / "ckpt" / "tp2"
    assert (tag_dir / "layer_01-model_00-model_states.pt").is_file()
    assert (tag_dir / "layer_01-model_01-model_states.pt").is_file()
    assert not (tag_dir / "layer_01-model_states.pt").exists()
    assert all(json.load(open(tmp_path / f"reloaded{rank}.json")) for rank in range(2))
    merged = {k: v for rank in range(2) for k, v in json.load(open(tmp_path / f"merged{rank}.json")).items()}
    config = AutoConfig.from_pretrained(hf_dir)
    assert merged == {str(i): True for i in layer_indices_with_files(config.num_hidden_layers,
                                                                     config.tie_word_embeddings)}, merged
    original = {k: v for p in glob.glob(os.path.join(hf_dir, "*.safetensors")) for k, v in load_file(p).items()}
    exported = {k: v for p in glob.glob(str(tmp_path / "hf" / "*.safetensors")) for k, v in load_file(p).items()}
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key


def test_slices_of_another_model_are_refused(tmp_path):
    for rank in range(2):
        torch.save({"weight": torch.zeros(3, 2)}, tmp_path / f"layer_01-model_0{rank}-model_states.pt")
    paths = sorted(str(p) for p in tmp_path.iterdir())
    message = (r"weight in .*layer_01-model_00-model_states.pt: 2 saved slices of shape \(3, 2\) do not make 4 "
               r"slices of shape \(2, 2\); the checkpoint is of another model")
    with pytest.raises(ValueError, match=message):
        load_layer_slice(torch.nn.Linear(2, 2, bias=False), paths, rank=0, size=4)


def test_replicated_tensors_are_read_from_rank_0s_file(tmp_path):
    """A tensor-parallel checkpoint holds a replicated tensor (a norm) in rank 0's file only, and older ones in every
    rank's: either loads on each rank, and on another tensor-parallel size."""
    class Layer(torch.nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.weight, self.norm = torch.nn.Parameter(torch.zeros(rows, 2)), torch.nn.Parameter(torch.zeros(3))
            self.weight.tensor_parallel_dim = 0

    weight, norm = torch.arange(8.0).view(4, 2), torch.tensor([1.0, 2.0, 3.0])
    for layout, replicated_in in (("once", [0]), ("every_rank", [0, 1])):
        for rank in range(2):
            torch.save({"weight": weight[2 * rank:2 * rank + 2], **({"norm": norm} if rank in replicated_in else {})},
                       tmp_path / f"{layout}-model_0{rank}-model_states.pt")
        paths = sorted(str(p) for p in tmp_path.glob(f"{layout}-*"))
        for rank, size, rows in ((0, 2, 2), (1, 2, 2), (0, 1, 4)):
            layer = Layer(rows)
            load_layer_slice(layer, paths, rank=rank, size=size)
            assert torch.equal(layer.weight, weight[rank * rows:(rank + 1) * rows]), (layout, rank, size)
            assert torch.equal(layer.norm, norm), (layout, rank, size)


def test_the_pad_tokens_embedding_row_takes_no_gradient():
    """As transformers builds the embedding (nn.Embedding with padding_idx=config.pad_token_id), over two
    micro-batches holding the pad token as a real token: the first's gradient dense, the second's added row by row
    (models/weight_grads.py). Under tensor parallel 2 the row is the second rank's (50 - 48); the full layouts'
    gradients against transformers are the parity tests', whose llama3 and tied models have a pad token in the data."""
    from models.pipeline_layers import EmbeddingPipe
    from models.tensor_parallel import TensorParallel
    from tests.tiny_models import TINY_CONFIGS

    config = TINY_CONFIGS["llama3"]()
    torch.manual_seed(0)
    ours = EmbeddingPipe(config)
    theirs = torch.nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
    theirs.weight.data.copy_(ours.weight.data.normal_())
    ids = torch.tensor([[5, 50, 7, 50], [50, 1, 2, 5]])
    for micro_batch in (ids, ids.flip(1)):
        ours((micro_batch, None, None))[0].pow(2).sum().backward()
        theirs(micro_batch).pow(2).sum().backward()
    assert not ours.weight.grad[50].any() and ours.weight.grad[5].any()
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=0, atol=1e-6)
    assert [EmbeddingPipe(config, TensorParallel(2, rank)).padding_idx for rank in (0, 1)] == [None, 2]


def different_batches_worker(rank, out_dir):
    """The same-batch check on identical micro-batches, then on micro-batches that differ by rank."""
    import torch.distributed as dist

    from data.loader import check_identical_across_group
    from cluster.distributed import init_distributed

    init_distributed(timeout_minutes=1)
    group = dist.new_group([0, 1])
    for case, offset, per_check in (("same", 0, 1), ("different", rank, 1), ("different_in_a_step", rank, 3)):
        ids = torch.arange(8).reshape(2, 4) + offset
        batches = [((ids, torch.ones_like(ids), ids), ids)] * 3
        try:
            message = f"passed {len(list(check_identical_across_group(iter(batches), group, per_check)))}"
        except ValueError as error:
            message = str(error)
        with open(os.path.join(out_dir, f"{case}{rank}.txt"), "w") as f:
            f.write(message)
    dist.barrier()  # no rank leaves while its peer is still in a collective (gloo aborts the process then)
    dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_ranks_must_see_the_same_batch(tmp_path):
    spawn(different_batches_worker, 2, str(tmp_path))
    for rank in range(2):
        assert (tmp_path / f"same{rank}.txt").read_text() == "passed 3"
        message = (tmp_path / f"different{rank}.txt").read_text()
        assert message.startswith("tensor-parallel ranks [0, 1] received different micro-batches (micro-batch 0")
        assert "seed it by the data-parallel rank" in message
        # checked once per step (the training loop's), the step's micro-batches named
        assert "(micro-batch 0 to 2 of this run)" in (tmp_path / f"different_in_a_step{rank}.txt").read_text()


@pytest.mark.parametrize("overrides,world_size,message", [
    ({"num_stages": 2, "tensor_parallel_size": 2}, 2,
     "num_stages=2 x tensor_parallel_size=2 does not divide the world size 2"),
    ({"num_stages": 1, "tensor_parallel_size": 3}, 3,
     r"tensor_parallel_size=3 does not divide num_attention_heads=4, num_key_value_heads=2, micro_batch_size x "
     r"seq_length=128; choose a tensor_parallel_size that divides them \(or set sequence_parallel=false\)."),
    ({"num_stages": 1, "tensor_parallel_size": 2, "seq_length": 63, "micro_batch_size": 1}, 2,
     r"tensor_parallel_size=2 does not divide micro_batch_size x seq_length=63; choose a tensor_parallel_size that "
     r"divides it \(or set sequence_parallel=false\)."),
], ids=["world", "heads", "tokens"])
def test_bad_tensor_parallel_config_is_refused_before_any_work(demo_model, tmp_path, overrides, world_size, message):
    with pytest.raises(ValueError, match=message):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), world_size)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_training_parity_resume_and_export(demo_model, demo_tasks, single_process_run, tmp_path):
    """8 fp32 steps of 2 stages x tensor parallel 2 against 1 process on the same global batch, and the same eval
    loss after them; the step-4 checkpoint resumes without tensor parallelism, optimizer included, as the run that
    never stopped; the exported model is the merged final checkpoint; the lm-eval tasks it scores at its last step
    equal lm-eval's on that checkpoint's export."""
    parallel = tmp_path / "2x2tp"
    check_ok(launch_trainer(4, demo_overrides(demo_model, parallel, **dict(
        SINGLE_PROCESS, num_stages=2, tensor_parallel_size=2, save_steps=4, export_hf="true",
        **lm_eval_overrides(demo_tasks)))))
    assert_loop_equals_lm_eval(parallel, demo_tasks, tmp_path / "lm_eval")
    losses = per_step_losses(parallel)
    assert len(losses) == 8 and losses == pytest.approx(per_step_losses(single_process_run), abs=1e-4)
    # The clipping norm (above max_grad_norm here, so clipping acts) counts the norms' replicated weights once.
    norms = {run: [r["grad_norm"] for r in read_metrics(run) if "loss" in r] for run in (single_process_run, parallel)}
    assert min(norms[single_process_run]) > 1.0
    assert norms[parallel] == pytest.approx(norms[single_process_run], rel=1e-5)
    (evaluation,) = [r["eval_loss"] for r in read_metrics(parallel) if "eval_loss" in r]
    (reference,) = [r["eval_loss"] for r in read_metrics(single_process_run) if "eval_loss" in r]
    assert evaluation == pytest.approx(reference, abs=1e-4)
    assert json.load(open(parallel / "global_step4" / "trainer_state.json"))["topology"] == {
        "num_stages": 2, "data_parallel": 1, "tensor_parallel": 2, "stage_bounds": [0, 3, 7]}

    # One process without tensor parallelism resumes the whole state (weights and optimizer state merged from the
    # slices): steps 5-8 as the tensor-parallel run's, up to fp32 reduction order.
    merged = tmp_path / "merged"
    check_ok(launch_trainer(1, demo_overrides(demo_model, merged, **dict(
        SINGLE_PROCESS, eval_file="null", resume=str(parallel / "global_step4")))))
    assert per_step_losses(merged) == pytest.approx(losses[4:], abs=1e-5, rel=0)

    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(parallel / "hf")
    tag = parallel / "global_step8"
    head = torch.cat([torch.load(tag / f"layer_06-model_0{r}-model_states.pt")["weight"] for r in range(2)])
    down = torch.cat([torch.load(tag / f"layer_02-model_0{r}-model_states.pt")["mlp.down_proj.weight"]
                      for r in range(2)], dim=1)
    assert torch.equal(exported.lm_head.weight, head)
    assert torch.equal(exported.model.layers[1].mlp.down_proj.weight, down)
    assert not torch.equal(head, AutoModelForCausalLM.from_pretrained(demo_model["hf"]).lm_head.weight)
