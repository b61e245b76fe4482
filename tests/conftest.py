import gc
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests.cpu_durations import (pytest_addoption, pytest_runtest_logreport, pytest_runtest_makereport,  # noqa: E402,F401
                                 pytest_runtest_protocol, pytest_sessionfinish, pytest_terminal_summary,
                                 pytest_testnodedown)
from tests.tiny_models import DEEPSEEK_CONFIGS, HYBRID_CONFIGS, MOE_CONFIGS, TINY_CONFIGS, make_tiny_model  # noqa: E402

if not torch.cuda.is_available():  # the CPU suite's in-process references: see tests/launch.py process_environment
    torch.set_num_threads(1)

gc.freeze()  # the libraries loaded by now stay: full collections skip them (as tests/zygote_imports.py does)

# tests/gpu runs only when named (bash scripts/gpu_check.sh): the CPU suite never collects it, from any directory.
collect_ignore = ["gpu"]

# Session fixtures that launch training runs: a test using one is slow however quick its own body.
TRAINED_FIXTURES = {"reference_run", "single_process_run", "lora_run", "peft_run", "two_step_run"}
# The xdist group of the launches that keep 4 or more ranks busy for most of a minute (tests/test_schedule.py's):
# one worker runs them one after another, while the other runs the rest; two at once would put 8 to 12 ranks on a
# 2-core host's cores. pytest-xdist sends the groups with the most tests first, so this one starts early.
HEAVY_LAUNCHES = "heavy_launches"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's (its groups) and -m's (slow)
def pytest_collection_modifyitems(items):
    for item in items:
        if TRAINED_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        # pytest-xdist (scripts/test.sh: --dist loadgroup) runs a module's tests that share a module-scoped fixture
        # on one worker, which builds it once; session fixtures that train are shared through built_once
        if any(definitions[-1].scope in ("module", "class") for definitions in
               item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def built_once(tmp_path_factory, name, build):
    """build(directory)'s result (JSON), computed once per session: under pytest-xdist by the first worker to ask, in
    a directory all the workers share, the others waiting for it (a file lock) and reading its result."""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    directory, result = root / name, root / f"{name}.json"
    with FileLock(f"{directory}.lock"):
        if not result.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a failed attempt's
            directory.mkdir()
            result.write_text(json.dumps(build(directory)))
    return json.loads(result.read_text())


def converted_tiny_models(root, names):
    """{name: (hf_dir, ds_dir)} of each tiny model saved as sharded safetensors under root, then converted."""
    from checkpoints.hf_to_ds import convert_hf_to_ds
    dirs = {}
    for name in names:
        hf_dir, ds_dir = str(root / name / "hf"), str(root / name / "ds")
        make_tiny_model(name, hf_dir, max_shard_size="20KB")
        convert_hf_to_ds(hf_dir, ds_dir)
        dirs[name] = (hf_dir, ds_dir)
    return dirs


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{name: (hf_dir, ds_dir)} for every tiny config: saved as sharded safetensors, then converted."""
    return converted_tiny_models(tmp_path_factory.mktemp("tiny"), TINY_CONFIGS)


@pytest.fixture(scope="session")
def tiny_moe_checkpoints(tmp_path_factory):
    """{name: (hf_dir, ds_dir)} for every tiny mixture of experts (tests/tiny_models.py MOE_CONFIGS): saved by
    transformers (one tensor per expert, sharded safetensors), then converted."""
    return converted_tiny_models(tmp_path_factory.mktemp("tiny_moe"), MOE_CONFIGS)


@pytest.fixture(scope="session")
def tiny_deepseek_checkpoints(tmp_path_factory):
    """{name: (hf_dir, ds_dir)} for every tiny model of the DeepSeek-V3 line (tests/tiny_models.py
    DEEPSEEK_CONFIGS), saved and converted as the mixtures of experts."""
    return converted_tiny_models(tmp_path_factory.mktemp("tiny_deepseek"), DEEPSEEK_CONFIGS)


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoints(tmp_path_factory):
    """{name: (hf_dir, ds_dir)} for every tiny Gated DeltaNet hybrid (tests/tiny_models.py HYBRID_CONFIGS), saved
    by transformers and converted."""
    return converted_tiny_models(tmp_path_factory.mktemp("tiny_hybrid"), HYBRID_CONFIGS)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The tiny default made by the project's own script (smaller corpus), converted: {hf, ds, train, eval} paths,
    and root, this worker's folder for caches (under pytest-xdist, each worker tokenizes into its own)."""
    def build(root):
        from tests.launch import check_ok, run_python
        check_ok(run_python([os.path.join(ROOT, "scripts", "make_tiny_llama.py"), "--output_dir", root,
                             "--train_lines", 3000, "--eval_lines", 40, "--vocab_size", 384, "--hidden_size", 64]))
        from checkpoints.hf_to_ds import convert_hf_to_ds
        convert_hf_to_ds(str(root / "hf"), str(root / "ds"))
        return {"hf": str(root / "hf"), "ds": str(root / "ds"), "train": str(root / "train.txt"),
                "eval": str(root / "eval.txt")}
    return {**built_once(tmp_path_factory, "demo", build), "root": tmp_path_factory.mktemp("demo_caches")}


@pytest.fixture(scope="session")
def demo_tasks(demo_model, tmp_path_factory):
    """Small lm-eval tasks over the demo model's eval text (scripts/make_demo_tasks.py): {task: its YAML file}. The
    runs and lm-eval read them offline, as a cluster node would."""
    from scripts.make_demo_tasks import write_tasks
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return built_once(tmp_path_factory, "demo_tasks", lambda root: write_tasks(demo_model["eval"], str(root), docs=12))


@pytest.fixture(scope="session")
def reference_run(demo_model, demo_tasks, tmp_path_factory):
    """The 2 stages x 2 data-parallel fp32 run that parity and resume tests compare against; it scores the demo
    tasks at its last step (tests/test_lm_eval.py)."""
    from tests.launch import REFERENCE, check_ok, demo_overrides, launch_trainer, lm_eval_overrides

    def build(root):
        check_ok(launch_trainer(4, demo_overrides(demo_model, root / "run", **REFERENCE,
                                                  **lm_eval_overrides(demo_tasks))))
        return str(root / "run")
    return Path(built_once(tmp_path_factory, "reference", build))


@pytest.fixture(scope="session")
def single_process_run(demo_model, demo_tasks, tmp_path_factory):
    """The reference run's steps on 1 process (tests/launch.py SINGLE_PROCESS), evaluated at the end, the demo
    tasks too."""
    from tests.launch import SINGLE_PROCESS, check_ok, demo_overrides, launch_trainer, lm_eval_overrides

    def build(root):
        check_ok(launch_trainer(1, demo_overrides(demo_model, root / "run", **SINGLE_PROCESS,
                                                  **lm_eval_overrides(demo_tasks))))
        return str(root / "run")
    return Path(built_once(tmp_path_factory, "single_process", build))
