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


# --- many processes ------------------------------------------------------------------------------------------------

LAYOUTS = {  # name: (stages, world size, tensor parallel, {case suffix: options})
    "1stage": (1, 1, 1, {"": {}}),
    "2stages": (2, 2, 1, {"": {}}),
    "4stages": (4, 4, 1, {"": {}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_gradients_equal_transformers_across_processes(tiny_hybrid_checkpoints, tmp_path, layout):
    """One launch per layout runs every hybrid, its layer pattern split across the stages wherever the partition
    falls: the per-micro-batch losses (padded rows) and every gradient after the reductions equal transformers';
    each rank reads only its stage's layer files."""
    from tests.test_moe import assert_parity_across_processes
    num_stages, world_size, tensor_parallel, variants = LAYOUTS[layout]
    cases = [dict(name=family + suffix, hf_dir=hf, ds_dir=ds, **options)
             for suffix, options in variants.items() for family, (hf, ds) in tiny_hybrid_checkpoints.items()]
    assert_parity_across_processes(cases, tmp_path, num_stages, world_size, tensor_parallel)


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
def test_training_steps_equal_transformers(demo_model, demo_hybrids, tmp_path, family, layout):
    """Six steps of the trainer on instruction data (padded rows), clipping active: the logged loss and the step-1
    gradient norm are those of transformers + torch AdamW on the same global batches (2 x 2: ZeRO-1)."""
    from tests.test_moe import MAX_GRAD_NORM, trained_and_transformers
    records, losses, norms, _ = trained_and_transformers(demo_model, demo_hybrids[family], tmp_path, layout)
    assert min(norms) > MAX_GRAD_NORM  # clipping acts on every step
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-4, rel=0)
    assert records[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-4)
