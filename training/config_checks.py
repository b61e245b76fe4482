"""What the config alone says, before any file, model or world size is looked at: every key is one of
conf/base.yaml's, each value one its key allows, and the rules between keys hold. training/run_spec.py runs this
first, then the checks that need files, the model and the world."""
import difflib
import os

import torch
from omegaconf import ListConfig, OmegaConf

from checkpoints.background_save import ASYNC_SAVE_SETTINGS
from cluster.console import LOG_LEVELS
from errors import ConfigError
from evaluation.eval_task import EvalTask
from data.formats import DataSettings
from models.architecture import architecture_of
from models.lora import LoraSettings
from models.multi_token_prediction import mtp_layout_of
from models.pipeline import ATTENTION_IMPLS, LOSS_IMPLS, PRECISION_DTYPES
from models.preference import PreferenceSettings
from planner.measured_costs import PARTITION_COSTS, measured_costs_unsupported
from resilience.hang_watchdog import longest_limit
from schedules.orders import PIPELINE_SCHEDULES
from schedules.zbv_order import ZBV_TIMES_SPREAD

BASE_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "base.yaml")
FREE_FORM_NODES = ("deepspeed", "model_config")  # DeepSpeed's own keys; a published config.json's fields
PRECISIONS = tuple(PRECISION_DTYPES)
SCHEDULERS = ("cosine", "linear", "constant")
OFFLOAD_DEVICES = ("none", "cpu")
NAN_POLICIES = ("stop", "skip")
BALANCING_PAPER_VALUES = {"bias_update_rate": 0.001, "sequence_aux_loss_coef": 0.0001}
INDEXED_IGNORES = ("packing", "overlong", "cache_dir")  # data keys of tokenizing, which data.format=indexed skips


def checked_config(cfg):
    """A new config: cfg with conf/base.yaml's defaults under it and its nulls read as their defaults, after every
    check that needs nothing but the config (the checks only read it)."""
    base = OmegaConf.load(BASE_CONFIG)
    for node in ("defaults", "hydra"):
        base.pop(node)
    check_known_keys(OmegaConf.to_container(cfg), OmegaConf.to_container(base))
    cfg = OmegaConf.merge(base, cfg)
    # YAML's null (and configs written before these keys) read as their defaults.
    cfg.offload_optimizer = "none" if cfg.offload_optimizer is None else str(cfg.offload_optimizer).lower()
    cfg.tensor_parallel_size = 1 if cfg.tensor_parallel_size is None else cfg.tensor_parallel_size
    if cfg.hang_watchdog.startup_seconds is None:  # below the collectives' timeout by construction
        cfg.hang_watchdog.startup_seconds = longest_limit(cfg.dist_timeout_minutes)
    check_values(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


def check_known_keys(cfg, schema, prefix=""):
    """Every key is one of conf/base.yaml's (any key under its free-form nodes): a misspelt key, or one added with
    Hydra's `++`, would otherwise be ignored silently. cfg and schema: plain dicts (OmegaConf.to_container)."""
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if key not in schema:
            close = difflib.get_close_matches(str(key), [str(k) for k in schema], n=3)
            hint = f"did you mean {' or '.join(prefix + k for k in close)}? " if close else ""
            raise ConfigError(f"unknown config key '{name}': {hint}every key of a run is listed, with its meaning, "
                              f"in conf/base.yaml (DeepSpeed's own keys go under deepspeed.).")
        if name not in FREE_FORM_NODES and isinstance(value, dict) and isinstance(schema[key], dict):
            check_known_keys(value, schema[key], f"{name}.")


def check_values(cfg):
    """Each key's allowed values, and the rules between keys that need no model or world size."""
    choices = {"precision": PRECISIONS, "lr_scheduler": SCHEDULERS, "offload_optimizer": OFFLOAD_DEVICES,
               "pipeline_schedule": PIPELINE_SCHEDULES, "nan_policy": NAN_POLICIES, "attention_impl": ATTENTION_IMPLS,
               "loss_impl": LOSS_IMPLS, "async_save": ASYNC_SAVE_SETTINGS, "log_level": LOG_LEVELS}
    for key, allowed in choices.items():
        if cfg[key] not in allowed:
            extra = (" (NVMe offload needs ZeRO-3, which pipeline parallelism does not support)"
                     if key == "offload_optimizer" else "")
            raise ConfigError(f"{key} '{cfg[key]}' is not one of {allowed}{extra}.")
    if cfg.num_stages < 1 or cfg.tensor_parallel_size < 1:
        raise ConfigError(f"num_stages={cfg.num_stages}, tensor_parallel_size={cfg.tensor_parallel_size}: both "
                          f"must be at least 1.")
    if cfg.expert_parallel_size < 1:
        raise ConfigError(f"expert_parallel_size={cfg.expert_parallel_size} must be at least 1 (1: every rank holds "
                          f"every expert).")
    if cfg.zero_stage not in (0, 1):
        raise ConfigError(f"zero_stage={cfg.zero_stage}: pipeline parallelism supports ZeRO stage 0 or 1 only.")
    if cfg.precision != "fp32" and cfg.zero_stage == 0:
        raise ConfigError(f"precision={cfg.precision} with zero_stage=0: below fp32 a checkpoint takes the fp32 master "
                          f"weights and moments from ZeRO's partitions (checkpoints/optimizer_state.py); use "
                          f"zero_stage=1.")
    check_grad_accum_dtype(cfg)
    check_offload(cfg)
    chunk = cfg.loss_chunk_tokens
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ConfigError(f"loss_chunk_tokens={chunk!r} must be a positive number of tokens (the LM head and loss "
                          f"run that many at a time; 1024 by default).")
    if cfg.micro_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("micro_batch_size and gradient_accumulation_steps must be at least 1.")
    check_zero_bubble(cfg)
    check_chunk_schedule(cfg)
    check_zbv_times(cfg)
    check_partition_costs(cfg)
    if not cfg.preemption_grace_seconds > 0:
        raise ConfigError(f"preemption_grace_seconds={cfg.preemption_grace_seconds} must be positive: the seconds a "
                          f"SIGTERM leaves to finish the step and save.")
    if not cfg.data_build_timeout_minutes > 0:
        raise ConfigError(f"data_build_timeout_minutes={cfg.data_build_timeout_minutes} must be positive: the "
                          f"minutes the other ranks wait for rank 0 to tokenize or index the data on a first start.")
    check_hang_watchdog(cfg.hang_watchdog, cfg.dist_timeout_minutes)
    if not cfg.straggler_margin > 0:
        raise ConfigError(f"straggler_margin={cfg.straggler_margin} must be positive: how much slower than its peers "
                          f"a rank or stage computes before it is named (0.25: 25%).")
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        raise ConfigError(f"peak_tflops={cfg.peak_tflops} must be a device's positive peak TFLOP/s, or null.")
    if not cfg.device_memory_gb > 0:
        raise ConfigError(f"device_memory_gb={cfg.device_memory_gb} must be the positive GiB each device has: the "
                          f"memory plan checks against it and partition=balanced fills no stage past it.")
    try:
        DataSettings.from_cfg(cfg.data)  # data.format, data.overlong, data.bad_lines
        LoraSettings.from_cfg(cfg.lora)
        preference = PreferenceSettings.from_cfg(cfg)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_preference(cfg, preference)
    if cfg.output_router_logits not in (None, True, False):
        raise ConfigError(f"output_router_logits={cfg.output_router_logits!r} must be true, false or null (null: as "
                          f"the checkpoint's config.json says).")
    check_balancing(cfg.moe)
    scale = cfg.mtp_loss_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
        raise ConfigError(f"mtp_loss_scale={scale!r} must be a number >= 0 (0: the multi-token-prediction layer is "
                          f"carried untouched; Megatron-Bridge trains Qwen3.5's with 0.1).")
    check_token_shard_keys(cfg)
    check_length_buckets(cfg)
    for entry in cfg.eval_tasks:
        EvalTask.from_entry(entry)


def check_balancing(moe):
    """moe.bias_update_rate and moe.sequence_aux_loss_coef: numbers >= 0 (0: off); moe.rank_load_warning: 0 (off)
    or a multiple of the balanced share above 1; moe.checkpoint_keeps_rows: a boolean."""
    for key in BALANCING_PAPER_VALUES:
        value = moe[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"moe.{key}={value!r} must be a number >= 0 (0: off; DeepSeek-V3's paper used "
                              f"{BALANCING_PAPER_VALUES[key]}).")
    value = moe["rank_load_warning"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or value > 1):
        raise ConfigError(f"moe.rank_load_warning={value!r} must be a multiple of a rank's balanced share of the "
                          f"routed tokens above 1 (2.0: twice its share), or 0 for no warning.")
    if not isinstance(moe["checkpoint_keeps_rows"], bool):
        raise ConfigError(f"moe.checkpoint_keeps_rows={moe['checkpoint_keeps_rows']!r} must be true (a checkpointed "
                          f"sparse layer keeps its exchanged rows) or false (exchanges them again in backward).")


def check_token_shard_keys(cfg):
    """Token shards are tokenized and cut already: the keys that shape tokenizing would be ignored, so one set away
    from its default is refused by name."""
    if cfg.data.format != "indexed":
        return
    defaults = OmegaConf.load(BASE_CONFIG).data
    for key in INDEXED_IGNORES:
        if cfg.data[key] != defaults[key]:
            value = str(cfg.data[key]).lower() if isinstance(cfg.data[key], bool) else cfg.data[key]
            raise ConfigError(f"data.{key}={value} does nothing with data.format=indexed (token shards are cut into "
                              f"samples of seq_length + 1 tokens as prepare_data.py wrote them, docs/data.md); "
                              f"remove it.")


def check_length_buckets(cfg):
    """data.length_buckets: ascending row lengths up to seq_length, for the formats whose rows are padded."""
    buckets = cfg.data.length_buckets
    if not buckets:
        return
    shown = OmegaConf.to_container(buckets) if isinstance(buckets, ListConfig) else buckets
    if not (isinstance(shown, list) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shown)
            and shown == sorted(set(shown)) and shown[-1] <= cfg.seq_length):
        raise ConfigError(f"data.length_buckets={shown} is not a list of row lengths: set ascending positive token "
                          f"counts up to seq_length={cfg.seq_length}, e.g. [256, 512, 1024] (rows longer than the "
                          f"last pad to seq_length), or [] to pad every row to seq_length.")
    if cfg.data.format in ("text", "indexed"):
        raise ConfigError(f"data.length_buckets={shown} with data.format={cfg.data.format}: its rows fill seq_length "
                          f"(documents are cut into blocks of it), so there is nothing to bucket; remove "
                          f"data.length_buckets.")


def check_hang_watchdog(watchdog, dist_timeout_minutes):
    """The watchdog's limits, each below the collectives' timeout: a hang the watchdog would name later is ended by a
    collective's timeout first, without a stack or a record (on NCCL, an abort)."""
    if watchdog.step_time_factor < 2:
        raise ConfigError(f"hang_watchdog.step_time_factor={watchdog.step_time_factor} is too short for the measured "
                          f"step time: steps vary, and a rank that is only slow must not be ended; use at least 2 "
                          f"(10 by default).")
    for key in ("min_step_seconds", "startup_seconds"):
        if not watchdog[key] > 0:
            raise ConfigError(f"hang_watchdog.{key}={watchdog[key]} must be a positive number of seconds.")
        if watchdog.enabled and watchdog[key] >= 60 * dist_timeout_minutes:
            raise ConfigError(f"hang_watchdog.{key}={watchdog[key]} is not below dist_timeout_minutes="
                              f"{dist_timeout_minutes} (x 60 s): a collective's timeout would end a hung "
                              f"{'step' if key == 'min_step_seconds' else 'start or save'} first, without naming "
                              f"where it stopped; lower the first or raise the second.")


def check_preference(cfg, preference):
    """A preference objective reads pairs, through the chunked head, one sequence per row; pairs need one."""
    if preference.preference and cfg.data.format != "preference":
        raise ConfigError(f"objective={cfg.objective} trains on preference pairs: set data.format=preference "
                          f"(records with TRL's prompt, chosen and rejected fields), not {cfg.data.format}.")
    if not preference.preference and cfg.data.format == "preference":
        raise ConfigError("data.format=preference holds pairs: set objective=dpo (or simpo) to train on them.")
    if not preference.preference:
        return
    if cfg.loss_impl != "chunked":
        raise ConfigError(f"objective={cfg.objective} with loss_impl={cfg.loss_impl}: the preference losses run on "
                          f"the chunked head only; set loss_impl=chunked.")


def check_grad_accum_dtype(cfg):
    if cfg.grad_accum_dtype not in ("fp32", cfg.precision):
        raise ConfigError(f"grad_accum_dtype={cfg.grad_accum_dtype} with precision={cfg.precision}: micro-batch "
                          f"gradients are summed in fp32 or in the model's dtype; set grad_accum_dtype=fp32.")
    # DeepSpeed's own key, which grad_accum_dtype fills in (training/deepspeed_config.py)
    deepspeed_key = OmegaConf.select(cfg, "deepspeed.data_types.grad_accum_dtype")
    if deepspeed_key is not None and deepspeed_key != cfg.grad_accum_dtype:
        raise ConfigError(f"deepspeed.data_types.grad_accum_dtype={deepspeed_key} contradicts grad_accum_dtype="
                          f"{cfg.grad_accum_dtype}: set grad_accum_dtype only.")


def check_offload(cfg):
    if cfg.offload_optimizer == "cpu" and cfg.zero_stage != 1:
        raise ConfigError(f"offload_optimizer=cpu needs ZeRO's partitioned optimizer: set zero_stage=1 (got "
                          f"zero_stage={cfg.zero_stage}).")
    if cfg.offload_optimizer == "cpu" and cfg.nan_policy == "skip":
        raise ConfigError("nan_policy=skip replaces DeepSpeed's optimizer with a torch AdamW on the device, which "
                          "cannot be offloaded; use nan_policy=stop with offload_optimizer=cpu, or "
                          "offload_optimizer=none.")


def check_zero_bubble(cfg):
    cap = cfg.zero_bubble_max_waiting
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise ConfigError(f"zero_bubble_max_waiting={cap!r} is not a number of micro-batches: set an integer >= 0, "
                          f"or null for ZB-H1's (stage s holds s).")
    if cap is not None and cfg.pipeline_schedule not in ("zero_bubble", "zbv"):
        raise ConfigError(f"zero_bubble_max_waiting={cap} applies to pipeline_schedule=zero_bubble or zbv only (not "
                          f"{cfg.pipeline_schedule}, whose backward is never split); set zero_bubble_max_waiting=null, "
                          f"or one of those schedules.")


def check_zbv_times(cfg):
    """zbv_times: a chunk's F, B and W times (all ranks alike, or one [F, B, W] per rank), positive numbers within
    ZBV_TIMES_SPREAD of each other, or auto (measured by the trainer; the default, which other schedules ignore)."""
    times = cfg.zbv_times
    if times is None or times == "auto":
        return
    shown = OmegaConf.to_container(times) if isinstance(times, ListConfig) else times
    if cfg.pipeline_schedule != "zbv":
        raise ConfigError(f"zbv_times={shown} applies to pipeline_schedule=zbv only (not {cfg.pipeline_schedule}); set "
                          f"zbv_times=null, or pipeline_schedule=zbv.")
    per_rank = shown if isinstance(shown, list) and shown and isinstance(shown[0], list) else [shown]
    numbers = [t for rank_times in per_rank if isinstance(rank_times, list) and len(rank_times) == 3 for t in rank_times
               if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0]
    if (len(per_rank) not in (1, cfg.num_stages) or len(numbers) != 3 * len(per_rank)
            or max(numbers) > ZBV_TIMES_SPREAD * min(numbers)):
        raise ConfigError(f"zbv_times={shown} is not a chunk's [F, B, W] times: set three positive numbers within "
                          f"{ZBV_TIMES_SPREAD}x of each other (the forward, input-gradient and weight-gradient times "
                          f"profile=true measures), or one such [F, B, W] per stage ({cfg.num_stages}), auto to have "
                          f"the trainer measure them, or null for F = B = W.")


def check_partition_costs(cfg):
    """partition_costs: flops, measured or auto; measured times unsplit layers (planner/measured_costs.py)."""
    if cfg.partition_costs not in PARTITION_COSTS:
        raise ConfigError(f"partition_costs={cfg.partition_costs!r} is not one of {', '.join(PARTITION_COSTS)}.")
    if cfg.partition_costs == "measured" and (unsupported := measured_costs_unsupported(cfg)):
        raise ConfigError(f"partition_costs=measured cannot time this run's layers under {unsupported} (it times one "
                          f"unsplit layer); set partition_costs=flops or auto.")


def check_chunk_schedule(cfg):
    """interleaved_1f1b's chunks per rank, and the micro-batch counts Megatron's interleaved order serves."""
    virtual = cfg.virtual_stages
    if cfg.pipeline_schedule != "interleaved_1f1b":
        if virtual is not None:
            raise ConfigError(f"virtual_stages={virtual} applies to pipeline_schedule=interleaved_1f1b only (not "
                              f"{cfg.pipeline_schedule}); set virtual_stages=null, or pipeline_schedule="
                              f"interleaved_1f1b.")
        return
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 2:
        raise ConfigError(f"pipeline_schedule=interleaved_1f1b with virtual_stages="
                          f"{'null' if virtual is None else virtual}: set virtual_stages=2 "
                          f"or more (chunks of layers per rank).")
    stages, micro_batches = cfg.num_stages, cfg.gradient_accumulation_steps
    if micro_batches % stages:
        fit = -(-micro_batches // stages) * stages
        raise ConfigError(f"gradient_accumulation_steps={micro_batches} with pipeline_schedule=interleaved_1f1b on "
                          f"num_stages={stages}: Megatron's interleaved order takes micro-batches in groups of "
                          f"{stages}; use gradient_accumulation_steps={fit} (a multiple of {stages}).")



# What a mixture-of-experts model is not tested under, or cannot do yet: {key: (whether a value is refused, why and
# what to set instead)}.
MOE_REFUSED = {
    "compile": (lambda value: bool(value), "its data-dependent routing is not compiled yet; use compile=false"),
}


# What expert parallelism is not tested under yet: {key: (whether a value is refused, what to set instead)}.
EXPERT_PARALLEL_REFUSED = {
    "offload_optimizer": (lambda value: value != "none", "use offload_optimizer=none"),
    "nan_policy": (lambda value: value == "skip", "use nan_policy=stop"),
    "lora.rank": (lambda value: value > 0, "train without LoRA (lora.rank=0)"),  # its expert slices unreduced
}


GROUPED_MM_TORCH = "2.10"  # the first torch with torch.nn.functional.grouped_mm (its own kernels: CPU, CUDA sm90/sm100)


def check_torch_kernels(model_config):
    """A mixture of experts runs its experts through torch.nn.functional.grouped_mm (models/weight_grads.py):
    refused in one line, before any process group, on a torch without it."""
    if architecture_of(model_config).moe and not hasattr(torch.nn.functional, "grouped_mm"):
        raise ConfigError(f"the mixture of experts {model_config.model_type} runs its experts through "
                          f"torch.nn.functional.grouped_mm, which torch {torch.__version__} lacks (torch "
                          f"{GROUPED_MM_TORCH} added it): install torch>={GROUPED_MM_TORCH}.")


# What a run training the MTP layer (mtp_loss_scale > 0) does not combine with (docs/deepseek-v3.md says why):
# {key: (refused?, why)}.
MTP_REFUSED = {
    "lora.rank": (lambda v: v > 0, "a LoRA run exports a peft adapter of transformers' model, which has no MTP layer "
                                   "(transformers drops mtp.* and layer L) to hold the MTP layer's adapters or weights"),
    "objective": (lambda v: v != "sft", "the preference losses have no MTP term"),
}


def mtp_model_config(cfg, model_config):
    """The model config a run builds, with the run's mtp_loss_scale on it (the pipeline's layers read it: the next
    tokens' embedding travels, the final norm's layer holds the MTP layer), after refusing in one line a model
    without an MTP layer the pipeline trains and the settings it does not combine with yet."""
    if not cfg.mtp_loss_scale:
        return model_config
    try:
        mtp_layout_of(model_config)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for key, (refused, why) in MTP_REFUSED.items():
        value = OmegaConf.select(cfg, key)
        if refused(value):
            raise ConfigError(f"{key}={value} with mtp_loss_scale={cfg.mtp_loss_scale}: {why}; set {key} back or "
                              f"mtp_loss_scale=0 (docs/deepseek-v3.md#multi-token-prediction).")
    model_config.mtp_loss_scale = float(cfg.mtp_loss_scale)
    return model_config


def moe_model_config(cfg, model_config):
    """The model config a run builds: an MoE model's with output_router_logits set as the run says (null: as its
    config.json does, but under objective=dpo on whenever router_aux_loss_coef is nonzero, as TRL's DPOTrainer
    asks for the router logits then) and DeepSeek's sequence-wise loss coefficient (moe.sequence_aux_loss_coef),
    after refusing in one line each setting an MoE model is not tested under; a dense model's as it is, where
    output_router_logits must be null. moe.bias_update_rate and moe.sequence_aux_loss_coef apply to DeepSeek-V3's
    router only."""
    moe = architecture_of(model_config).moe
    for key in BALANCING_PAPER_VALUES:
        value = cfg.moe[key]
        if value and not (moe and moe.sigmoid_routing):
            raise ConfigError(f"moe.{key}={value} applies to DeepSeek-V3's router (deepseek_v3, glm4_moe), and "
                              f"{model_config.model_type} has {'another router' if moe else 'no router'}; set "
                              f"moe.{key}=0.")
    if moe is None:
        if cfg.output_router_logits is not None:
            raise ConfigError(f"output_router_logits={cfg.output_router_logits} asks for the load-balancing loss of a "
                              f"mixture of experts, and {model_config.model_type} has no router; leave it null.")
        return model_config
    if cfg.moe.bias_update_rate and cfg.lora.rank:
        raise ConfigError(f"moe.bias_update_rate={cfg.moe.bias_update_rate} with lora.rank={cfg.lora.rank}: the "
                          f"correction biases belong to the frozen base, which a LoRA checkpoint does not save; set "
                          f"moe.bias_update_rate=0.")
    if cfg.moe.sequence_aux_loss_coef and cfg.objective != "sft":
        raise ConfigError(f"moe.sequence_aux_loss_coef={cfg.moe.sequence_aux_loss_coef} with objective="
                          f"{cfg.objective}: TRL's preference trainers add transformers' auxiliary loss only, which "
                          f"these families have none of; set moe.sequence_aux_loss_coef=0.")
    for key, (refused, why) in MOE_REFUSED.items():
        value = OmegaConf.select(cfg, key)
        if refused(value):
            raise ConfigError(f"{key}={value} with the mixture-of-experts model {model_config.model_type}: {why} "
                              f"(docs/moe.md).")
    for key, (refused, instead) in EXPERT_PARALLEL_REFUSED.items():
        value = OmegaConf.select(cfg, key)
        if cfg.expert_parallel_size > 1 and refused(value):
            raise ConfigError(f"{key}={value} with expert_parallel_size={cfg.expert_parallel_size}: not tested "
                              f"with experts split across ranks yet; {instead} or expert_parallel_size=1 "
                              f"(docs/moe.md).")
    if cfg.output_router_logits is not None:
        model_config.output_router_logits = cfg.output_router_logits
    elif cfg.objective == "dpo":
        model_config.output_router_logits = bool(getattr(model_config, "router_aux_loss_coef", 0.0))
    model_config.sequence_aux_loss_coef = float(cfg.moe.sequence_aux_loss_coef)  # the MoE block's (models/moe.py)
    return model_config
