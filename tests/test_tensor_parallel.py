"""Tensor parallelism inside stages: loss and gradient parity with transformers (real processes, gloo)."""
import glob
import json

import pytest

from tests import parity_worker
from tests.distributed import spawn
from tests.test_parity import GAS, MICRO_BATCH, SEQ, own_layer_files

TP_CONFIGS = ("llama3", "tied")  # grouped-query attention; embedding tied to the LM head
VARIANTS = {  # case suffix: tensor-parallel options
    "": {"sequence_parallel": False},
    "+sp": {"sequence_parallel": True},
    "+sp+recompute": {"sequence_parallel": True, "recompute_sequence_gather": True},
}


@pytest.mark.parametrize("num_stages,world_size", [(1, 2), (2, 4)], ids=["tp2", "2stages_x_tp2"])
def test_loss_and_gradients_match_transformers(tiny_checkpoints, tmp_path, num_stages, world_size):
    cases = [dict(name=name + suffix, hf_dir=tiny_checkpoints[name][0], ds_dir=tiny_checkpoints[name][1], **options)
             for name in TP_CONFIGS for suffix, options in VARIANTS.items()]
    spawn(parity_worker.run, world_size, cases, num_stages, MICRO_BATCH, GAS, SEQ, str(tmp_path), 2)
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(ranks) == world_size
    for case in cases:
        name = case["name"]
        for rank in ranks:
            result = rank[name]
            ref = result["ref_losses"]
            assert result["mean_loss"] == pytest.approx(sum(ref) / len(ref), abs=1e-5), name
            if result["stage"] == num_stages - 1:
                assert result["losses"] == pytest.approx(ref, abs=1e-5), name
            bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
            assert not bad, f"{name}: gradients differ from transformers: {bad}"
            # Norms are whole on every rank of the group and must stay identical there.
            assert result["replicated_grad_spread"] == 0.0, name
            assert set(result["layer_files_opened"]) == own_layer_files(case["ds_dir"], result), name
        assert set().union(*(r[name]["grad_errors"] for r in ranks)) == set(ranks[0][name]["ref_param_names"])
