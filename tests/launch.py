"""Run trainer_pipe.py as a user would: its ranks as the processes DeepSpeed's launcher starts (through the launcher
itself where that is what a test is about), or (for checks that happen before any process group exists) in this
process with the same Hydra config."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tests.conftest import ROOT
from tests.distributed import free_port
from tests.rank_zygote import ForkedProcess

LAUNCHER_SITE = os.path.join(ROOT, "tests", "launcher_site")  # its sitecustomize.py: see process_environment


def launch_trainer(num_procs, overrides, config="tiny", timeout=240, hostfile=None, script="trainer_pipe.py",
                   env=None, accelerator="cpu", launcher=False):
    """Run trainer_pipe.py (or `script`) -cp conf -cn CONFIG overrides... on num_procs ranks of this machine; returns
    a CompletedProcess: the ranks' outputs in rank order, the first failing rank's exit code.

    Each rank starts as its own process with the environment DeepSpeed's launcher gives it, and the others are
    killed once one fails, as the launcher does: that skips the runner's and the launcher's own interpreters (~4.6 s
    a launch, on ~60 launches); on the CPU it is forked from the rank zygote (tests/rank_zygote.py), which skips the
    ranks' library imports too. With launcher=True or a hostfile it goes through `deepspeed --num_gpus N` (or
    `--hostfile`, as on a cluster: on one machine without ssh, README multi-node), as a user launches it (on the CPU
    the runner forked from the zygote, its launcher from it, which forks its ranks: tests/rank_zygote.py STARTERS).
    accelerator is DeepSpeed's (DS_ACCELERATOR): cpu, N gloo processes on this machine's cores; cuda, one process
    per GPU (NCCL)."""
    if launcher or hostfile:
        command, env = trainer_command(num_procs, overrides, config, hostfile, script, env, accelerator)
        return run_processes(command, [env], timeout)[0]  # on the CPU the runner too is forked from the zygote
    ranks = run_ranks(num_procs, script_command(script, config, overrides), process_environment(accelerator, env),
                      timeout)
    failed = [rank.returncode for rank in ranks if rank.returncode]
    code = next((c for c in failed if c != -signal.SIGKILL), failed[0] if failed else 0)  # not a peer it killed
    return subprocess.CompletedProcess(ranks[0].args, code, "".join(rank.stdout for rank in ranks),
                                       "".join(rank.stderr for rank in ranks))


def run_ranks(num_procs, command, env, timeout, kill_peers=True):
    """command on num_procs local ranks (the launcher's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_*); with
    kill_peers, the others are killed once one fails. One CompletedProcess per rank."""
    port = str(free_port())
    return run_processes(command, [dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(num_procs),
                                        LOCAL_SIZE=str(num_procs), CROSS_RANK="0", CROSS_SIZE="1",
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for rank in range(num_procs)],
                         timeout, kill_peers)


def run_python(args, timeout=300, env=None):
    """`python ARGS` from the repository root on the CPU (a project script and its arguments, or -c CODE), as a user
    runs it: its CompletedProcess."""
    return run_processes([sys.executable, *map(str, args)], [process_environment("cpu", env)], timeout)[0]


def process_environment(accelerator, env=None):
    """This environment with DeepSpeed's accelerator, unbuffered output and, on the CPU, one thread per process (as
    torchrun sets): the tiny models' ops are too small to split, and a second thread's spin-waits cost tens of times
    their work on a busy 2-core host; and DeepSpeed's launcher forking its ranks (tests/launcher_site)."""
    cpu = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [LAUNCHER_SITE, os.environ.get(
        "PYTHONPATH")]))} if accelerator == "cpu" else {}
    return {**os.environ, "DS_ACCELERATOR": accelerator, "PYTHONUNBUFFERED": "1", **cpu, **(env or {})}


def run_processes(command, envs, timeout, kill_peers=True):
    """command once per environment in `envs`, each its own process: on the CPU forked from the rank zygote
    (tests/rank_zygote.py: the libraries imported once), else a fresh interpreter. With kill_peers, the others are
    killed once one fails. One CompletedProcess each; outputs go through files, so that none blocks on a full
    pipe."""
    with tempfile.TemporaryDirectory() as logs:
        processes, files = [], []
        for index, env in enumerate(envs):
            out, err = (open(os.path.join(logs, f"{index}.{kind}"), "w+") for kind in ("out", "err"))
            files.append((out, err))
            if env.get("DS_ACCELERATOR") == "cpu" and command[0] == sys.executable:
                processes.append(ForkedProcess(command[1:], env, out.name, err.name))
            else:
                processes.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            timed_out = time.monotonic() > deadline
            if timed_out or (kill_peers and any(p.returncode for p in processes)):
                for p in processes:
                    p.kill()
                if timed_out:
                    raise subprocess.TimeoutExpired(command, timeout)
            time.sleep(0.05)
        results = []
        for process, (out, err) in zip(processes, files):
            out.seek(0), err.seek(0)
            results.append(subprocess.CompletedProcess(command, process.returncode, out.read(), err.read()))
            out.close(), err.close()
    return results


def script_command(script, config, overrides):
    # Hydra resolves a relative -cp against the script that calls hydra.main; another script needs it absolute.
    return [sys.executable, script, "-cp", "conf" if script == "trainer_pipe.py" else os.path.join(ROOT, "conf"),
            "-cn", config, *overrides]


def start_trainer(num_procs, overrides, config="tiny", script="trainer_pipe.py", env=None, runner_flags=()):
    """launch_trainer(launcher=True) without waiting: the runner (StartedRunner), its output read line by line.
    runner_flags: the deepspeed command's own (--quiet: no launcher INFO lines, as the demo launches)."""
    command, env = trainer_command(num_procs, overrides, config, None, script, env, runner_flags=runner_flags)
    return StartedRunner(command, env)


class StartedRunner:
    """DeepSpeed's runner forked from the rank zygote (its launcher from it, which forks its ranks), with the Popen
    attributes a test uses: pid, stdout (the runner's, its launcher's and its ranks' stdout and stderr, through one
    pipe, until they have all exited), send_signal and wait."""

    def __init__(self, command, env):
        self.fifo_dir = tempfile.mkdtemp()
        fifo = os.path.join(self.fifo_dir, "output")
        os.mkfifo(fifo)
        self.process = ForkedProcess(command[1:], env, fifo, fifo)
        self.pid = self.process.process.pid
        self.stdout = open(fifo)  # as soon as the runner has opened it to write

    def send_signal(self, signum):
        os.kill(self.pid, signum)

    def wait(self, timeout=None):
        self.process.process.join(timeout)
        if self.process.returncode is None:
            raise subprocess.TimeoutExpired(self.process.process.name, timeout)
        self.stdout.close()
        shutil.rmtree(self.fifo_dir)
        return self.process.returncode


def trainer_command(num_procs, overrides, config, hostfile, script, env, accelerator="cpu", runner_flags=()):
    placement = (["--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1"] if hostfile
                 else ["--num_gpus", str(num_procs)])
    command = [sys.executable, "-m", "deepspeed.launcher.runner", *runner_flags, *placement, "--master_port",
               str(free_port()), *script_command(script, config, overrides)[1:]]
    return command, process_environment(accelerator, env)


# 2 stages x 2 data-parallel ranks, ZeRO-1, fp32, 8 steps of 8 sequences; checkpoints every 2 steps, all kept.
REFERENCE = dict(num_stages=2, gradient_accumulation_steps=2, zero_stage=1, max_steps=8, save_steps=2, save_total_limit=10,
                 logging_steps=1, learning_rate=1e-3, warmup_steps=2)
# The same 8 steps of the same global batch on 1 process, without checkpoints: what other topologies must match.
SINGLE_PROCESS = dict(REFERENCE, num_stages=1, gradient_accumulation_steps=4, save_steps=0, zero_stage=0)


def demo_overrides(demo_model, output_dir, **extra):
    values = dict(model_name_or_path=demo_model["ds"], train_file=demo_model["train"], eval_file=demo_model["eval"],
                  output_dir=str(output_dir), seq_length=64, micro_batch_size=2, gradient_accumulation_steps=4)
    if extra.get("data.format") != "indexed":  # token shards are tokenized already (data.cache_dir refused)
        values["data.cache_dir"] = os.path.join(demo_model["root"], "data_cache")  # tokenize once per session
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def lm_eval_overrides(tasks, cloze_limit=10):
    """eval_tasks scoring the demo tasks (scripts/make_demo_tasks.py), the cloze task's first cloze_limit documents."""
    entries = [f"{{task:{path},limit:{cloze_limit}}}" if name == "demo_cloze" else path for name, path in tasks.items()]
    return {"eval_tasks": f"[{','.join(entries)}]"}


def launch_ranks_separately(num_procs, overrides, config="tiny", timeout=120, script="trainer_pipe.py", env=None):
    """launch_trainer's ranks, one CompletedProcess each; unlike the launcher, a failing rank does not get its peers
    killed, so each rank's own exit and message can be checked."""
    return run_ranks(num_procs, script_command(script, config, overrides), process_environment("cpu", env),
                     timeout, kill_peers=False)


def run_in_process(overrides, world_size, config="tiny"):
    """trainer's run() with the launcher's environment for world_size ranks, up to its first failure."""
    from tests.helpers import compose_config
    from training.loop import run
    cfg = compose_config(overrides, config)
    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        return run(cfg)
    finally:
        if previous is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = previous


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def logged_steps(output_dir):
    """The run's step records (those with a training loss)."""
    return [r for r in read_metrics(output_dir) if "loss" in r]


def per_step_losses(output_dir):
    return [r["loss"] for r in logged_steps(output_dir)]


def check_ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def tensors_of(state, prefix=""):
    """{key path: tensor} of a saved state, nested dicts included."""
    import torch
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {path: tensor for key, value in state.items()
                for path, tensor in tensors_of(value, f"{prefix}/{key}").items()}
    return {}
