import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.tiny_models import TINY_CONFIGS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{name: (hf_dir, ds_dir)} for every tiny config: saved as sharded safetensors, then converted."""
    from checkpoints.hf_to_ds import convert_hf_to_ds
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for name in TINY_CONFIGS:
        hf_dir, ds_dir = str(root / name / "hf"), str(root / name / "ds")
        make_tiny_model(name, hf_dir, max_shard_size="20KB")
        convert_hf_to_ds(hf_dir, ds_dir)
        dirs[name] = (hf_dir, ds_dir)
    return dirs
