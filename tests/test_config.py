"""A run's config: unknown keys and bad values refused before anything is built, the LR schedule handed to
DeepSpeed (the learning rate each optimizer step actually uses), shipped defaults."""
import os
import re
import sys

import pytest
import torch
from deepspeed.runtime import lr_schedules
from omegaconf import OmegaConf

from tests.conftest import ROOT
from tests.helpers import compose_config
from tests.launch import process_environment, run_processes
from training.deepspeed_config import deepspeed_config, lr_scheduler_config


def step_lrs(schedule, steps):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = getattr(lr_schedules, schedule["type"])(optimizer, **schedule["params"])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_no_warmup_starts_at_the_peak(kind):
    cfg = OmegaConf.create(dict(warmup_steps=0, lr_scheduler=kind, min_lr_ratio=0.1, learning_rate=1e-3))
    lrs = step_lrs(lr_scheduler_config(cfg, total_steps=10), 10)
    assert lrs[0] == pytest.approx(1e-3)
    if kind == "cosine":
        assert lrs[-1] == pytest.approx(1e-4)


def test_warmup_rises_then_cosine_decays_to_the_floor():
    cfg = OmegaConf.create(dict(warmup_steps=4, lr_scheduler="cosine", min_lr_ratio=0.1, learning_rate=1e-3))
    lrs = step_lrs(lr_scheduler_config(cfg, total_steps=12), 13)
    assert lrs[0] == 0.0 and lrs[2] < lrs[3] < lrs[4] < lrs[5] and max(lrs) <= 1e-3
    assert lrs[5:] == sorted(lrs[5:], reverse=True) and lrs[12] == pytest.approx(1e-4)


@pytest.mark.parametrize("name", sorted(n[:-len(".yaml")] for n in os.listdir(os.path.join(ROOT, "conf"))
                                        if n.endswith(".yaml")))
def test_shipped_configs_leave_unmeasured_compile_off_and_verify_checksums(name):
    """compile=true gains nothing measurable on the CPU and never ran on a GPU here (issue 13, README)."""
    cfg = compose_config(config=name)
    assert cfg.compile is False
    assert cfg.verify_checksums is True and cfg.tokenizer_name_or_path is None


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_deepspeed_keys_added_to_the_precision_nodes_are_kept(precision):
    """precision switches bf16 on or off; other keys of the bf16 node (DeepSpeed's) pass through to DeepSpeed."""
    cfg = compose_config([f"precision={precision}", "+deepspeed.bf16.immediate_grad_update=true"])
    ds, _ = deepspeed_config(cfg, total_steps=10)
    assert ds["bf16"] == {"immediate_grad_update": True, "enabled": precision == "bf16"}
    assert ds["fp16"] == {"initial_scale_power": 16, "enabled": False}


@pytest.mark.parametrize("overrides,data_types,warned", [
    (("precision=bf16",), {"grad_accum_dtype": "fp32"}, False),
    (("precision=bf16", "grad_accum_dtype=bf16"), {"grad_accum_dtype": "bf16"}, True),
    (("precision=fp16", "grad_accum_dtype=fp16", "gradient_accumulation_steps=64"), {"grad_accum_dtype": "fp16"},
     True),
    (("precision=fp32",), None, False),
])
def test_16_bit_runs_sum_gradients_in_fp32_unless_told_otherwise(overrides, data_types, warned):
    """DeepSpeed sums a 16-bit model's micro-batch gradients in its own dtype unless data_types says otherwise."""
    from training.deepspeed_config import accumulation_warning
    cfg = composed("tiny", "zero_stage=1", *overrides)
    ds, _ = deepspeed_config(cfg, total_steps=10)
    assert ds.get("data_types") == data_types
    warning = accumulation_warning(cfg)
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith(f"warning: grad_accum_dtype={cfg.precision}: each step sums "
                                  f"{cfg.gradient_accumulation_steps} micro-batches' gradients in {cfg.precision}")


@pytest.mark.parametrize("overrides,message", [
    (("precision=fp32", "grad_accum_dtype=bf16"),
     "grad_accum_dtype=bf16 with precision=fp32: micro-batch gradients are summed in fp32 or in the model's dtype; set "
     "grad_accum_dtype=fp32."),
    (("precision=bf16", "grad_accum_dtype=fp16"), "grad_accum_dtype=fp16 with precision=bf16"),
    (("precision=bf16", "+deepspeed.data_types.grad_accum_dtype=bf16"),
     "deepspeed.data_types.grad_accum_dtype=bf16 contradicts grad_accum_dtype=fp32: set grad_accum_dtype only."),
])
def test_an_accumulation_dtype_that_cannot_work_is_refused(overrides, message):
    from errors import ConfigError
    from training.config_checks import checked_config
    with pytest.raises(ConfigError, match=re.escape(message)):
        checked_config(composed("tiny", "zero_stage=1", *overrides))


@pytest.mark.parametrize("overrides,expected", [
    ((), {"torch_adam": True, "fused": True}),
    (("deepspeed.optimizer.params.torch_adam=false",), {"torch_adam": False}),
    (("offload_optimizer=cpu", "zero_stage=1"), {}),
])
def test_torch_adamw_runs_fused_and_deepspeed_adams_get_no_torch_argument(overrides, expected):
    """torch's AdamW takes `fused`; DeepSpeed's fused and CPU Adams would fail on it."""
    ds, _ = deepspeed_config(composed("tiny", *overrides), total_steps=10)
    params = ds["optimizer"]["params"]
    assert {key: params[key] for key in ("torch_adam", "fused") if key in params} == expected


def composed(name, *overrides):
    return compose_config(overrides, name)


@pytest.mark.parametrize("override,message", [
    ("++lerning_rate=1e-3", "unknown config key 'lerning_rate': did you mean learning_rate?"),
    ("++data.formt=chat", "unknown config key 'data.formt': did you mean data.format?"),
    ("++pipeline_schedul=zero_bubble", "unknown config key 'pipeline_schedul': did you mean pipeline_schedule"),
    ("++no_such_knob=1", "unknown config key 'no_such_knob': every key of a run is listed, with its meaning, in "
                         "conf/base.yaml"),
])
def test_unknown_or_misspelt_keys_are_refused_naming_the_closest(override, message):
    """Hydra's ++ adds any key; an ignored misspelling would train with the default silently."""
    from errors import ConfigError
    from training.config_checks import checked_config
    with pytest.raises(ConfigError, match=re.escape(message)):
        checked_config(composed("tiny", override))


def test_free_form_nodes_take_any_key_and_defaults_fill_older_configs():
    """DeepSpeed's own keys (under deepspeed.) and a published config.json's fields (model_config) pass; a config
    without a newer key gets conf/base.yaml's default, and YAML's null reads as the default for offload."""
    from omegaconf import open_dict

    from training.config_checks import checked_config
    cfg = composed("llama_65b", "+deepspeed.bf16.immediate_grad_update=true", "+model_config.rope_theta=10000.0",
                   "offload_optimizer=null")
    with open_dict(cfg):
        del cfg["zero_bubble_max_waiting"]
    checked = checked_config(cfg)
    assert checked.deepspeed.bf16.immediate_grad_update is True and checked.model_config.rope_theta == 10000.0
    assert checked.zero_bubble_max_waiting is None and checked.offload_optimizer == "none"


@pytest.mark.parametrize("override,message", [
    ("precision=fp8", "precision 'fp8' is not one of ('fp32', 'bf16', 'fp16')"),
    ("attention_impl=flash", "attention_impl 'flash' is not one of ('sdpa', 'eager')"),
    ("nan_policy=ignore", "nan_policy 'ignore' is not one of ('stop', 'skip')"),
    ("pipeline_schedule=gpipe", "pipeline_schedule 'gpipe' is not one of ('1f1b', 'zero_bubble', 'interleaved_1f1b', 'zbv')"),
    ("data.format=csv", "data.format='csv': expected one of pretokenized, text, instruction, chat"),
    ("loss_impl=fused", "loss_impl 'fused' is not one of ('chunked', 'logits')"),
    ("async_save=yes", "async_save 'yes' is not one of (False, True, 'auto')"),
    ("loss_chunk_tokens=0", "loss_chunk_tokens=0 must be a positive number of tokens"),
    ("partition_costs=timed", "partition_costs='timed' is not one of auto, flops, measured."),
    ("lora.rank=8 partition_costs=measured", "partition_costs=measured cannot time this run's layers under "
     "lora.rank=8 (it times one unsplit layer); set partition_costs=flops or auto."),
    ("loss_chunk_tokens=-512", "loss_chunk_tokens=-512 must be a positive number of tokens"),
    ("hang_watchdog.step_time_factor=1.5", "hang_watchdog.step_time_factor=1.5 is too short for the measured step "
     "time: steps vary, and a rank that is only slow must not be ended; use at least 2 (10 by default)."),
    ("hang_watchdog.startup_seconds=0", "hang_watchdog.startup_seconds=0 must be a positive number of seconds."),
    ("hang_watchdog.min_step_seconds=600", "hang_watchdog.min_step_seconds=600 is not below dist_timeout_minutes=10 "
     "(x 60 s): a collective's timeout would end a hung step first, without naming where it stopped; lower the first "
     "or raise the second."),
    ("hang_watchdog.startup_seconds=1800", "hang_watchdog.startup_seconds=1800 is not below dist_timeout_minutes=10 "
     "(x 60 s): a collective's timeout would end a hung start or save first, without naming where it stopped; lower "
     "the first or raise the second."),
])
def test_each_choice_is_checked_before_anything_is_built(override, message):
    from errors import ConfigError
    from training.config_checks import checked_config
    with pytest.raises(ConfigError, match=re.escape(message)):
        checked_config(composed("tiny", *override.split()))


def test_the_watchdogs_default_start_up_limit_is_below_the_collectives_timeout():
    """startup_seconds' default follows dist_timeout_minutes (its old 1800 s outlasted the default 10-minute
    collectives, whose timeout then ended a hung start first, on NCCL an abort without a word); a value set stands."""
    from training.config_checks import checked_config
    assert checked_config(composed("tiny")).hang_watchdog.startup_seconds == 540
    assert checked_config(composed("tiny", "dist_timeout_minutes=30")).hang_watchdog.startup_seconds == 1620
    assert checked_config(composed("tiny", "hang_watchdog.startup_seconds=120")).hang_watchdog.startup_seconds == 120


@pytest.mark.parametrize("override,shown", [("data.packing=true", "true"), ("data.overlong=split", "split"),
                                            ("data.cache_dir=/data/cache", "/data/cache")])
def test_tokenizing_keys_are_refused_with_token_shards(override, shown):
    """Token shards are tokenized already: a tokenizing key set away from its default would be ignored."""
    from errors import ConfigError
    from training.config_checks import checked_config
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as error:
        checked_config(composed("tiny", "data.format=indexed", override))
    assert str(error.value) == (f"{key}={shown} does nothing with data.format=indexed (token shards are cut into "
                                f"samples of seq_length + 1 tokens as prepare_data.py wrote them, docs/data.md); "
                                f"remove it.")
    assert checked_config(composed("tiny", "data.format=indexed")).data.cache_dir is None
    assert checked_config(composed("tiny", override)).data.format == "text"  # the other formats use them


@pytest.mark.parametrize("args,message", [
    (("fp32", 0, 8, 4, True, "NVIDIA H100"), "8 ranks on this node but 4 GPU(s) visible (CUDA_VISIBLE_DEVICES=0,1,2,3): "
     "two ranks would share a GPU; launch at most 4 processes per node (deepspeed --num_gpus 4, or a hostfile's slots)."),
    (("fp32", 1, 1, 1, True, "NVIDIA H100"), "local rank 1 has no GPU of its own: this process sees 1 GPU(s) "
     "(CUDA_VISIBLE_DEVICES=0,1,2,3); let every rank of a node see all of its GPUs (the launcher picks LOCAL_RANK's)."),
    (("bf16", 0, 2, 2, False, "Tesla V100-SXM2-32GB"), "precision=bf16 but Tesla V100-SXM2-32GB has no bf16 support "
     "(compute capability below 8.0); set precision=fp16 or precision=fp32."),
    (("fp16", 0, 2, 2, False, "Tesla V100-SXM2-32GB"), None),
])
def test_ranks_that_cannot_have_a_gpu_each_are_refused_at_start_up(monkeypatch, args, message):
    from cluster.distributed import device_error
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert device_error(*args) == message


THREADS_OF_A_RANK = """
import os, sys
os.sched_setaffinity(0, map(int, sys.argv[1].split(",")))  # what taskset -c CORES does before it runs the command
from cluster.distributed import set_threads_per_process
import torch
set_threads_per_process()
print(torch.get_num_threads())
"""


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give a rank fewer than the machine's")
@pytest.mark.parametrize("cores,local_ranks,threads", [("0", 1, 1), ("0,1", 2, 1), ("0,1", 1, 2)])
def test_threads_per_rank_share_the_cores_the_process_may_use_not_the_machines(cores, local_ranks, threads):
    """Under taskset (as under Slurm's cpuset cgroup or numactl) a rank's threads share the cores it may run on,
    not os.cpu_count()'s: one core for one rank is one thread, not the machine's count. The rank is forked from the
    rank zygote (a fresh interpreter's imports cost ~13 CPU s here), without the suite's OMP_NUM_THREADS."""
    env = {k: v for k, v in process_environment("cpu").items() if k != "OMP_NUM_THREADS"}
    result, = run_processes([sys.executable, "-c", THREADS_OF_A_RANK, cores], [{**env, "LOCAL_SIZE": str(local_ranks)}],
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == threads


def test_the_suites_process_keeps_one_thread_when_a_test_runs_the_trainer_in_it():
    """run() (tests/launch.py run_in_process) sets its process's threads first: the suite's own stays at one
    (tests/conftest.py), or every later test of the worker pays a second thread's spin-waits."""
    from cluster.distributed import set_threads_per_process
    set_threads_per_process()
    assert torch.get_num_threads() == 1
