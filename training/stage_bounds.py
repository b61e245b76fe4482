"""The stage bounds a config's `partition` gives a workload: a method name or a list of decoder layers per stage (or
per chunk, under a schedule with several chunks per rank), checked against the model's decoder layers."""
from models.partition import decoder_counts_of_bounds, decoder_kinds
from models.pipeline import partition_stages
from schedules.rules import chunks_per_rank
from planner.chunk_balance import balanced_chunk_counts
from planner.measured_costs import measured_stage_cost, uses_measured_costs
from planner.stage_costs import StageCostModel
from errors import ConfigError


def configured_stage_bounds(cfg, model_config, workload, units=None):
    """The stage bounds cfg.partition gives this workload (a method name or a list of decoder layers per stage);
    under a schedule with several chunks per rank, the bounds of every global chunk (models/partition.py's
    chunk_bounds), `balanced` minimising the schedule's simulated step (planner/chunk_balance.py). units: the
    measured costs `balanced` weighs compute by (planner/measured_costs.py; None: the plan's FLOPs)."""
    partition = cfg.partition if isinstance(cfg.partition, str) else list(cfg.partition)
    chunks = cfg.num_stages * chunks_per_rank(cfg.pipeline_schedule, cfg.virtual_stages)
    check_chunk_count(cfg, chunks, model_config.num_hidden_layers, partition)
    if uses_measured_costs(cfg) and len(set(decoder_kinds(model_config))) > 1:
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
