"""The DeepSeek-V3 line end to end (deepseek_v3 with and without the query latent, glm4_moe): multi-head latent
attention or GLM-4.5's attention, DeepSeek-V3's router with its correction bias, shared experts and dense first
layers equal transformers, the loss and every gradient, in one process and across processes (2 and 4 stages, data
and tensor parallelism, padded rows); the hub's checkpoints convert both ways bit for bit. Training steps against
transformers, with the correction biases updated: tests/test_deepseek_balancing.py."""
import pytest
from transformers import AutoModelForCausalLM

from checkpoints.ds_to_hf import convert_ds_to_hf
from models.architecture import architecture_of
from tests.test_conversion import assert_bit_identical, load_hf_weights
from tests.test_moe import assert_parity_across_processes, pipeline_in_one_process
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
    "2stages_x_2dp": (2, 4, 1, {"": {}}),
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
