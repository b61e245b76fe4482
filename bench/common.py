"""Shared by the bench scripts: worker processes on this machine, memory readings, run configs and batches, a module
as an older commit had it."""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from tests.distributed import free_port, spawn  # noqa: E402,F401  (worker processes, as the tests start them)

MIB = 2**20


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


def train_step_seconds(engine, batches, steps):
    """Wall seconds of each of `steps` calls of engine.train_batch."""
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(batches)
        durations.append(time.perf_counter() - start)
    return durations


def machine_note():
    """What else ran while a figure was taken: the load average next to the core count."""
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} cores, load average {load:.2f} at the end"
