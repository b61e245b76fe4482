"""Each rank's RNG state (Python, numpy, torch, and the accelerator's, whose generator draws dropout on a GPU) in a
training checkpoint, so a resume draws what the run would have."""
import os
import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from checkpoints.state_files import load_rng_file


def rng_state_path(tag_dir, rank):
    return os.path.join(tag_dir, f"rng_state_rank{rank:05d}.pt")


def save_rng_state(tag_dir, rank):
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if on_accelerator():
        state["accelerator"] = get_accelerator().get_rng_state()
    torch.save(state, rng_state_path(tag_dir, rank))


def on_accelerator():
    """Whether the run's device has a generator of its own (on the CPU accelerator it is torch's)."""
    return get_accelerator().device_name() != "cpu"


def load_rng_state(tag_dir, rank):
    path = rng_state_path(tag_dir, rank)
    if not os.path.isfile(path):
        return
    state = load_rng_file(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state and on_accelerator():
        get_accelerator().set_rng_state(state["accelerator"])
