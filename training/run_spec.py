"""Check, then build: one pass turns a run's Hydra config into a RunSpec, the validated description that every
builder (topology, stages, data, engine, memory plan) takes what it needs from. Every rule of a run runs from here:
what the config alone says (training/config_checks.py), then the layout against the world size and the model, the
data files, and the checkpoint a run starts from; all before any process group or file write, identically on every
rank, so all ranks fail together with a message that names the bad value and what to do."""
import dataclasses
import math
import os

from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

from checkpoints.compatibility import check_resume_topology, check_same_model, dropped_state
from checkpoints.files import has_tokenizer_files, read_latest
from checkpoints.integrity import manifest_digest, verify_model_side_files
from checkpoints.optimizer_state import check_optimizer_state_files, has_layout_free_state
from checkpoints.trainer_state import read_trainer_state
from data.indexed import CorpusIndex
from data.shard_files import ShardError, check_sources, parse_sources, read_shard_header, tokenizer_fingerprint
from models.architecture import architecture_of, check_model_config, check_trains_as_configured
from models.layout import layer_file_name, layer_indices_with_files
from models.context_parallel import context_parallel_error
from models.expert_parallel import expert_parallel_error
from models.lora import (LoraSettings, adapter_layer_indices, adapter_parameter_total, check_lora_applies,
                         check_rank_fits)
from models.partition import layer_parameter_counts
from models.preference import PreferenceSettings
from models.tensor_parallel import check_tensor_parallel_split
from planner.training_state import checkpoint_bytes_per_parameter
from planner.workload import Workload
from errors import ConfigError
from training.config_checks import checked_config, moe_model_config
from training.resume import check_fresh_start, check_output_dir_is_ours, resolve_resume
from training.stage_bounds import configured_stage_bounds

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
        base_dir = os.path.abspath(self.cfg.model_name_or_path)
        return manifest_digest(os.path.join(base_dir, read_latest(base_dir)))

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
        trains on (path and manifest checksum), which a resume and an export read the base from; {} otherwise."""
        if not self.lora.enabled:
            return {}
        base_dir = os.path.abspath(self.cfg.model_name_or_path)
        tag_dir = os.path.join(base_dir, read_latest(base_dir))
        return {"lora": self.lora.as_dict(), "base_model": {"path": base_dir, "tag": os.path.basename(tag_dir),
                                                            "manifest_xxh3_128": manifest_digest(tag_dir)}}

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
    model_config = moe_model_config(cfg, model_config)
    if not cfg.eval_only:
        try:
            check_trains_as_configured(model_config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    workload = check_layout(cfg, model_config, world_size)
    spec = RunSpec(cfg, model_config, world_size, workload, configured_stage_bounds(cfg, model_config, workload),
                   model_files_dir, tokenizer_dir(cfg, model_files_dir))
    if cfg.data.format == "indexed":
        check_shards_fit_model(cfg, model_config.vocab_size, spec.tokenizer_dir)
    # this rank's own look at output_dir, for the checks: rank 0's, once a collective can carry it, decides
    # (training/start_point.py)
    return with_resume(spec, resolve_resume(cfg.resume, cfg.output_dir))


def with_resume(spec, resume_from):
    """spec resuming resume_from ((checkpoint dir, tag), or None for a fresh start), once it fits the run."""
    cfg = spec.cfg
    trainer_state = read_trainer_state(os.path.join(*resume_from)) if resume_from else {}
    if resume_from is None and not cfg.eval_only:
        check_fresh_start(cfg.output_dir, cfg.overwrite_output_dir)
    spec = dataclasses.replace(spec, resume_from=resume_from, trainer_state=trainer_state)
    if resume_from:
        check_resume(spec)
    return spec


def check_resume(spec):
    """The checkpoint to resume fits this run: the same model, its state files present, and state that cannot carry
    over to this run's settings dropped only when asked (resume_drop_state)."""
    cfg, trainer_state, tag_dir = spec.cfg, spec.trainer_state, os.path.join(*spec.resume_from)
    check_same_model(tag_dir, spec.model_config)
    check_same_adapters(spec, tag_dir)
    check_same_reference(spec, tag_dir)
    if cfg.eval_only or cfg.resume_weights_only:
        return
    if not has_layout_free_state(trainer_state):
        return check_resume_topology(trainer_state, spec.layout, False, tag_dir)
    config = spec.model_config
    check_optimizer_state_files(tag_dir, trainer_state, adapter_layer_indices(config.num_hidden_layers)
                                if spec.lora.enabled else
                                layer_indices_with_files(config.num_hidden_layers, config.tie_word_embeddings))
    dropped = dropped_state(trainer_state.get("settings", {}), spec.settings)
    if dropped and not cfg.resume_drop_state:
        raise ConfigError(f"resuming {tag_dir} cannot carry over {', '.join(dropped)}; set resume_drop_state=true "
                          f"to start it fresh, or resume with the checkpoint's settings.")


def check_same_reference(spec, tag_dir):
    """A DPO checkpoint resumes against the reference it was trained against: the same starting checkpoint."""
    saved = spec.trainer_state.get("reference")
    if not saved or not spec.preference.needs_reference:
        return
    if saved["checkpoint"] != spec.reference_checkpoint:
        raise ConfigError(f"checkpoint {tag_dir} was trained with DPO against the reference log-probabilities of the "
                          f"checkpoint with manifest checksum {saved['checkpoint']}, but model_name_or_path "
                          f"{spec.cfg.model_name_or_path} has checksum {spec.reference_checkpoint}: set "
                          f"model_name_or_path to the checkpoint that run started from.")


def check_same_adapters(spec, tag_dir):
    """A LoRA checkpoint resumes only as LoRA with the same adapters, onto the base it was trained on (its
    manifest's checksum); a full fine-tuning checkpoint only as full fine-tuning."""
    saved, base = spec.trainer_state.get("lora"), spec.trainer_state.get("base_model")
    current = spec.lora.as_dict() if spec.lora.enabled else None
    if saved is None and current is None:
        return
    if saved is None:
        raise ConfigError(f"checkpoint {tag_dir} is a full fine-tuning checkpoint, this run trains LoRA adapters "
                          f"(lora.rank={spec.lora.rank}): to put adapters on its weights, start a new run with "
                          f"model_name_or_path={os.path.dirname(tag_dir)} and no resume; or resume it with lora.rank=0.")
    settings = " ".join(f"lora.{key}={value if key != 'target_modules' else '[' + ','.join(value) + ']'}"
                        for key, value in saved.items() if key != "dropout")
    if current is None:
        raise ConfigError(f"checkpoint {tag_dir} holds LoRA adapters, not a whole model: resume it as LoRA with "
                          f"{settings} (the base is {base['path']}), or export the merged model (python "
                          f"convert2ckpt.py --to_hf --merge_lora --ckpt_dir {os.path.dirname(tag_dir)} ...) and "
                          f"convert it to fine-tune every weight.")
    differ = [key for key in ("rank", "alpha", "target_modules") if saved[key] != current[key]]
    if differ:
        raise ConfigError(f"checkpoint {tag_dir} holds adapters with {settings}; this run has "
                          f"{', '.join(f'lora.{key}={current[key]}' for key in differ)}: set the checkpoint's.")
    base_dir = os.path.abspath(spec.cfg.model_name_or_path)
    digest = manifest_digest(os.path.join(base_dir, read_latest(base_dir)))
    if digest != base["manifest_xxh3_128"]:
        raise ConfigError(f"checkpoint {tag_dir} holds adapters trained on the base {base['path']} (checksum "
                          f"{base['manifest_xxh3_128']}), but model_name_or_path {base_dir} has checksum {digest}: "
                          f"another base, whose outputs the adapters would not fit; set model_name_or_path to the "
                          f"base the adapters were trained on.")


def plan_spec(cfg, world_size=None, model_config=None):
    """A run to plan (plan_only): no processes, weights or data needed. world_size defaults to plan_world_size,
    model_config to load_plan_model_config's."""
    cfg = checked_config(cfg)
    model_config = moe_model_config(cfg, model_config or load_plan_model_config(cfg))
    world_size = world_size or plan_world_size(cfg)
    workload = check_layout(cfg, model_config, world_size)
    return RunSpec(cfg, model_config, world_size, workload, configured_stage_bounds(cfg, model_config, workload))


def plan_world_size(cfg):
    """Devices to plan for: plan_world_size, else the launched world size, else one data-parallel replica."""
    return cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", cfg.num_stages * (cfg.tensor_parallel_size or 1)))


# --- the config alone ------------------------------------------------------------------------------------------------

def check_data_files(cfg):
    if cfg.eval_only:
        if not cfg.eval_file and not cfg.eval_tasks:
            raise ConfigError("eval_only=true needs eval_file or eval_tasks.")
    elif not cfg.train_file:
        raise ConfigError("train_file is not set; pass train_file=PATH (jsonl, json, parquet or txt; with "
                          "data.format=indexed a shard PREFIX or a list of {path: PREFIX, weight: W}).")
    for key in ("train_file", "eval_file"):
        path = cfg[key]
        if not path or (key == "train_file" and cfg.eval_only):
            continue
        if cfg.data.format == "indexed":
            try:
                for source in parse_sources(path, key):
                    read_shard_header(source.prefix)
            except ShardError as error:
                raise ConfigError(f"{key}: {error}") from None
        elif not isinstance(path, str):
            raise ConfigError(f"{key} is a list; only data.format=indexed reads several corpora (a list of "
                              f"{{path: PREFIX, weight: W}}); name one file.")
        elif not os.path.isfile(path):
            raise ConfigError(f"{key} '{path}' does not exist.")


def check_shards_fit_model(cfg, vocab_size, tokenizer_path):
    """data.format=indexed: every corpus written for this model's vocabulary and tokenizer (as its PREFIX.json
    records), holding at least one sample, and its sample index writable where it goes (or built already)."""
    fingerprint = None
    if tokenizer_path:
        from transformers import AutoTokenizer
        fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_path))
    for key in ("train_file", "eval_file"):
        if cfg[key] and not (key == "train_file" and cfg.eval_only):
            try:
                headers = check_sources(parse_sources(cfg[key], key), key, vocab_size, fingerprint, cfg.seq_length)
                for header in headers:
                    CorpusIndex(header, cfg.seed, cfg.seq_length, cfg.data.index_dir).check_writable()
            except ShardError as error:
                raise ConfigError(f"{key}: {error}") from None


# --- the config against the model and the world ----------------------------------------------------------------------

def check_layout(cfg, model_config, world_size):
    """The run's Workload, once its layout fits the world size and the model."""
    stages, tp = cfg.num_stages, cfg.tensor_parallel_size
    data_axis = data_parallel_size(world_size, stages, tp)  # data-parallel x context-parallel ranks
    error = context_parallel_error(cfg.context_parallel_size, cfg.seq_length, data_axis)
    if error:
        raise ConfigError(error)
    workload = workload_of(cfg, data_axis // cfg.context_parallel_size)
    moe = architecture_of(model_config).moe
    error = expert_parallel_error(cfg.expert_parallel_size, workload.data_parallel, moe and moe.num_experts)
    if error:
        raise ConfigError(error)
    check_length_buckets_split(cfg, workload)
    try:
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


def workload_of(cfg, data_parallel):
    """The run's Workload for the cost model (planner/stage_costs.py)."""
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    optimizer_params = ds.get("optimizer", {}).get("params", {})
    rows_per_example = 2 if cfg.objective in ("dpo", "simpo") else 1  # a pair's chosen and rejected sequences
    return Workload(seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size * rows_per_example,
                    micro_batches=cfg.gradient_accumulation_steps, precision=cfg.precision,
                    grad_accum_dtype=cfg.grad_accum_dtype,
                    zero_stage=cfg.zero_stage, data_parallel=data_parallel,
                    activation_checkpoint_interval=cfg.activation_checkpoint_interval,
                    reduce_bucket_size=int(ds.get("zero_optimization", {}).get("reduce_bucket_size",
                                                                                Workload.reduce_bucket_size)),
                    torch_adam=bool(optimizer_params.get("torch_adam", False)),
                    fused_adam=bool(optimizer_params.get("fused", False)),
                    tensor_parallel=cfg.tensor_parallel_size, sequence_parallel=bool(cfg.sequence_parallel),
                    context_parallel=cfg.context_parallel_size, expert_parallel=cfg.expert_parallel_size,
                    document_masks=bool(cfg.data.document_isolation if cfg.data.format in ("text", "indexed")
                                        else cfg.data.packing),
                    recompute_sequence_gather=bool(cfg.recompute_sequence_gather),
                    offload_optimizer=cfg.offload_optimizer == "cpu", pipeline_schedule=cfg.pipeline_schedule,
                    loss_chunk_tokens=cfg.loss_chunk_tokens if cfg.loss_impl == "chunked" else 0,
                    zero_bubble_max_waiting=cfg.zero_bubble_max_waiting, virtual_stages=cfg.virtual_stages or 1,
                    zbv_times=(OmegaConf.to_container(cfg.zbv_times) if OmegaConf.is_list(cfg.zbv_times)
                               else cfg.zbv_times),
                    lora=LoraSettings.from_cfg(cfg.lora), async_save=bool(cfg.async_save))


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
    return config, side_dir


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
    return config


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
