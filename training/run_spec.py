"""Check, then build: one pass turns a run's Hydra config into a RunSpec, the validated description that every
builder (topology, stages, data, engine, memory plan) takes what it needs from.

Every rule of a run runs from here, in the order that lets each message name the real cause: what the config alone
says (training/config_checks.py), the data files (data/file_checks.py), the converted model, the layout against
the world size and the model, then the checkpoint a run resumes (training/resume.py). All of it runs before any
process group or file write, identically on every rank, so all ranks fail together with one line that names the
bad value and what to do. Nothing here changes the config it checks."""
import dataclasses
import math
import os
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

from checkpoints.files import has_tokenizer_files, read_latest
from checkpoints.mtp_tensors import carried_mtp_names
from checkpoints.integrity import manifest_digest, verify_model_side_files
from data.file_checks import check_data_files, check_shards_fit_model
from errors import ConfigError
from models.architecture import architecture_of, check_model_config, check_trains_as_configured
from models.context_parallel import context_parallel_error
from models.expert_parallel import expert_parallel_error
from models.layout import layer_file_name, text_config_of
from models.lora import adapter_parameter_total, check_lora_applies, check_rank_fits
from models.partition import decoder_counts_of_bounds, decoder_kinds, layer_parameter_counts, timed_kind
from models.pipeline import check_own_layers_parallelism, partition_stages
from models.preference import PreferenceSettings
from models.tensor_parallel import check_tensor_parallel_split
from planner.chunk_balance import balanced_chunk_counts
from planner.measured_costs import measured_stage_cost, uses_measured_costs
from planner.stage_costs import StageCostModel
from planner.training_state import checkpoint_bytes_per_parameter
from planner.workload import Workload
from schedules.rules import chunks_per_rank
from training.config_checks import check_torch_kernels, checked_config, moe_model_config, mtp_model_config
from training.resume import check_output_dir_is_ours, check_resume, resolve_resume, with_resume


class ConvertedModel(NamedTuple):
    """The converted checkpoint a run starts from, as a LoRA run's adapters and a DPO run's reference
    log-probabilities record it: a resume checks that the same one is loaded under them."""
    path: str  # model_name_or_path, absolute
    tag: str  # the tag its 'latest' names
    digest: str | None  # its manifest's checksum (None: a directory converted before manifests)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A validated run. cfg holds every key of conf/base.yaml (its defaults where the run's config lacks one)."""
    cfg: DictConfig
    model_config: object  # transformers' PretrainedConfig
    world_size: int
    workload: Workload
    stage_bounds: tuple  # first pipeline layer of each stage, then the layer count
    model_files_dir: str | None = None  # config.json and tokenizer of the converted checkpoint (None: planning)
    tokenizer_dir: str | None = None  # None: pre-tokenized data needs none
    resume_from: tuple | None = None  # (checkpoint dir, tag)
    trainer_state: dict = dataclasses.field(default_factory=dict)
    unit_costs: object = None  # planner/measured_costs.py UnitCosts `balanced` weighed stages by (None: FLOPs)
    # read once at the start when LoRA or DPO records it; None otherwise and when planning
    converted_model: ConvertedModel | None = None
    # whether saves write in the background: async_save=true, or auto's verdict, which the job agrees on once its
    # process group is up (training/loop.py run); the config keeps what it declares
    async_save: bool = False

    @property
    def num_stages(self):
        return self.cfg.num_stages

    @property
    def tensor_parallel(self):
        return self.cfg.tensor_parallel_size

    @property
    def data_parallel(self):
        return self.workload.data_parallel

    @property
    def layout(self):
        """What a checkpoint's optimizer state is laid out by: the parallel degrees and the layers of each stage
        (the balanced partition moves with the workload: sequence length, micro-batches, checkpointing, schedule)."""
        layout = {"num_stages": self.num_stages, "data_parallel": self.data_parallel}
        if self.tensor_parallel > 1:
            layout["tensor_parallel"] = self.tensor_parallel
        if self.workload.context_parallel > 1:
            layout["context_parallel"] = self.workload.context_parallel
        if self.workload.expert_parallel > 1:
            layout["expert_parallel"] = self.workload.expert_parallel
        return {**layout, "stage_bounds": list(self.stage_bounds)}

    @property
    def samples_per_step(self):
        """Sequences (preference: pairs) of a step's global batch."""
        return self.data_parallel * self.cfg.micro_batch_size * self.cfg.gradient_accumulation_steps

    @property
    def settings(self):
        """What else a checkpoint's training state is written under; a resume may change any of it."""
        cfg = self.cfg
        return {"precision": cfg.precision, "zero_stage": cfg.zero_stage, "offload_optimizer": cfg.offload_optimizer,
                "pipeline_schedule": cfg.pipeline_schedule,
                "global_batch_size": self.samples_per_step,
                # the epoch's order: a resume under other buckets goes on in theirs (docs/data.md#length-buckets)
                "length_buckets": list(cfg.data.length_buckets or [])}

    @property
    def lora(self):
        return self.workload.lora

    @property
    def preference(self):
        return PreferenceSettings.from_cfg(self.cfg)

    @property
    def reference_checkpoint(self):
        """DPO: the manifest checksum of the checkpoint whose weights are the reference (the converted model the
        run starts from; under LoRA its base), which the stored reference log-probabilities are keyed by."""
        return self.converted_model.digest

    @property
    def reference_record(self):
        """What a DPO checkpoint records in trainer_state.json of its reference: the checkpoint it was computed
        from, checked on resume; {} otherwise."""
        return {"reference": {"checkpoint": self.reference_checkpoint}} if self.preference.needs_reference else {}

    @property
    def trained_parameters(self):
        """Parameters a checkpoint saves: the whole model's, or under LoRA the adapters' (over all tensor-parallel
        ranks)."""
        if self.lora.enabled:
            return adapter_parameter_total(self.model_config, self.lora)
        return sum(layer_parameter_counts(self.model_config))

    @property
    def checkpoint_bytes(self):
        """The planner's estimate of one training checkpoint on disk (trained weights and optimizer state)."""
        return int(self.trained_parameters * checkpoint_bytes_per_parameter(self.workload))

    @property
    def lora_record(self):
        """What a LoRA checkpoint records in trainer_state.json: its adapters' settings and the converted base it
        trains on, which a resume and an export read the base from; {} otherwise."""
        if not self.lora.enabled:
            return {}
        base = self.converted_model
        return {"lora": self.lora.as_dict(),
                "base_model": {"path": base.path, "tag": base.tag, "manifest_xxh3_128": base.digest}}

    def replanned(self, **workload_changes):
        """The same run with another workload (and the stage bounds the partition gives it)."""
        workload = dataclasses.replace(self.workload, **workload_changes)
        bounds = configured_stage_bounds(self.cfg, self.model_config, workload, self.unit_costs)
        return dataclasses.replace(self, workload=workload, stage_bounds=bounds)

    def with_unit_costs(self, units):
        """The same run partitioned on the device's measured costs (engines/cost_calibration.py); a checkpoint
        whose optimizer state follows its stages' layers is checked against the new ones."""
        bounds = configured_stage_bounds(self.cfg, self.model_config, self.workload, units)
        spec = dataclasses.replace(self, unit_costs=units, stage_bounds=bounds)
        if spec.resume_from:
            check_resume(spec)
        return spec


def run_spec(cfg, world_size):
    """A training or evaluation run on world_size processes: config, converted model, data files and resume."""
    cfg = checked_config(cfg)
    check_data_files(cfg)
    check_output_dir_is_ours(cfg.output_dir, cfg.model_name_or_path)
    model_config, model_files_dir = load_model_config(cfg.model_name_or_path, cfg.verify_checksums)
    model_config = mtp_model_config(cfg, moe_model_config(cfg, model_config))
    if cfg.mtp_loss_scale:
        try:  # the MTP layer starts from the converted model's carried tensors (checkpoints/mtp_tensors.py)
            carried_mtp_names(os.path.join(cfg.model_name_or_path, read_latest(cfg.model_name_or_path)), model_config)
        except FileNotFoundError as error:
            raise ConfigError(str(error)) from None
    check_torch_kernels(model_config)
    if not cfg.eval_only:
        try:
            check_trains_as_configured(model_config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    workload = check_layout(cfg, model_config, world_size)
    recorded = workload.lora.enabled or PreferenceSettings.from_cfg(cfg).needs_reference
    spec = RunSpec(cfg, model_config, world_size, workload, configured_stage_bounds(cfg, model_config, workload),
                   model_files_dir, tokenizer_dir(cfg, model_files_dir),
                   converted_model=converted_model(cfg.model_name_or_path) if recorded else None,
                   async_save=cfg.async_save is True)
    if cfg.data.format == "indexed":
        check_shards_fit_model(cfg, model_config.vocab_size, spec.tokenizer_dir)
    # this rank's own look at output_dir, for the checks: rank 0's, once a collective can carry it, decides
    # (agreed_start)
    return with_resume(spec, resolve_resume(cfg.resume, cfg.output_dir))


def plan_spec(cfg, world_size=None, model_config=None):
    """A run to plan (plan_only): no processes, weights or data needed. world_size defaults to plan_world_size,
    model_config to load_plan_model_config's."""
    cfg = checked_config(cfg)
    model_config = mtp_model_config(cfg, moe_model_config(cfg, model_config or load_plan_model_config(cfg)))
    world_size = world_size or plan_world_size(cfg)
    workload = check_layout(cfg, model_config, world_size)
    return RunSpec(cfg, model_config, world_size, workload, configured_stage_bounds(cfg, model_config, workload))


def plan_world_size(cfg):
    """Devices to plan for: plan_world_size, else the launched world size, else one data-parallel replica."""
    return cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", cfg.num_stages * (cfg.tensor_parallel_size or 1)))


# --- the config against the model and the world ----------------------------------------------------------------------

def check_layout(cfg, model_config, world_size):
    """The run's Workload, once its layout fits the world size and the model."""
    stages, tp = cfg.num_stages, cfg.tensor_parallel_size
    data_axis = data_parallel_size(world_size, stages, tp)  # data-parallel x context-parallel ranks
    error = context_parallel_error(cfg.context_parallel_size, cfg.seq_length, data_axis)
    if error:
        raise ConfigError(error)
    workload = Workload.from_cfg(cfg, data_axis // cfg.context_parallel_size)
    moe = architecture_of(model_config).moe
    # the expert-parallel groups are cut from the data axis, context ranks included (models/expert_parallel.py)
    error = expert_parallel_error(cfg.expert_parallel_size, data_axis, moe and moe.num_experts)
    if error:
        raise ConfigError(error)
    check_length_buckets_split(cfg, workload)
    try:
        check_own_layers_parallelism(model_config, cfg.expert_parallel_size)
        check_tensor_parallel_split(model_config, tp, workload.tokens if workload.splits_sequence else None)
        if workload.lora.enabled:
            check_lora_applies(model_config, workload.lora)
            check_rank_fits(model_config, workload.lora)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model_config.num_hidden_layers < stages:
        raise ConfigError(f"num_stages={stages} is more than the model's {model_config.num_hidden_layers} decoder "
                          f"layers (num_hidden_layers); use at most {model_config.num_hidden_layers} stages.")
    if cfg.seq_length > model_config.max_position_embeddings:
        raise ConfigError(f"seq_length={cfg.seq_length} exceeds the model's max_position_embeddings="
                          f"{model_config.max_position_embeddings}; lower seq_length.")
    return workload


def check_length_buckets_split(cfg, workload):
    """Every length bucket splits as seq_length must: into 2 x context_parallel_size equal chunks, and a micro-batch's
    rows' tokens (of a rank's share of each sequence) over the tensor-parallel group under sequence parallelism."""
    context, tensor = workload.context_parallel, workload.tensor_parallel
    multiple = math.lcm(2 * context if context > 1 else 1, tensor * context // math.gcd(
        tensor * context, workload.micro_batch_size) if workload.splits_sequence else 1)
    bad = [length for length in cfg.data.length_buckets or [] if length % multiple]
    if bad:
        splits = ([f"context_parallel_size={context} (2 x {context} equal chunks of each sequence)"] * (context > 1)
                  + [f"tensor_parallel_size={tensor} with sequence_parallel (a micro-batch's tokens, "
                     f"{workload.micro_batch_size} x the length)"] * workload.splits_sequence)
        raise ConfigError(f"data.length_buckets={list(cfg.data.length_buckets)}: {', '.join(map(str, bad))} "
                          f"{'does' if len(bad) == 1 else 'do'} not split over {' and '.join(splits)}; use lengths "
                          f"that are multiples of {multiple}.")


def data_parallel_size(world_size, num_stages, tensor_parallel_size=1):
    """Data-parallel replicas in world_size devices, or an error naming the split that does not fit it."""
    replica = num_stages * tensor_parallel_size
    split = f"num_stages={num_stages}" + (f" x tensor_parallel_size={tensor_parallel_size}"
                                          if tensor_parallel_size != 1 else "")
    if world_size % replica:
        raise ConfigError(f"{split} does not divide the world size {world_size}: launch (or plan for, with "
                          f"plan_world_size) a multiple of {replica} processes, e.g. deepspeed --num_gpus {replica} "
                          f"..., or change num_stages{'' if tensor_parallel_size == 1 else ' / tensor_parallel_size'}.")
    return world_size // replica


# --- the stages ------------------------------------------------------------------------------------------------------

def configured_stage_bounds(cfg, model_config, workload, units=None):
    """The stage bounds cfg.partition gives this workload (a method name or a list of decoder layers per stage);
    under a schedule with several chunks per rank, the bounds of every global chunk (models/partition.py's
    chunk_bounds), `balanced` minimising the schedule's simulated step (planner/chunk_balance.py). units: the
    measured costs `balanced` weighs compute by (planner/measured_costs.py; None: the plan's FLOPs)."""
    partition = cfg.partition if isinstance(cfg.partition, str) else list(cfg.partition)
    chunks = cfg.num_stages * chunks_per_rank(cfg.pipeline_schedule, cfg.virtual_stages)
    check_chunk_count(cfg, chunks, model_config.num_hidden_layers, partition)
    if uses_measured_costs(cfg) and len({timed_kind(kind) for kind in decoder_kinds(model_config)}) > 1:
        raise ConfigError(f"partition_costs={cfg.partition_costs} times one decoder layer, and "
                          f"{model_config.model_type}'s are of two kinds (dense and sparse); set "
                          f"partition_costs=flops.")
    cost = None
    if partition == "balanced" and chunks == cfg.num_stages:
        model = StageCostModel(model_config, workload, cfg.num_stages, cfg.device_memory_gb * 2**30)
        cost = model.cost if units is None else measured_stage_cost(model, units)
    try:
        if partition == "balanced" and chunks > cfg.num_stages:
            partition = balanced_chunk_counts(model_config, workload, cfg.num_stages, units)
        bounds = tuple(partition_stages(model_config, chunks, partition, cost))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    counts = decoder_counts_of_bounds(bounds)
    if workload.lora.enabled and 0 in counts:
        raise ConfigError(f"partition {counts} (decoder layers per stage) leaves stage {counts.index(0)} without a "
                          f"decoder layer: under LoRA it would hold no adapter, nothing to train; give every stage "
                          f"at least one decoder layer.")
    return bounds


def check_chunk_count(cfg, chunks, num_hidden_layers, partition):
    """A schedule with several chunks per rank needs a decoder layer per chunk, and a list partition one entry each."""
    if chunks == cfg.num_stages:
        return
    if chunks > num_hidden_layers:
        fix = (f"use virtual_stages={num_hidden_layers // cfg.num_stages} or less" if num_hidden_layers >= 2 *
               cfg.num_stages and cfg.pipeline_schedule == "interleaved_1f1b" else
               f"use num_stages={num_hidden_layers // chunks_per_rank(cfg.pipeline_schedule, cfg.virtual_stages)} "
               f"or less")
        raise ConfigError(f"pipeline_schedule={cfg.pipeline_schedule} splits the model into {chunks} chunks "
                          f"({cfg.num_stages} stages x {chunks // cfg.num_stages}), more than its {num_hidden_layers} "
                          f"decoder layers: {fix}.")
    if not isinstance(partition, str) and len(partition) != chunks:
        raise ConfigError(f"partition {partition} has {len(partition)} entries: pipeline_schedule="
                          f"{cfg.pipeline_schedule} splits the model into {chunks} chunks ({cfg.num_stages} stages x "
                          f"{chunks // cfg.num_stages}); give decoder layers per chunk, {chunks} entries.")


# --- the files a run starts from ---------------------------------------------------------------------------------

def load_model_config(model_dir, verify_checksums):
    """The model config of a converted checkpoint directory and the directory holding it, or an error that says
    how to make one; verify_checksums: its config and tokenizer files against their manifest first."""
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
    if verify_checksums:
        verify_model_side_files(side_dir)
    config = AutoConfig.from_pretrained(side_dir)
    check_model_config(config)
    # a multimodal checkpoint's language model is trained (its towers carried: checkpoints/saving.py)
    return text_config_of(config), side_dir


def load_plan_model_config(cfg):
    """The model config to plan for: config.json in model_name_or_path (a Hugging Face or a converted directory;
    no weights are read), else the published config written into the run config's model_config node."""
    path = cfg.model_name_or_path
    if os.path.isfile(os.path.join(str(path), "config.json")):
        config = AutoConfig.from_pretrained(path)
    elif cfg.model_config:
        fields = OmegaConf.to_container(cfg.model_config, resolve=True)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        raise ConfigError(f"plan_only needs a model config: '{path}' has no config.json and model_config is not "
                          f"set; point model_name_or_path at a Hugging Face or converted directory.")
    check_model_config(config)
    return text_config_of(config)


def tokenizer_dir(cfg, model_files_dir):
    """Where the run's tokenizer is (tokenizer_name_or_path, else the converted model's directory), or None when
    every data file is pre-tokenized and none is needed; an error naming the directory and the key when one is
    needed and missing. Token shards need none, but are checked against it when there is one."""
    if cfg.data.format == "pretokenized":
        return None
    path = cfg.tokenizer_name_or_path or model_files_dir
    if not has_tokenizer_files(path):
        if cfg.data.format == "indexed" and not cfg.tokenizer_name_or_path:
            return None
        source = "tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model_name_or_path"
        raise ConfigError(f"data.format={cfg.data.format} needs a tokenizer, and '{path}' ({source}) holds no "
                          f"tokenizer files (tokenizer.json, tokenizer.model, tokenizer_config.json, ...); set "
                          f"tokenizer_name_or_path to the directory of the model's tokenizer, or pre-tokenize the "
                          f"data (data.format=pretokenized, lines of input_ids).")
    return path


def converted_model(model_dir):
    """The ConvertedModel at model_dir (its 'latest' tag and the manifest's checksum), read once for the run."""
    path = os.path.abspath(model_dir)
    tag = read_latest(path)
    return ConvertedModel(path, tag, manifest_digest(os.path.join(path, tag)))
