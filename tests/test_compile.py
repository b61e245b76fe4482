"""compile=true (every layer through torch.compile, PipelineModule.compile) keeps losses and gradients equal to
transformers' (real processes; each compiles its stage on first use), under 1F1B and under the zero-bubble schedule
(whose deferrable linear layers run outside the compiled graphs)."""
import glob
import json

import pytest

from tests import parity_worker
from tests.distributed import spawn

MICRO_BATCH, GAS, SEQ = 2, 2, 16


@pytest.mark.parametrize("checkpoint_interval,schedule", [(0, "1f1b"), (1, "1f1b"), (1, "zero_bubble")],
                         ids=["plain", "activation_checkpointing", "activation_checkpointing_zero_bubble"])
def test_compiled_layers_keep_parity(tiny_checkpoints, tmp_path, checkpoint_interval, schedule):
    hf_dir, ds_dir = tiny_checkpoints["llama3"]
    cases = [dict(name="llama3", hf_dir=hf_dir, ds_dir=ds_dir, compile=True, checkpoint_interval=checkpoint_interval,
                  schedule=schedule)]
    spawn(parity_worker.run, 2, cases, 2, MICRO_BATCH, GAS, SEQ, str(tmp_path))
    results = [json.load(open(path))["llama3"] for path in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(results) == 2
    for result in results:
        assert result["mean_loss"] == pytest.approx(sum(result["ref_losses"]) / GAS, abs=1e-5)
        if result["stage"] == 1:
            assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
        assert max(result["grad_errors"].values()) < 1e-4
        if schedule == "zero_bubble":  # every projection's weight gradient, and the LM head's, came from a W
            names = result["param_names"]
            expected = {n for n in names if "_proj." in n} | ({names[-1]} if result["stage"] == 1 else set())
            assert result["deferred_weights"] == sorted(expected) and expected
