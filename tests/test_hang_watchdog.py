"""What a person reads when a rank dies or hangs: the hang watchdog's limits beat the collectives' timeout, its line
stands on a line of its own and names what the rank actually waits on (on NCCL too, whose waits do not block the
host), and the supervisor names the rank that failed first, not one that only saw its peer's death."""
import json
import os

import pytest

from cluster.distributed import flight_recorder_environment
from resilience.exit_codes import HUNG
from resilience.rank_records import RECORDS_DIR
from resilience.supervisor import explain_failure
from tests.distributed import free_port
from tests.launch import demo_overrides, process_environment, run_python, run_ranks, script_command

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


# A rank of stage 1 on a stand-in for NCCL (world size 1, gloo for the process group): its receive of micro-batch 1's
# activations is queued on the device and returns on the host at once, the device waiting there for a peer that
# never sends; the host runs on to the optimizer step, where reading the gradient norm waits for the device. The
# trainer's progress bar is mid-line on stderr. The collectives' timeout is 3 s (dist_timeout_minutes=0.05), the
# step's limit 100 s.
NCCL_STAND_IN = """
import sys, time
from types import SimpleNamespace
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from tqdm import tqdm
from resilience import hang_watchdog
from resilience.rank_records import start_record

out = sys.argv[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{out}/store")


class Stream:
    waiting = False  # for a peer's send, from the receive on

    def mark(self):  # an event queued now: passed once the device has run what was queued before it
        passed = not self.waiting
        return SimpleNamespace(query=lambda: passed)


stream = Stream()
hang_watchdog.device_mark = stream.mark


def receive(engine, buffer_id):
    stream.waiting = True


class Engine:
    _INSTRUCTION_MAP = {schedule.RecvActivation: receive, schedule.ForwardPass: lambda engine, buffer_id: None,
                        schedule.OptimizerStep: lambda engine: time.sleep(60)}
    stage_id, global_steps = 1, 0
    grid = SimpleNamespace(get_data_parallel_id=lambda: 0, stage_to_global=lambda stage: stage + 1)

    def train_batch(self):
        self._INSTRUCTION_MAP[schedule.RecvActivation](self, buffer_id=0)
        self._INSTRUCTION_MAP[schedule.ForwardPass](self, buffer_id=0)
        self._INSTRUCTION_MAP[schedule.OptimizerStep](self)

    def eval_batch(self):
        pass


tqdm(total=10, initial=1, desc="train").refresh()
engine = Engine()
settings = SimpleNamespace(step_time_factor=10, min_step_seconds=100, startup_seconds=100)
hang_watchdog.HangWatchdog(settings, out, engine, total_steps=10, record=start_record(out, 0),
                           dist_timeout_minutes=0.05)
engine.train_batch()
"""


@pytest.mark.slow
def test_the_watchdog_names_what_the_device_waits_on_before_the_collectives_timeout(tmp_path):
    """On the stand-in for NCCL the watchdog ends the rank within the collectives' 3 s (one instruction's limit, 0.9 x
    that), well before the step's 100 s, and names the receive the device waits on and its peer, not the optimizer
    step where the host waits: in one line of its own, below the progress bar, and in the rank's record."""
    result = run_python(["-c", NCCL_STAND_IN, tmp_path], timeout=60)
    assert result.returncode == HUNG, result.stderr[-3000:]
    line = (f"hang watchdog: rank 0 (stage 1, data-parallel 0) hung in RecvActivation of micro-batch 1 at step 1 (on "
            f"the device; the host waits in OptimizerStep), waiting for rank 1: no progress for 2s (limit 2s: one "
            f"pipeline instruction, 0.9 x dist_timeout_minutes=0.05: a collective's timeout would end the rank without "
            f"a word); every thread's stack: {tmp_path}/hang/rank00000-stacks.txt; exiting 70 for a restart")
    assert line in result.stderr.splitlines(), result.stderr[-3000:]
    record = json.loads((tmp_path / RECORDS_DIR / "rank00000.json").read_text())
    assert (record["exit_code"], record["cause"], record["waiting_for"]) == (HUNG, line, 1)
    assert record["where"] == ("in RecvActivation of micro-batch 1 at step 1 (on the device; the host waits in "
                               "OptimizerStep)")


@pytest.mark.slow
def test_a_rank_start_sets_no_deprecated_flight_recorder_name(tmp_path):
    """torch 2.13 warns at every process group's start when TORCH_NCCL_TRACE_BUFFER_SIZE is set (TORCH_FR_BUFFER_SIZE
    from torch 2.8 on): a rank's start through the trainer's init does not set it."""
    start = ("import os, torch; from cluster.distributed import init_distributed; init_distributed(1); "
             "torch.distributed.all_reduce(torch.zeros(1)); print(sorted(k for k in os.environ if 'TORCH_NCCL' in k "
             "or 'TORCH_FR' in k))")
    result = run_python(["-c", start], env=dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                                MASTER_PORT=str(free_port())), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deprecated" not in result.stderr and result.stdout.splitlines()[-1] == "[]"


def test_nccls_flight_recorder_and_timeout_dump_use_the_names_the_installed_torch_reads():
    """Set before the process group starts on CUDA: the buffer, the dump on a collective's timeout and its file in
    the run's output directory; torch 2.8 renamed two of them; a name already set, either one, is left as it is."""
    dump_dir = "/runs/a/hang"
    assert flight_recorder_environment(dump_dir, {}, "2.13.0+cu130") == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/hang/nccl_timeout_trace_rank_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert flight_recorder_environment(dump_dir, {}, "2.5.1") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/a/hang/nccl_timeout_trace_rank_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert flight_recorder_environment(dump_dir, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                                                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/x"}, "2.13.0") == {}
