import gc
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests.cpu_durations import pytest_addoption, pytest_runtest_protocol, pytest_terminal_summary  # noqa: E402,F401
from tests.tiny_models import TINY_CONFIGS, make_tiny_model  # noqa: E402

if not torch.cuda.is_available():  # the CPU suite's in-process references: see tests/launch.py process_environment
    torch.set_num_threads(1)

gc.freeze()  # the libraries loaded by now stay: full collections skip them (as tests/zygote_imports.py does)

# tests/gpu runs only when named (bash scripts/gpu_check.sh): the CPU suite never collects it, from any directory.
collect_ignore = ["gpu"]

# Session fixtures that launch training runs: a test using one is slow however quick its own body.
TRAINED_FIXTURES = {"reference_run", "single_process_run", "lora_run", "peft_run", "two_step_run"}


def pytest_collection_modifyitems(items):
    for item in items:
        if TRAINED_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


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


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The tiny default made by the project's own script (smaller corpus), converted: {hf, ds, train, eval} paths."""
    from tests.launch import check_ok, run_python
    root = tmp_path_factory.mktemp("demo")
    check_ok(run_python([os.path.join(ROOT, "scripts", "make_tiny_llama.py"), "--output_dir", root, "--train_lines",
                         3000, "--eval_lines", 100, "--vocab_size", 384, "--hidden_size", 64]))
    from checkpoints.hf_to_ds import convert_hf_to_ds
    convert_hf_to_ds(str(root / "hf"), str(root / "ds"))
    return {"hf": str(root / "hf"), "ds": str(root / "ds"), "train": str(root / "train.txt"),
            "eval": str(root / "eval.txt"), "root": root}


@pytest.fixture(scope="session")
def demo_tasks(demo_model):
    """Small lm-eval tasks over the demo model's eval text (scripts/make_demo_tasks.py): {task: its YAML file}. The
    runs and lm-eval read them offline, as a cluster node would."""
    from scripts.make_demo_tasks import write_tasks
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return write_tasks(demo_model["eval"], str(demo_model["root"] / "tasks"), docs=12)


@pytest.fixture(scope="session")
def reference_run(demo_model, demo_tasks, tmp_path_factory):
    """The 2 stages x 2 data-parallel fp32 run that parity and resume tests compare against; it scores the demo
    tasks at its last step (tests/test_lm_eval.py)."""
    from tests.launch import REFERENCE, check_ok, demo_overrides, launch_trainer, lm_eval_overrides
    out = tmp_path_factory.mktemp("reference") / "run"
    check_ok(launch_trainer(4, demo_overrides(demo_model, out, **REFERENCE, **lm_eval_overrides(demo_tasks))))
    return out


@pytest.fixture(scope="session")
def single_process_run(demo_model, demo_tasks, tmp_path_factory):
    """The reference run's steps on 1 process (tests/launch.py SINGLE_PROCESS), evaluated at the end, the demo
    tasks too."""
    from tests.launch import SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, lm_eval_overrides
    out = tmp_path_factory.mktemp("single_process") / "run"
    check_ok(launch_trainer(1, demo_overrides(demo_model, out, **SINGLE_PROCESS, **lm_eval_overrides(demo_tasks))))
    return out
