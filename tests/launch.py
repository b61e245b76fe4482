"""Run trainer_pipe.py through DeepSpeed's real launcher, as a user would."""
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.distributed import free_port


def launch_trainer(num_procs, overrides, config="tiny", timeout=240, launcher_args=()):
    """Run `deepspeed --num_gpus N trainer_pipe.py -cp conf -cn CONFIG overrides...`; returns CompletedProcess."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner", *launcher_args, "--num_gpus", str(num_procs),
               "--master_port", str(free_port()), "trainer_pipe.py", "-cp", "conf", "-cn", config, *overrides]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
