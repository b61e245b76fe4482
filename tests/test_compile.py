"""compile=true (every layer through torch.compile, PipelineModule.compile) keeps losses and gradients equal to
transformers' (real processes; each compiles its stage on first use)."""
import glob
import json

import pytest

from tests import parity_worker
from tests.distributed import spawn

MICRO_BATCH, GAS, SEQ = 2, 2, 16


@pytest.mark.parametrize("checkpoint_interval", [0, 1], ids=["plain", "activation_checkpointing"])
def test_compiled_layers_keep_parity(tiny_checkpoints, tmp_path, checkpoint_interval):
    hf_dir, ds_dir = tiny_checkpoints["llama3"]
    cases = [dict(name="llama3", hf_dir=hf_dir, ds_dir=ds_dir, compile=True, checkpoint_interval=checkpoint_interval)]
    spawn(parity_worker.run, 2, cases, 2, MICRO_BATCH, GAS, SEQ, str(tmp_path))
    results = [json.load(open(path))["llama3"] for path in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(results) == 2
    for result in results:
        assert result["mean_loss"] == pytest.approx(sum(result["ref_losses"]) / GAS, abs=1e-5)
        if result["stage"] == 1:
            assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
        assert max(result["grad_errors"].values()) < 1e-4
