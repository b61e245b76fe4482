"""The DeepSeek-V3 line end to end (deepseek_v3 with and without the query latent, glm4_moe): multi-head latent
attention or GLM-4.5's attention, DeepSeek-V3's router with its correction bias, shared experts and dense first
layers equal transformers, the loss and every gradient, in one process and across processes (2 and 4 stages, data
and tensor parallelism, padded rows); the trainer's evaluation on 2 and 4 stages; the hub's checkpoints convert both
ways bit for bit. Training steps against transformers, with the correction biases updated:
tests/test_deepseek_balancing.py."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints.ds_to_hf import convert_ds_to_hf
from models.architecture import architecture_of
from tests.test_conversion import assert_bit_identical, load_hf_weights
from tests.test_moe import assert_parity_across_processes, cases_of, pipeline_in_one_process
from tests.tiny_models import DEEPSEEK_CONFIGS, make_model

FAMILIES = list(DEEPSEEK_CONFIGS)


@pytest.mark.parametrize("chunk_tokens", [0, 7], ids=["logits", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_equal_transformers_in_one_process(tmp_path, family, chunk_tokens):
    """Every layer kind (dense first, sparse with shared experts) on a padded batch: the loss is transformers'
    outputs.loss (the cross-entropy: no load-balancing loss for these families) and every gradient its gradient, the
    routers' through their sigmoid scores."""
    config = DEEPSEEK_CONFIGS[family]()
    assert architecture_of(config).sparse_layers == (False, True, True, True)
    model = make_model(config, tmp_path)
    loss, grads, outputs, ref_grads = pipeline_in_one_process(config, model, chunk_tokens)
    assert outputs.aux_loss is None
    assert loss.item() == pytest.approx(outputs.loss.item(), abs=1e-6)
    errors = {name: ((grads[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in ref_grads.items()}
    assert max(errors.values()) < 1e-5, errors
    assert any(name.endswith("mlp.gate.weight") for name in errors)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trips_are_bit_identical_and_load_in_transformers(tiny_deepseek_checkpoints, tmp_path, family):
    """save_pretrained's layout (one tensor per expert, the router's correction bias, the shared experts), sharded:
    back bit for bit under the same names, loaded by transformers with no missing or unexpected key."""
    hf_dir, ds_dir = tiny_deepseek_checkpoints[family]
    convert_ds_to_hf(ds_dir, str(tmp_path / "out"), max_shard_size="20KB")
    original = load_hf_weights(hf_dir)
    assert any(name.endswith("e_score_correction_bias") for name in original)
    assert_bit_identical(original, load_hf_weights(str(tmp_path / "out")))
    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not any(info.values()), info


# name: (stages, world size, tensor parallel, {case suffix: options}). No 2-rank launch of 2 stages alone: its stages
# are those of 2 stages x 2 data-parallel.
LAYOUTS = {
    "4stages": (4, 4, 1, {"": {}}),
    "2stages_x_2dp": (2, 4, 1, {"": {}, "+ep2": {"expert_parallel": 2}}),  # and the experts split over the 2
    "2stages_x_tp2": (2, 4, 2, {"+sp": {}, "": {"sequence_parallel": False}}),
}
# Context 2 sharing a layout's launch, its group on the data axis: {layout: [(family, case suffix, options)]}. The
# sequence-wise balance loss (its per-sequence sums over the group's tokens) on, its reference the paper's definition
# on transformers' routers; the latent attention's gathered latent beside it.
CONTEXT_IN_LAUNCH = {"2stages_x_2dp": [("deepseek_v3", "+cp2+sequence_loss",
                                        {"context_parallel": 2, "sequence_aux_loss_coef": 0.5})]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_gradients_equal_transformers_across_processes(tiny_deepseek_checkpoints, tmp_path, layout):
    """One launch per layout runs every family: the per-micro-batch losses (padded rows) and every gradient after
    the data-parallel and tensor-parallel reductions, against transformers; the latent projections', routers' and
    experts' gradients the same on every rank of a tensor-parallel group; each rank reads only its stage's files.
    Context 2's cases (CONTEXT_IN_LAUNCH): the group's mean loss and every gradient those of transformers plus the
    sequence-wise balance loss on the whole rows."""
    num_stages, world_size, tensor_parallel, variants = LAYOUTS[layout]
    cases = [dict(name=family + suffix, hf_dir=hf, ds_dir=ds, **options)
             for suffix, options in variants.items() for family, (hf, ds) in tiny_deepseek_checkpoints.items()]
    cases += cases_of(tiny_deepseek_checkpoints, CONTEXT_IN_LAUNCH.get(layout, ()))
    assert_parity_across_processes(cases, tmp_path, num_stages, world_size, tensor_parallel)


EVAL_STAGES = (2, 4)  # on 4 processes: 2 stages x 2 data-parallel, 4 stages
EVAL_SEQ = 24


def eval_rows():
    """Eleven one-document rows of 5 to EVAL_SEQ tokens, every token labelled: each layout's last micro-batch on a
    replica is padded with an empty row (evaluation/eval_set.py), and every row but one with padding."""
    gen = torch.Generator().manual_seed(4)
    lengths = [EVAL_SEQ, *torch.randint(5, EVAL_SEQ, (10,), generator=gen).tolist()]
    return [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(1, 96, (n,), generator=gen).tolist() for n in lengths)]


def eval_worker(rank, cases, rows, out_dir):
    """cases: (name, ds_dir, stages) each: the trainer's evaluation (eval_batch) of rows on that layout."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from checkpoints.layer_files import load_layer_slice
    from cluster.distributed import init_distributed, parallel_topology
    from evaluation.eval_set import evaluate
    from models.pipeline import build_pipeline_module
    from tests.distributed import ProcessGroupPool
    from tests.parity_worker import CHUNK_TOKENS
    from tests.test_packing import recording_engine
    init_distributed(timeout_minutes=2)
    results = {}
    for name, ds_dir, stages in ProcessGroupPool().runs(cases):  # the engines share their process groups
        module = build_pipeline_module(AutoConfig.from_pretrained(ds_dir), parallel_topology(stages, 1),
                                       layer_loader=load_layer_slice, loss_chunk_tokens=CHUNK_TOKENS)
        engine, _ = recording_engine(module, ds_dir)
        reads_data = engine.is_first_stage() or engine.is_last_stage()
        cfg = SimpleNamespace(micro_batch_size=2, seq_length=EVAL_SEQ, gradient_accumulation_steps=2,
                              tensor_parallel_size=1)
        results[f"{name}/{stages}"] = evaluate(engine, rows if reads_data else None, len(rows), cfg, pad_id=0)[0]
        torch.distributed.barrier()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_eval_loss_equals_transformers_on_2_and_4_stages(tiny_deepseek_checkpoints, tmp_path):
    """The trainer's evaluation (each example once, token-weighted, through eval_batch) of every family on 2 stages
    x 2 data-parallel and on 4 stages: transformers' (fp32) loss over the same rows, each run alone, within 1e-5."""
    from tests.distributed import spawn
    from tests.test_packing import hf_loss_sum_and_count
    rows = eval_rows()
    cases = [(family, ds, stages) for family, (_, ds) in tiny_deepseek_checkpoints.items() for stages in EVAL_STAGES]
    spawn(eval_worker, 4, cases, rows, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    for family, (hf_dir, _) in tiny_deepseek_checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
        with torch.no_grad():
            sums, counts = zip(*(hf_loss_sum_and_count(model, row["input_ids"], row["labels"]) for row in rows))
        expected = (sum(sums) / sum(counts)).item()
        for stages in EVAL_STAGES:
            assert {rank[f"{family}/{stages}"] for rank in ranks} == {ranks[0][f"{family}/{stages}"]}  # every rank
            assert ranks[0][f"{family}/{stages}"] == pytest.approx(expected, abs=1e-5), (family, stages)
