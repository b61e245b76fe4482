"""The DeepSeek-V3 line end to end (deepseek_v3 with and without the query latent, glm4_moe): multi-head latent
attention or GLM-4.5's attention, DeepSeek-V3's router with its correction bias, shared experts and dense first
layers equal transformers, the loss and every gradient, in one process and across processes (2 and 4 stages, data
and tensor parallelism, padded rows); six training steps equal a transformers + torch AdamW loop; the hub's
checkpoints convert both ways bit for bit."""
import pytest
from transformers import AutoModelForCausalLM

from checkpoints.ds_to_hf import convert_ds_to_hf
from models.architecture import architecture_of
from tests.test_conversion import assert_bit_identical, load_hf_weights
from tests.test_moe import (MAX_GRAD_NORM, assert_parity_across_processes, demo_model_of, pipeline_in_one_process,
                            trained_and_transformers)
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


LAYOUTS = {  # name: (stages, world size, tensor parallel, {case suffix: options})
    "2stages": (2, 2, 1, {"": {}}),
    "4stages": (4, 4, 1, {"": {}}),
    "2stages_x_2dp": (2, 4, 1, {"": {}, "+ep2": {"expert_parallel": 2}}),  # and the experts split over the 2
    "2stages_x_tp2": (2, 4, 2, {"+sp": {}, "": {"sequence_parallel": False}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_gradients_equal_transformers_across_processes(tiny_deepseek_checkpoints, tmp_path, layout):
    """One launch per layout runs every family: the per-micro-batch losses (padded rows) and every gradient after
    the data-parallel and tensor-parallel reductions, against transformers; the latent projections', routers' and
    experts' gradients the same on every rank of a tensor-parallel group; each rank reads only its stage's files."""
    num_stages, world_size, tensor_parallel, variants = LAYOUTS[layout]
    cases = [dict(name=family + suffix, hf_dir=hf, ds_dir=ds, **options)
             for suffix, options in variants.items() for family, (hf, ds) in tiny_deepseek_checkpoints.items()]
    assert_parity_across_processes(cases, tmp_path, num_stages, world_size, tensor_parallel)


@pytest.fixture(scope="module")
def demo_deepseek(demo_model, tmp_path_factory):
    """The tiny DeepSeek-V3 (query latent, YaRN, groups, shared expert, dense first layer) over the demo model's
    tokenizer: {hf, ds}."""
    return demo_model_of(DEEPSEEK_CONFIGS["deepseek_v3"](), demo_model, tmp_path_factory.mktemp("demo_deepseek"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1_process", "2stages_x_2dp"])
def test_training_steps_equal_transformers(demo_model, demo_deepseek, tmp_path, layout):
    """Six steps on instruction data (padded rows), clipping active, the correction bias frozen (as transformers):
    the logged loss and the step-1 gradient norm are transformers'; each sparse layer's expert load is logged."""
    records, losses, norms, _ = trained_and_transformers(demo_model, demo_deepseek, tmp_path, layout)
    assert min(norms) > MAX_GRAD_NORM  # clipping acts on every step
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-5, rel=0)
    assert records[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-4)
    assert all(r[f"expert_load/layer_{i}"] >= 1.0 for r in records for i in (1, 2, 3))
    assert all("expert_load/layer_0" not in r for r in records)  # first_k_dense_replace=1
