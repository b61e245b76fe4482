"""Shared by the bench scripts: worker processes on this machine, memory readings, run configs and batches."""
import os
import re
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    fn(rank, *args)


def spawn(fn, world_size, *args):
    """fn(rank, *args) in world_size fresh processes of one thread each, as a launcher would start them."""
    mp.start_processes(_bootstrap, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       start_method="spawn", join=True)


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


def machine_note():
    """What else ran while a figure was taken: the load average next to the core count."""
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} cores, load average {load:.2f} at the end"
