"""Context parallelism (models/context_parallel.py) against transformers, on real processes (gloo): packed rows of
several documents with padding (attention masks) and full one-document rows (causal attention without a mask), the
token-weighted eval loss (evaluation/eval_set.py) and the training gradients for 1 stage x context 2 (x 2
replicas), 2 stages x context 2 (tied embeddings), context 2 x tensor parallel 2 (sequence parallel), context 4, and
2 stages x context 2 under the zero-bubble schedule with activation checkpointing, the other families' layers where
context parallelism meets what differs (Gemma 3's and Gemma 4's own layers: sliding windows across the ranks'
chunks, shared keys and values, per-layer embeddings), in one launch of 4 processes;
training parity through the launcher; config errors before any process group."""
import itertools
import json
import random

import pytest

from models.context_parallel import context_parallel_error
from tests.distributed import ProcessGroupPool, spawn
from tests.parity_worker import CHUNK_TOKENS
from tests.launch import (SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, lm_eval_overrides, per_step_losses,
                          read_metrics)
from tests.test_lm_eval import assert_loop_equals_lm_eval
from tests.launch import run_in_process
from tests.test_packing import EVAL_ROWS, hf_reference, packed_rows, recording_engine

SEQ, MICRO_BATCH, GAS = 32, 2, 2
CASES = {  # name: (tiny model, stages, tensor parallel, context parallel, options)
    "1stage_x_cp2_x_2replicas": ("llama3", 1, 1, 2, {}),
    "2stages_x_cp2_tied": ("tied", 2, 1, 2, {}),
    "cp2_x_tp2_sp": ("qwen2", 1, 2, 2, {}),
    "cp4_eager_logits": ("llama3", 1, 1, 4, {"attention_impl": "eager", "loss_chunk_tokens": 0}),
    "2stages_x_cp2_zero_bubble_checkpointing": ("llama3", 2, 1, 2, {"activation_checkpoint_interval": 1,
                                                                    "zero_bubble": True}),
    # The other families where context parallelism meets what differs (qwen2 above has sliding windows): OLMo 2's
    # norms under tensor parallelism, Granite's attention scale in the split causal kernel, SmolLM3's layers
    # without rotary embedding.
    "olmo2_cp2_x_tp2_sp": ("olmo2", 1, 2, 2, {}),
    "granite_cp2_x_2replicas": ("granite", 1, 1, 2, {}),
    "smollm3_2stages_x_cp2": ("smollm3", 2, 1, 2, {}),
    # Gemma's own layers (tests/tiny_models.py LAYER_TYPE_CONFIGS: a window of 4, so each chunk's first queries
    # reach the chunk before, on another rank or another zig-zag half): Gemma 3's query_pre_attn_scalar and tied
    # embedding across stages; Gemma 4 E2B's reusing layers on another stage than their sources and, under tensor x
    # context parallelism, each rank's heads of the shared keys and values and its tokens' per-layer inputs; Gemma
    # 4 31B's values that are its keys and its full layers' own head width and key/value head. Some on packed rows
    # only ("rows"): the full rows' unmasked path is Gemma 3's and the other families'.
    "gemma3_2stages_x_cp2": ("gemma3_text", 2, 1, 2, {}),
    "gemma4_e2b_2stages_x_cp2": ("gemma4_e2b", 2, 1, 2, {"rows": ("packed",)}),
    "gemma4_e2b_cp2_x_tp2_sp": ("gemma4_e2b", 1, 2, 2, {"rows": ("packed",)}),
    "gemma4_31b_cp4": ("gemma4_31b", 1, 1, 4, {"rows": ("packed",)}),
    # and the 26B-A4B's MoE block beside each dense MLP: each rank routes its own tokens
    "gemma4_26b_a4b_2stages_x_cp2": ("gemma4_26b_a4b", 2, 1, 2, {"rows": ("packed",)}),
}


def case_runs(datasets, cases):
    """(data, its rows, case name, case) for each case on each dataset it takes (its options' "rows"; all by
    default), in the order every rank runs them."""
    return [(data, rows, name, case)
            for (data, rows), (name, case) in itertools.product(datasets.items(), cases.items())
            if data in case[4].get("rows", datasets)]


def micro_batches(rows, replicas, replica, context):
    """This rank's tokens of micro-batch (step * replicas + replica) for each step."""
    from data.collator import collate_causal_lm
    from models.loss import split_micro_batch
    for step in range(GAS):
        start = (step * replicas + replica) * MICRO_BATCH
        yield split_micro_batch(context, collate_causal_lm(rows[start:start + MICRO_BATCH], SEQ, pad_id=0))


def context_parity_worker(rank, checkpoints, datasets, out_dir, cases=CASES):
    """Each case's eval loss, training loss and gradients on this rank, next to transformers' (hf_references)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig

    from checkpoints.layer_files import load_layer_slice
    from models.pipeline import build_pipeline_module
    from tests.parity_worker import gradient_errors
    from cluster.distributed import init_distributed, parallel_topology
    from evaluation.eval_set import evaluate
    from engines.pipeline_engine import use_zero_bubble

    init_distributed(timeout_minutes=2)
    references = torch.load(f"{out_dir}/references.pt", weights_only=True)
    results = {}
    for data, rows, name, (model, stages, tensor_parallel, context_parallel, options) in ProcessGroupPool().runs(
            case_runs(datasets, cases)):  # the cases' engines share their process groups
        hf_dir, ds_dir = checkpoints[model]
        config = AutoConfig.from_pretrained(hf_dir)
        module = build_pipeline_module(config, parallel_topology(stages, tensor_parallel), sequence_parallel=True,
                                       layer_loader=load_layer_slice, context_parallel_size=context_parallel,
                                       attention_impl=options.get("attention_impl", "sdpa"),
                                       activation_checkpoint_interval=options.get("activation_checkpoint_interval", 0),
                                       loss_chunk_tokens=options.get("loss_chunk_tokens", CHUNK_TOKENS),
                                       row_layout=data)  # "packed" rows, or "full" ones (no mask)
        engine, optimizer = recording_engine(module, ds_dir)
        if options.get("zero_bubble"):
            use_zero_bubble(engine)
        reads_data = engine.is_first_stage() or engine.is_last_stage()
        cfg = SimpleNamespace(micro_batch_size=MICRO_BATCH, seq_length=SEQ, gradient_accumulation_steps=GAS,
                              tensor_parallel_size=tensor_parallel)
        eval_loss, _ = evaluate(engine, rows if reads_data else None, len(rows), cfg, pad_id=0)
        replica, replicas = module.context.replica(engine.grid.data_parallel_id,
                                                   engine.grid.get_data_parallel_world_size())
        train_loss = float(engine.train_batch(micro_batches(rows, replicas, replica, module.context)))
        ref_loss, _, ref_grads, train_ref = references[f"{data}/{name}"]
        grad_errors = gradient_errors(module, optimizer.recorded, ref_grads, config.num_hidden_layers, engine)
        results[f"{data}/{name}"] = {"eval_loss": eval_loss, "ref_loss": ref_loss, "train_loss": train_loss,
                         "train_ref": train_ref, "grad_errors": grad_errors, "context_rank": module.context.rank}
        torch.distributed.barrier()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def hf_references(checkpoints, datasets, world_size, cases=CASES):
    """{data/case: transformers' eval loss, training objective and gradients (tests/test_packing.py hf_reference)}
    over the case's replicas' micro-batches, computed once here for all the ranks (and cases that share them)."""
    by_inputs, references = {}, {}
    for data, rows, name, (model, stages, tensor_parallel, context_parallel, _) in case_runs(datasets, cases):
        replicas = world_size // (stages * tensor_parallel * context_parallel)
        key = (data, model, replicas)
        if key not in by_inputs:
            by_inputs[key] = hf_reference(checkpoints[model][0], rows, GAS * replicas)
        references[f"{data}/{name}"] = by_inputs[key]
    return references


def packed_documents(tmp_path):
    rows, _ = packed_rows(tmp_path)  # rows of several documents first, padding in most
    assert any(len(r["lengths"]) > 2 for r in rows[:GAS * 2 * MICRO_BATCH])
    return rows[:EVAL_ROWS]


def full_rows():
    """Rows of SEQ tokens, one document each: every rank's halves attend causally with no mask."""
    rng = random.Random(1)
    rows = [[rng.randrange(96) for _ in range(SEQ)] for _ in range(2 * GAS * MICRO_BATCH)]
    return [{"input_ids": ids, "labels": ids, "lengths": [SEQ]} for ids in rows]


@pytest.mark.slow
def test_context_parallel_matches_transformers(tiny_checkpoints, tiny_layer_type_checkpoints, tmp_path):
    assert_context_parity({**tiny_checkpoints, **tiny_layer_type_checkpoints}, tmp_path, CASES)


def assert_context_parity(checkpoints, tmp_path, cases):
    """The cases (CASES' form) on 4 processes: each rank's eval loss, training loss and gradients against
    transformers' on each document alone, packed rows and full ones."""
    import torch
    datasets = {"packed": packed_documents(tmp_path), "full": full_rows()}
    torch.save(hf_references(checkpoints, datasets, 4, cases), tmp_path / "references.pt")
    spawn(context_parity_worker, 4, checkpoints, datasets, str(tmp_path), cases)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    for data, _, case, _ in case_runs(datasets, cases):
        name = f"{data}/{case}"
        assert {rank[name]["context_rank"] for rank in ranks} == set(range(cases[case][3])), name
        for result in (rank[name] for rank in ranks):
            assert result["eval_loss"] == pytest.approx(result["ref_loss"], abs=1e-5), name
            assert result["train_loss"] == pytest.approx(result["train_ref"], abs=1e-5), name
            bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
            assert not bad, f"{name}: gradients differ from transformers on each document alone: {bad}"


@pytest.mark.parametrize("size,window", [(2, 3), (4, 5), (2, None)], ids=["cp2_window3", "cp4_window5", "cp2_full"])
def test_each_half_attends_only_the_keys_its_window_reaches(size, window):
    """One process, each rank of the group in turn (its gather of the document ids given the whole row's, the only
    collective the masks take): each half's mask is the unsplit mask's rows of its chunk over the keys from its first
    query's reach (window - 1 before the chunk, on the chunks before it, whichever rank holds them) to the chunk's
    end, with nothing it drops allowed; attending over those keys alone equals the unsplit attention."""
    import torch

    from models.attention import document_causal_mask, within_window
    from models.attention_kernels import additive_mask, attend
    from models.context_parallel import ContextParallel
    seq = 8 * size
    whole = torch.tensor([[1] * 5 + [2] * (seq - 7) + [0] * 2, [3] * seq])  # packed and padded; one document
    unsplit = within_window(document_causal_mask(whole), window, whole)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, seq, 4, generator=gen) for _ in range(3))
    expected = attend(q, k, v, additive_mask(unsplit, q.dtype), "eager")
    for rank in range(size):
        context = ContextParallel(size, rank)
        context.gather_sequence = lambda x, dim: whole
        masks = context.attention_masks(context.local_tokens(whole), window)
        chunk = seq // (2 * size)
        for index, mask in zip(context.global_chunks(), masks):
            end = (index + 1) * chunk
            first_key = 0 if window is None else max(0, index * chunk - window + 1)
            assert mask.shape == (2, 1, chunk, end - first_key)
            rows = unsplit[:, :, index * chunk:end]
            assert torch.equal(mask, rows[..., first_key:end]) and not rows[..., :first_key].any()
        out = context.attend(lambda *args: attend(*args, "eager"), context.local_tokens(q, dim=2), k, v,
                             [additive_mask(mask, q.dtype) for mask in masks])
        torch.testing.assert_close(out, context.local_tokens(expected, dim=2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("processes,layout", [(2, {}), (8, {"num_stages": 2, "tensor_parallel_size": 2})],
                         ids=["1stage_x_cp2", "2stages_x_tp2_x_cp2"])
@pytest.mark.slow
def test_training_parity_with_context_parallel(demo_model, demo_tasks, single_process_run, tmp_path, processes,
                                               layout):
    """8 fp32 steps with context 2 through the launcher (1 stage; 2 stages x tensor parallel 2) against 1 process on
    the same global batch (the losses, the clipping norm, the samples counted for the data position) and the same
    eval loss after them; on 1 stage, the lm-eval tasks it scores at its last step equal lm-eval's on the export."""
    out = tmp_path / "cp2"
    scored = lm_eval_overrides(demo_tasks) if not layout else {}
    check_ok(launch_trainer(processes, demo_overrides(demo_model, out, **dict(SINGLE_PROCESS, context_parallel_size=2,
                                                                              **layout, **scored))))
    if scored:
        assert_loop_equals_lm_eval(out, demo_tasks, tmp_path / "lm_eval")
    losses = per_step_losses(out)
    assert len(losses) == 8 and losses == pytest.approx(per_step_losses(single_process_run), abs=1e-4)
    records = {run: [r for r in read_metrics(run) if "loss" in r] for run in (single_process_run, out)}
    assert min(r["grad_norm"] for r in records[single_process_run]) > 1.0  # clipping acts
    assert [r["grad_norm"] for r in records[out]] == pytest.approx(
        [r["grad_norm"] for r in records[single_process_run]], rel=1e-5)
    (evaluation,) = [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r]
    (reference,) = [r["eval_loss"] for r in read_metrics(single_process_run) if "eval_loss" in r]
    assert evaluation == pytest.approx(reference, abs=1e-5)
    state = json.load(open(out / "global_step8" / "trainer_state.json"))
    assert state["topology"]["context_parallel"] == 2 and state["topology"]["data_parallel"] == 1
    assert state["consumed_samples"] == 64


@pytest.mark.parametrize("overrides,world_size,message", [
    ({"context_parallel_size": 2, "seq_length": 66}, 2,
     r"seq_length=66 does not split over context_parallel_size=2: the zig-zag split cuts each sequence into 2 x 2 "
     r"equal chunks; set seq_length to a multiple of 4\."),
    ({"context_parallel_size": 2, "num_stages": 1}, 3,
     r"context_parallel_size=2 does not divide the 3 ranks each stage x tensor-parallel slot has"),
    ({"context_parallel_size": 0}, 2, r"context_parallel_size=0 must be at least 1\."),
], ids=["seq_length", "world_size", "zero"])
def test_bad_context_parallel_config_is_refused_before_any_work(demo_model, tmp_path, overrides, world_size, message):
    with pytest.raises(ValueError, match=message):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), world_size)
    assert not (tmp_path / "run").exists()
    assert context_parallel_error(1, 63, world_size) is None  # without the split any length goes


def test_plan_counts_the_context_split():
    """plan_only on the shipped 32k config: each rank's activations about halve with the split (the whole sequence's
    keys and values, the masks and the chunked loss's head weight gradient stay; the stage-boundary buffers halve
    too), ZeRO partitions over data x context, and only the split plan fits the 16 devices it names."""
    from planner.memory_plan import memory_plan, plan_fits, host_memory_plan
    from tests.test_memory_plan import run_config
    from training.run_spec import plan_spec

    plans = {}
    for size in (1, 2):
        # One partition for both (the split plan's), so that stages compare layer for layer.
        spec = plan_spec(run_config("llama3_70b_32k", f"context_parallel_size={size}", "partition=[10,10,10,10,10,10,10,10]"))
        rows = memory_plan(spec)
        plans[size] = (spec, rows, plan_fits(spec, rows, host_memory_plan(spec, rows)))
    (one, rows1, fits1), (two, rows2, fits2) = plans[1], plans[2]
    assert (one.data_parallel, two.data_parallel) == (2, 1) and not fits1 and fits2
    assert two.workload.gradient_reduction_ranks == one.workload.gradient_reduction_ranks == 2
    for row1, row2 in zip(rows1, rows2):
        assert row2["optimizer_bytes"] == row1["optimizer_bytes"]  # partitioned over the same 2 ranks
        assert 0.45 < row2["activation_full_bytes"] / row1["activation_full_bytes"] < 0.62
