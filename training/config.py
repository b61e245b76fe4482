"""Checks a run's config against the world size, the model and the data before any heavy work, and turns the
Hydra config into DeepSpeed's. Every check runs identically on every rank, so all ranks fail together."""
import os

from omegaconf import OmegaConf
from transformers import AutoConfig

from checkpoints.files import has_tokenizer_files, read_latest
from models.layout import layer_file_name
from models.llama import check_model_config
from models.tensor_parallel import check_tensor_parallel_split
from training.schedule import PIPELINE_SCHEDULES

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULERS = ("cosine", "linear", "constant")
OFFLOAD_DEVICES = ("none", "cpu")


class ConfigError(ValueError):
    """A config that cannot work; the message names the bad value and what to do."""


def load_model_config(model_dir):
    """The model config of a converted checkpoint directory, or an error that says how to make one."""
    convert_hint = (f"convert a Hugging Face model first: python convert2ckpt.py --model_name_or_path HF_DIR "
                    f"--output_dir {model_dir}")
    if not os.path.isdir(model_dir):
        raise ConfigError(f"model_name_or_path '{model_dir}' does not exist; {convert_hint}")
    tag = read_latest(model_dir)
    if tag is None or not os.path.isfile(os.path.join(model_dir, tag, layer_file_name(0))):
        raise ConfigError(f"model_name_or_path '{model_dir}' is not a converted DeepSpeed checkpoint (no 'latest' "
                          f"naming a directory of layer_XX-model_states.pt files); {convert_hint}")
    side_dir = next((d for d in (os.path.join(model_dir, tag), model_dir)
                     if os.path.isfile(os.path.join(d, "config.json"))), None)
    if side_dir is None:
        raise ConfigError(f"no config.json in '{model_dir}'; {convert_hint}")
    config = AutoConfig.from_pretrained(side_dir)
    check_model_config(config)
    return config, side_dir


def tokenizer_dir(cfg, model_files_dir):
    """Where the run's tokenizer is (tokenizer_name_or_path, else the converted model's directory), or None when
    every data file is pre-tokenized and none is needed; an error naming the directory and the key when one is
    needed and missing."""
    if cfg.data.format == "pretokenized":
        return None
    path = cfg.tokenizer_name_or_path or model_files_dir
    if not has_tokenizer_files(path):
        source = "tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model_name_or_path"
        raise ConfigError(f"data.format={cfg.data.format} needs a tokenizer, and '{path}' ({source}) holds no "
                          f"tokenizer files (tokenizer.json, tokenizer.model, tokenizer_config.json, ...); set "
                          f"tokenizer_name_or_path to the directory of the model's tokenizer, or pre-tokenize the "
                          f"data (data.format=pretokenized, lines of input_ids).")
    return path


def check_run_config(cfg, world_size, model_config):
    stages, tp = cfg.num_stages, cfg.tensor_parallel_size
    data_parallel_size(world_size, stages, tp)
    try:
        check_tensor_parallel_split(model_config, tp, cfg.micro_batch_size * cfg.seq_length
                                    if cfg.sequence_parallel else None)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model_config.num_hidden_layers < stages:
        raise ConfigError(f"num_stages={stages} is more than the model's {model_config.num_hidden_layers} decoder "
                          f"layers (num_hidden_layers); use at most {model_config.num_hidden_layers} stages.")
    if cfg.seq_length > model_config.max_position_embeddings:
        raise ConfigError(f"seq_length={cfg.seq_length} exceeds the model's max_position_embeddings="
                          f"{model_config.max_position_embeddings}; lower seq_length.")
    window = getattr(model_config, "sliding_window", None)
    if window and cfg.seq_length > window:
        raise ConfigError(f"seq_length={cfg.seq_length} exceeds sliding_window={window}, which this pipeline does "
                          f"not implement; use seq_length <= {window}.")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision '{cfg.precision}' is not one of {PRECISIONS}.")
    if cfg.zero_stage not in (0, 1):
        raise ConfigError(f"zero_stage={cfg.zero_stage}: pipeline parallelism supports ZeRO stage 0 or 1 only.")
    if cfg.precision == "bf16" and cfg.zero_stage == 0:
        raise ConfigError("precision=bf16 with zero_stage=0 cannot reload its own checkpoints in DeepSpeed "
                          "(KeyError in the bf16 optimizer's loader); use zero_stage=1.")
    check_offload(cfg)
    if cfg.lr_scheduler not in SCHEDULERS:
        raise ConfigError(f"lr_scheduler '{cfg.lr_scheduler}' is not one of {SCHEDULERS}.")
    if cfg.micro_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("micro_batch_size and gradient_accumulation_steps must be at least 1.")
    check_pipeline_schedule(cfg)
    if cfg.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"nan_policy '{cfg.nan_policy}' is not one of ('stop', 'skip').")
    if not cfg.preemption_grace_seconds > 0:
        raise ConfigError(f"preemption_grace_seconds={cfg.preemption_grace_seconds} must be positive: the seconds a "
                          f"SIGTERM leaves to finish the step and save.")
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        raise ConfigError(f"peak_tflops={cfg.peak_tflops} must be a device's positive peak TFLOP/s, or null.")
    check_data_files(cfg)


def offload_device(cfg):
    """cfg.offload_optimizer as a string ('none' for configs without the key; YAML's null reads as none too)."""
    value = cfg.get("offload_optimizer", "none")
    return "none" if value is None else str(value).lower()


def check_offload(cfg):
    device = offload_device(cfg)
    if device not in OFFLOAD_DEVICES:
        raise ConfigError(f"offload_optimizer '{cfg.offload_optimizer}' is not one of {OFFLOAD_DEVICES} (NVMe "
                          f"offload needs ZeRO-3, which pipeline parallelism does not support).")
    if device == "cpu" and cfg.zero_stage != 1:
        raise ConfigError(f"offload_optimizer=cpu needs ZeRO's partitioned optimizer: set zero_stage=1 (got "
                          f"zero_stage={cfg.zero_stage}).")
    if device == "cpu" and cfg.nan_policy == "skip":
        raise ConfigError("nan_policy=skip replaces DeepSpeed's optimizer with a torch AdamW on the device, which "
                          "cannot be offloaded; use nan_policy=stop with offload_optimizer=cpu, or "
                          "offload_optimizer=none.")


def check_pipeline_schedule(cfg):
    if cfg.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline_schedule '{cfg.pipeline_schedule}' is not one of {PIPELINE_SCHEDULES}.")
    cap = cfg.zero_bubble_max_waiting
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise ConfigError(f"zero_bubble_max_waiting={cap!r} is not a number of micro-batches: set an integer >= 0, "
                          f"or null for ZB-H1's (stage s holds s).")
    if cfg.pipeline_schedule != "zero_bubble":
        return
    # fp16's loss scaler is untested with deferred weight gradients (DeepSpeed's CPU accelerator refuses fp16)
    if cfg.precision == "fp16":
        raise ConfigError("pipeline_schedule=zero_bubble does not support precision=fp16 yet (it runs with precision "
                          "fp32 or bf16); use pipeline_schedule=1f1b.")


def data_parallel_size(world_size, num_stages, tensor_parallel_size=1):
    """Data-parallel replicas in world_size devices, or an error naming the split that does not fit it."""
    replica = num_stages * tensor_parallel_size
    split = f"num_stages={num_stages}" + (f" x tensor_parallel_size={tensor_parallel_size}"
                                          if tensor_parallel_size != 1 else "")
    if num_stages < 1 or tensor_parallel_size < 1:
        raise ConfigError(f"{split}: num_stages and tensor_parallel_size must be at least 1.")
    if world_size % replica:
        raise ConfigError(f"{split} does not divide the world size {world_size}: launch (or plan for, with "
                          f"plan_world_size) a multiple of {replica} processes, e.g. deepspeed --num_gpus {replica} "
                          f"..., or change num_stages{'' if tensor_parallel_size == 1 else ' / tensor_parallel_size'}.")
    return world_size // replica


def check_data_files(cfg):
    if cfg.eval_only:
        if not cfg.eval_file:
            raise ConfigError("eval_only=true needs eval_file.")
    elif not cfg.train_file:
        raise ConfigError("train_file is not set; pass train_file=PATH (jsonl, json, parquet or txt).")
    for key in ("train_file", "eval_file"):
        path = cfg.get(key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{key} '{path}' does not exist.")


def deepspeed_config(cfg, total_steps):
    """DeepSpeed's config from the Hydra node, with precision and the LR schedule filled in; monitors are
    returned apart because the trainer drives them itself."""
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    monitors = {key: ds.pop(key) for key in ("tensorboard", "wandb", "csv_monitor", "comet") if key in ds}
    # precision decides which is enabled; other keys of a bf16/fp16 node added under deepspeed are kept
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": cfg.precision == "bf16"}
    ds["fp16"] = {"initial_scale_power": 16, **ds.get("fp16", {}), "enabled": cfg.precision == "fp16"}
    ds["scheduler"] = lr_scheduler_config(cfg, total_steps)
    # DeepSpeed's partitioning of tensors sent between stages assumes they are equal on every tensor-parallel rank;
    # under sequence parallelism each rank already sends only its own tokens.
    ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    if offload_device(cfg) == "cpu":
        # ZeRO-1 keeps its fp32 partition and Adam's moments in pinned host memory; the step runs DeepSpeed's
        # CPU Adam (ops/adam/cpu_adam, JIT-built on first use: scripts/setup.sh prebuilds it).
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        ds["optimizer"]["params"].pop("torch_adam", None)
    return ds, monitors


def lr_scheduler_config(cfg, total_steps):
    # DeepSpeed's schedulers need a warmup of at least one step; warmup_steps=0 means starting at the peak LR.
    warmup = max(1, min(cfg.warmup_steps, total_steps))
    start_ratio = 0.0 if cfg.warmup_steps > 0 else 1.0
    if cfg.lr_scheduler == "cosine":
        # Without warmup, start past iteration -1, where this scheduler would set the first step's LR to 0.
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total_steps, "warmup_num_steps": warmup, "warmup_type": "linear",
            "warmup_min_ratio": start_ratio, "cos_min_ratio": cfg.min_lr_ratio,
            "last_batch_iteration": -1 if cfg.warmup_steps > 0 else 0}}
    params = {"warmup_num_steps": warmup, "warmup_type": "linear", "warmup_min_lr": start_ratio * cfg.learning_rate,
              "warmup_max_lr": cfg.learning_rate}
    if cfg.lr_scheduler == "linear":
        return {"type": "WarmupDecayLR", "params": {"total_num_steps": total_steps, **params}}
    return {"type": "WarmupLR", "params": params}
