"""Loss and gradient parity with transformers, across stage counts and data parallelism (real processes)."""
import glob
import json
import os

import pytest

from models.layout import layer_file_name
from tests import parity_worker
from tests.distributed import spawn
from tests.tiny_models import TINY_CONFIGS

MICRO_BATCH, GAS, SEQ = 2, 2, 16


def run_parity(tiny_checkpoints, tmp_path, num_stages, world_size, attention="sdpa"):
    cases = [dict(name=name, hf_dir=hf, ds_dir=ds, attention=attention) for name, (hf, ds) in tiny_checkpoints.items()]
    spawn(parity_worker.run, world_size, cases, num_stages, MICRO_BATCH, GAS, SEQ, str(tmp_path))
    return [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank*.json")))]


@pytest.mark.parametrize("num_stages,world_size", [(1, 1), (2, 2), (4, 4), (2, 4)],
                         ids=["1stage", "2stages", "4stages", "2stages_x_2dp"])
@pytest.mark.slow
def test_loss_gradients_and_file_reads(tiny_checkpoints, tmp_path, num_stages, world_size):
    ranks = run_parity(tiny_checkpoints, tmp_path, num_stages, world_size)
    assert len(ranks) == world_size
    dp_size = world_size // num_stages
    for name in TINY_CONFIGS:
        for rank in ranks:
            result = rank[name]
            mine = [result["ref_losses"][step * dp_size + result["dp_rank"]] for step in range(GAS)]
            assert_rank_equals_transformers(result, name, num_stages, tiny_checkpoints[name][1], mine)
        # Every Hugging Face parameter (the tied LM head is the embedding) was compared on some rank.
        assert set().union(*(r[name]["grad_errors"] for r in ranks)) == set(ranks[0][name]["ref_param_names"])


def assert_rank_equals_transformers(result, name, num_stages, ds_dir, last_stage_losses=None):
    """One rank's parity record against transformers: the mean loss, the last stage's per-micro-batch losses (its
    data-parallel share of the reference's when given), every gradient it holds, and only its own layer files read."""
    ref = result["ref_losses"]
    assert result["mean_loss"] == pytest.approx(sum(ref) / len(ref), abs=1e-5), name
    if result["stage"] == num_stages - 1:
        assert result["losses"] == pytest.approx(ref if last_stage_losses is None else last_stage_losses,
                                                 abs=1e-5), name
    bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
    assert not bad, f"{name}: gradients differ from transformers: {bad}"
    assert set(result["layer_files_opened"]) == own_layer_files(ds_dir, result), name


def own_layer_files(ds_dir, result):
    """The layer files of this rank's stage (a tied LM head has none: the embedding's file holds it)."""
    tag_dir = os.path.join(ds_dir, "global_step0")
    start, stop = result["parts"][result["stage"]], result["parts"][result["stage"] + 1]
    return {layer_file_name(i) for i in range(start, stop) if os.path.exists(os.path.join(tag_dir, layer_file_name(i)))}


@pytest.mark.slow
def test_eager_attention_matches_transformers(tiny_checkpoints, tmp_path):
    (rank,) = run_parity(tiny_checkpoints, tmp_path, 1, 1, attention="eager")
    for name, result in rank.items():
        assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5), name
        assert max(result["grad_errors"].values()) < 1e-4, name


PARTITION_CASES = {  # name: (partition, activation checkpoint interval, expected stage bounds)
    "explicit+checkpointing": ([1, 3], 1, [0, 2, 7]),
    "uniform": ("uniform", 0, [0, 4, 7]),
    "type": ("type:decoderlayer", 2, [0, 3, 7]),
}


@pytest.mark.slow
def test_partition_methods_and_activation_checkpointing_keep_parity(tiny_checkpoints, tmp_path):
    hf_dir, ds_dir = tiny_checkpoints["tied"]
    cases = [dict(name=name, hf_dir=hf_dir, ds_dir=ds_dir, partition=partition, checkpoint_interval=interval)
             for name, (partition, interval, _) in PARTITION_CASES.items()]
    spawn(parity_worker.run, 2, cases, 2, MICRO_BATCH, GAS, SEQ, str(tmp_path))
    for path in sorted(glob.glob(str(tmp_path / "rank*.json"))):
        for name, result in json.load(open(path)).items():
            assert result["parts"] == PARTITION_CASES[name][2], name
            assert result["mean_loss"] == pytest.approx(sum(result["ref_losses"]) / GAS, abs=1e-5), name
            assert max(result["grad_errors"].values()) < 1e-4, name


@pytest.mark.parametrize("seq", [16, 48], ids=["short_factors", "long_factors"])
def test_phi3_longrope_partial_rotary_tables_equal_transformers(seq):
    """Phi-3's longrope (short factors up to original_max_position_embeddings, long ones past it) over a partial
    rotary dimension: the pipeline's cos/sin tables are transformers'."""
    import torch
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from models.rotary import RotaryEmbedding
    from tests.tiny_models import COMMON
    config = Phi3Config(**{**COMMON, "max_position_embeddings": 64}, original_max_position_embeddings=32,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0]})
    x, positions = torch.zeros(1, seq, 32), torch.arange(seq)[None]
    ours, theirs = RotaryEmbedding(config)(x, positions), Phi3RotaryEmbedding(config)(x, positions)
    assert ours[0].shape[-1] == 4  # half of head_dim 8
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
