"""Run trainer_pipe.py through DeepSpeed's real launcher, as a user would."""
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.distributed import free_port


def launch_trainer(num_procs, overrides, config="tiny", timeout=240, hostfile=None, script="trainer_pipe.py",
                   env=None):
    """Run `deepspeed --num_gpus N trainer_pipe.py -cp conf -cn CONFIG overrides...`; returns CompletedProcess.
    With a hostfile, launch as on a cluster; on one machine without ssh (README, multi-node)."""
    placement = (["--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1"] if hostfile
                 else ["--num_gpus", str(num_procs)])
    command = [sys.executable, "-m", "deepspeed.launcher.runner", *placement, "--master_port", str(free_port()),
               # Hydra resolves a relative -cp against the script that calls hydra.main; another script needs it absolute.
               script, "-cp", "conf" if script == "trainer_pipe.py" else os.path.join(ROOT, "conf"), "-cn", config,
               *overrides]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
