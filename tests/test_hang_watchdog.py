"""What a person reads when a rank dies or hangs: the hang watchdog's limits beat the collectives' timeout, its line
stands on a line of its own and names what the rank actually waits on (on NCCL too, whose waits do not block the
host), and the supervisor names the rank that failed first, not one that only saw its peer's death."""
import json
import os

import pytest

from resilience.rank_records import RECORDS_DIR
from resilience.supervisor import explain_failure
from tests.launch import demo_overrides, process_environment, run_ranks, script_command

FAULT_SCRIPT = os.path.join("tests", "fault_injection.py")


def read_rank_records(output_dir):
    directory = output_dir / RECORDS_DIR
    return [json.loads((directory / name).read_text()) for name in sorted(os.listdir(directory))]


@pytest.mark.slow
def test_a_rank_that_saw_its_peers_death_in_a_posted_receive_is_not_named_first(demo_model, tmp_path):
    """zero_bubble, whose second stage posts its receives of activations and waits for them later: rank 0 is
    SIGKILLed at step 3; rank 1's wait fails on gloo's closed connection: its record says it failed in
    communication, so the supervisor's line names the killed rank, not rank 1, as the cause."""
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, num_stages=2, gradient_accumulation_steps=4, max_steps=6,
                               save_steps=0, eval_file="null", pipeline_schedule="zero_bubble")
    ranks = run_ranks(2, script_command(FAULT_SCRIPT, "tiny", overrides),
                      process_environment("cpu", {"FAULT": "sigkill:0:3"}), timeout=240, kill_peers=False)
    assert ranks[0].returncode == -9 and ranks[1].returncode == 1, ranks[1].stderr[-3000:]
    killed, peer = read_rank_records(out)
    assert "ended" not in killed  # without a word
    assert peer["exit_code"] == 1 and "gloo" in peer["cause"] and peer["in_communication"], peer
    line = explain_failure(247, [killed, peer])
    assert "first failed" not in line and line.startswith("exit code 247: killed by SIGKILL; rank 0 on "), line
