"""Shared by the bench scripts: their arguments and smoke size, processes on this machine (ranks, child interpreters, a
training run as a user launches it), contenders timed in interleaved rounds and their spread, memory readings, run
configs and batches, a module as an older commit had it."""
import argparse
import contextlib
import functools
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests import distributed  # noqa: E402  (worker processes, as the tests start them)
from tests.distributed import free_port  # noqa: E402,F401
from tests.launch import trainer_command  # noqa: E402
from tests.rank_zygote import in_zygote_child, run_as_interpreter  # noqa: E402

MIB = 2**20
# glibc's mmap threshold held small in a worker (MALLOC_MMAP_THRESHOLD_, read by its malloc at start-up): freed
# tensors go back to the system, so that RSS follows the tensors alive, as a GPU's allocated-memory figure does
# (bench/memory_plan_check.py)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
SMOKE_HELP = "a tiny size, to check that the script runs end to end (tests/test_bench.py); its figures mean nothing"


def parse_args(parser, **smoke):
    """parser's arguments, with --smoke added: the defaults then `smoke`'s (arguments given still win)."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args()


def bench_parser(doc):
    """An argument parser whose help is the script's docstring."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


# Processes

def spawn(fn, world_size, *args):
    """[fn(rank, *args) of each rank]: fn in world_size processes of this machine, one thread each, with the
    launcher's environment (tests/distributed.py spawn); what it returns (JSON) comes back in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        distributed.spawn(_returning, world_size, fn, out_dir, args)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"{rank}.json")) as f:
                results.append(json.load(f))
        return results


def _returning(rank, fn, out_dir, args):
    result = fn(rank, *args)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)


@contextlib.contextmanager
def environment(values):
    """This process's environment with `values` set inside the block: what the workers spawned there read as they
    start (glibc's malloc settings)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def single_rank_env(**extra):
    """This environment with the launcher's variables for one rank on this machine."""
    return dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra)


class PythonProcess:
    """`python ARGS` started from the repository root, its stdout and stderr into the files (or FIFOs) at out and
    err. A fresh interpreter, as a user's; where this process was forked from the test suite's rank zygote (the
    smoke run, tests/test_bench.py) it is forked from this one, which has imported the libraries already
    (tests/rank_zygote.py run_as_interpreter), and forks its own ranks and launchers in turn."""

    def __init__(self, args, env=None, out=os.devnull, err=os.devnull):
        args, env = [str(arg) for arg in args], dict(os.environ if env is None else env)
        if in_zygote_child():
            self.pid, self.popen = os.fork(), None
            if self.pid == 0:
                for finalizer in list(weakref.finalize._registry):  # this process's (a temporary directory's
                    finalizer.atexit = False  # removal): not the child's to run at its exit
                os._exit(run_as_interpreter(args, env, out, err))
        else:
            with open(out, "a") as stdout, open(err, "a") as stderr:
                self.popen = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=stdout,
                                              stderr=stderr)
            self.pid = self.popen.pid

    def wait(self):
        """(its exit code, its peak RSS in bytes), once it has exited."""
        _, status, usage = os.wait4(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if self.popen is not None:
            self.popen.returncode = code  # reaped here
        return code, usage.ru_maxrss * 1024


def run_python(args, env=None, check=True):
    """`python ARGS` run to its end (PythonProcess): (its CompletedProcess, output captured; its peak RSS in bytes;
    its wall seconds). With check, a failure ends this script with the end of its output."""
    with tempfile.TemporaryDirectory() as logs:
        out, err = os.path.join(logs, "out"), os.path.join(logs, "err")
        for path in (out, err):
            open(path, "w").close()
        start = time.perf_counter()
        code, peak = PythonProcess(args, env, out, err).wait()
        seconds = time.perf_counter() - start
        with open(out) as stdout, open(err) as stderr:
            result = subprocess.CompletedProcess(args, code, stdout.read(), stderr.read())
    if check and code:
        sys.exit(f"python {' '.join(map(str, args))} failed ({code}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result, peak, seconds


def timed_lines(args, env=None):
    """Run `python ARGS` (PythonProcess), stamping each line of its stdout and stderr with the time it came: (its exit
    code, [(seconds since its start, line)])."""
    read_end, write_end = os.pipe()
    started = time.time()
    process = PythonProcess(args, env, f"/dev/fd/{write_end}", f"/dev/fd/{write_end}")
    os.close(write_end)
    with os.fdopen(read_end) as output:
        lines = [(time.time() - started, line.rstrip("\n")) for line in output]
    return process.wait()[0], lines


def launch_training(num_procs, overrides, config="base", env=None):
    """`deepspeed --num_gpus N trainer_pipe.py -cp conf -cn CONFIG overrides...` on this machine's CPU, as a user
    launches it (tests/launch.py trainer_command: a rank a process, one thread each): run_python's result."""
    command, environment = trainer_command(num_procs, overrides, config, None, "trainer_pipe.py", env)
    return run_python(command[1:], environment)


def demo_model(directory, train_lines=3000, vocab_size=384, hidden_size=64, num_hidden_layers=None):
    """The tiny LLaMA the tests train (scripts/make_tiny_llama.py: directory's train.txt, eval.txt and hf/), converted
    as convert2ckpt.py does (ds/); made once."""
    from checkpoints.hf_to_ds import convert_hf_to_ds
    if not os.path.isdir(os.path.join(directory, "ds")):
        layers = ["--num_hidden_layers", num_hidden_layers] if num_hidden_layers else []
        run_python([os.path.join(ROOT, "scripts", "make_tiny_llama.py"), "--output_dir", directory, "--train_lines",
                    train_lines, "--eval_lines", 10, "--vocab_size", vocab_size, "--hidden_size", hidden_size, *layers])
        convert_hf_to_ds(os.path.join(directory, "hf"), os.path.join(directory, "ds"))
    return directory


# Contenders in interleaved rounds

def timed(function, clock=time.perf_counter):
    """The seconds function() took by `clock` (time.thread_time: this thread's CPU seconds)."""
    start = clock()
    function()
    return clock() - start


def in_rounds(contenders, rounds):
    """{name: [what contenders[name]() returned, each round]}: every contender once a round, in reverse order every
    other round, so that the machine's drift falls on all alike and none always runs right after the same other."""
    results = {name: [] for name in contenders}
    for round_index in range(rounds):
        for name, measure in list(contenders.items())[::1 if round_index % 2 == 0 else -1]:
            results[name].append(measure())
    return results


def timed_rounds(contenders, rounds, clock=time.perf_counter):
    """{name: [seconds of each round]} of contenders (name: a function) called in_rounds."""
    return in_rounds({name: functools.partial(timed, function, clock) for name, function in contenders.items()},
                     rounds)


def spread(values, digits=3):
    """'median M (min A, max B)'."""
    return (f"median {statistics.median(values):.{digits}f} (min {min(values):.{digits}f}, "
            f"max {max(values):.{digits}f})")


def round_ratios(numerators, denominators):
    """'median M (rounds A-B)' of the per-round ratios numerators[i] / denominators[i]."""
    ratios = [n / d for n, d in zip(numerators, denominators)]
    return f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})"


# Memory

def _status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def rss_bytes():
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes():
    return _status_kib("VmHWM") * 1024


def reset_peak_rss():
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_rise(function):
    """How far this process's peak RSS rose over its RSS before, while function() ran."""
    before = rss_bytes()
    reset_peak_rss()
    function()
    return peak_rss_bytes() - before


def saved_activation_bytes(module, batch):
    """Bytes autograd keeps for backward over one micro-batch's forward (each storage once, the weights it keeps a
    reference to left out: they are the model's, not activations); runs its backward."""
    storages = {}
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    inputs, labels = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = module.loss_fn(module(inputs), labels)
    loss.backward()
    module.zero_grad(set_to_none=True)
    return sum(storages.values())


# Runs

def run_config(overrides):
    """conf/base.yaml with overrides, as trainer_pipe.py would see it (one warm-up step: DeepSpeed's
    WarmupCosineLR rejects base.yaml's 0)."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        return compose(config_name="base", overrides=["model_name_or_path=unused", "warmup_steps=1", *overrides])


def random_micro_batches(vocab_size, seq_length, micro_batch_size, seed=0):
    """Endless unpadded micro-batches in the engine's format: ((ids, mask, positions), labels)."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_length).expand(micro_batch_size, seq_length)
    mask = torch.ones(micro_batch_size, seq_length, dtype=torch.long)
    while True:
        ids = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=generator)
        yield (ids, mask, positions), ids


def trainer_engine(fields, overrides, total_steps):
    """The trainer's engine (training/loop.py build_engine, random weights) for conf/base.yaml with overrides and a
    LlamaConfig of fields (or a model config), in the launcher's ranks' process group (started here unless it is):
    (the engine, endless random micro-batches for it, this process's RSS before the model was built, where its
    peak-RSS window starts)."""
    import torch.distributed as dist
    from transformers import LlamaConfig, PretrainedConfig

    from cluster.distributed import init_distributed
    from training.loop import build_engine
    from training.run_spec import plan_spec
    cfg = run_config(overrides)
    if not dist.is_initialized():
        init_distributed(timeout_minutes=10)
    config = fields if isinstance(fields, PretrainedConfig) else LlamaConfig(**fields)
    before_model = rss_bytes()
    reset_peak_rss()
    engine, _ = build_engine(plan_spec(cfg, dist.get_world_size(), config), total_steps, layer_loader=None)
    return engine, random_micro_batches(config.vocab_size, cfg.seq_length, cfg.micro_batch_size), before_model


def steps_together(engine, batches, steps, clock=time.perf_counter):
    """Seconds per step by `clock` of `steps` calls of engine.train_batch(batches()), started together on every rank
    (a barrier first)."""
    torch.distributed.barrier()
    start = clock()
    for _ in range(steps):
        engine.train_batch(batches())
    return (clock() - start) / steps


def train_step_seconds(engine, batches, steps):
    """Wall seconds of each of `steps` calls of engine.train_batch."""
    return [timed(lambda: engine.train_batch(batches)) for _ in range(steps)]


def module_at(commit, path):
    """The module at `path` (from the repository's root) as `commit` had it, imported under another name: the old
    side of an A/B run in one process."""
    name = f"{os.path.splitext(os.path.basename(path))[0]}_{commit}"
    copy = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(copy, "w") as f:
        f.write(subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_note():
    """What else ran while a figure was taken: the load average next to the core count."""
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} cores, load average {load:.2f} at the end"
