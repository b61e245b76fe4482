"""A training run from a validated RunSpec: build this rank's stage, load its weights, read data on the first and
last stage, then train, evaluate, log and save.

train() is the loop itself, one step at a time in the order every rank keeps (the collectives of logging,
evaluation, preemption and saving are met by all ranks alike): the step's batch, the step, its metrics, the
evaluation and the checkpoint when due."""
import math
import os
import random
import time
from typing import NamedTuple

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import collectives
from checkpoints.background_save import BackgroundSave, agreed_async_save, snapshot_shortfall
from checkpoints.disk_space import checkpoint_bytes, storage_warning
from checkpoints.ds_to_hf import convert_ds_to_hf
from checkpoints.files import has_tokenizer_files
from checkpoints.integrity import verify_checkpoint
from checkpoints.layer_files import fp32_stored_keys, load_layer_slice
from resilience.run_lease import output_dir_lease
from checkpoints.saving import save_checkpoint
from checkpoints.state_files import WeightsOnlyCheckpointEngine
from checkpoints.tag_dirs import clear_previous_run, remove_incomplete_checkpoints
from data.collator import row_layout
from data.loader import blend_micro_batches, build_stage_loader, check_identical_across_group, infinite_micro_batches
from deepspeed_internals.access import (ask_cpuinfo_once, checkpoints_without_expert_files, parameters_kept_in_fp32,
                                        replace_checkpoint_engine, skip_gradient_allreduce, skip_optimizer_files,
                                        uses_bf16_optimizer)
from deepspeed_internals.registry import check_deepspeed_internals
from models.partition import training_flops_per_token
from models.pipeline import PRECISION_DTYPES, build_pipeline_module
from models.sigmoid_router import FP32_MARKER
from planner.memory_plan import describe_stages, planned_stage_tflops, print_memory_plan, snapshot_bytes_of_ranks
from training.deepspeed_config import accumulation_warning, deepspeed_config
from training.expert_balance import CorrectionBiasBalancing, rank_overload_warning
from cluster.distributed import (check_devices, elastic_restart_error, init_distributed, log_rank0, node_ranks,
                                  parallel_topology, set_threads_per_process, set_up_flight_recorder)
from evaluation.eval_set import evaluate
from resilience.hang_watchdog import HANG_DIR, hang_watchdog
from training.metrics import MetricsWindow, RunLogger, compute_throughput, device_peak_tflops
from training.optimizer import skipping_optimizer
from engines.gradient_norm import use_expert_parallel_norm, use_fp32_clipping
from engines.chunked_engine import rank_chunk_ids, stage_reads_data, use_chunked_pipeline
from engines.pipeline_engine import use_one_backward, use_zero_bubble
from resilience.preemption import Preempted, PreemptionWatch
from engines.instruction_listeners import add_instruction_listener
from engines.profiling import NoProfile, StepProfile
from engines.sequence_length import use_sequence_length
from resilience.rank_records import start_record
from training.run_data import RunData, pad_token_id
from training.resume import (agreed_start, data_position, describe_resume, load_with_reference,
                             start_checkpoint_dir)
from errors import ConfigError
from engines.cost_calibration import measured_partition
from training.run_spec import plan_spec, run_spec
from resilience.stragglers import StragglerWatch
from training.token_mean import StepTotals, step_micro_batches, step_totals, token_mean_micro_batches
from cluster.console import library_output, quiet_libraries, say


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_engine(spec, total_steps, layer_loader=load_layer_slice):
    """The DeepSpeed pipeline engine of this rank's stage, as every run trains it. layer_loader=None: random weights
    (the benches measure the trainer's engine without a checkpoint)."""
    cfg = spec.cfg
    with library_output(cfg.log_level):  # DeepSpeed's PipelineModule prints its seeds and topology
        module = build_pipeline_module(
            spec.model_config, parallel_topology(spec.num_stages, spec.tensor_parallel),
            stage_bounds=spec.stage_bounds, attention_impl=cfg.attention_impl,
            activation_checkpoint_interval=cfg.activation_checkpoint_interval,
            dtype=PRECISION_DTYPES[cfg.precision], sequence_parallel=cfg.sequence_parallel,
            recompute_sequence_gather=cfg.recompute_sequence_gather, layer_loader=layer_loader,
            context_parallel_size=cfg.context_parallel_size,
            loss_chunk_tokens=cfg.loss_chunk_tokens if cfg.loss_impl == "chunked" else 0,
            grad_accum_dtype=PRECISION_DTYPES[cfg.grad_accum_dtype], lora=spec.lora, seed=cfg.seed,
            objective=spec.preference, seq_length=cfg.seq_length if cfg.data.format == "indexed" else None,
            row_layout=row_layout(cfg.data),
            chunk_ids=rank_chunk_ids(cfg.pipeline_schedule, spec.num_stages, cfg.virtual_stages),
            expert_parallel_size=cfg.expert_parallel_size,
            # the tensors the converted model stores in fp32 beside bf16 ones (Qwen3.5's A_log) stay fp32
            kept_in_fp32=fp32_stored_keys(start_checkpoint_dir(cfg.model_name_or_path, None), spec.model_config)
            if layer_loader is not None else frozenset())
    if cfg.compile:
        module.compile()
    ds_config, monitors = deepspeed_config(cfg, total_steps)
    if cfg.offload_optimizer == "cpu":
        ask_cpuinfo_once()
    params, kept_in_fp32 = trained_parameter_groups(module)
    optimizer = None
    if cfg.nan_policy == "skip":
        optimizer = skipping_optimizer(cfg, params)
        ds_config.pop("optimizer")
    with parameters_kept_in_fp32(kept_in_fp32):
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, optimizer=optimizer,
                                               config=ds_config)
    use_fp32_clipping(engine, module.experts)
    use_expert_parallel_norm(engine, module.experts)
    checkpoints_without_expert_files(engine)  # the layer files hold the experts (models/pipeline.py)
    # Resuming runs no code from the checkpoint; DeepSpeed's config keeps deciding how files are written (zip).
    replace_checkpoint_engine(engine, WeightsOnlyCheckpointEngine)
    # The optimizer's state is saved per layer (checkpoints/optimizer_state.py), which any layout loads; DeepSpeed's
    # per-rank copy of it (ZeRO's files, the optimizer in mp_rank_*) would double a checkpoint.
    skip_optimizer_files(engine)
    if not engine.is_data_parallel and (engine.zero_optimization_stage() == 0 or uses_bf16_optimizer(engine)):
        # DeepSpeed's pipeline all-reduces gradients over a data-parallel group of one too: a flattened copy of
        # every gradient (the bf16 optimizer's fp32 ones) and a copy back, for nothing (ZeRO-1's reduction also
        # fills its partitions: kept).
        skip_gradient_allreduce(engine)
    if cfg.pipeline_schedule == "zero_bubble":
        use_zero_bubble(engine, cfg.zero_bubble_max_waiting)
    elif rank_chunk_ids(cfg.pipeline_schedule, spec.num_stages, cfg.virtual_stages):
        use_chunked_pipeline(engine, cfg.pipeline_schedule, cfg.virtual_stages, cfg.zero_bubble_max_waiting,
                             cfg.zbv_times if cfg.pipeline_schedule == "zbv" else None)  # auto: zbv's default
    else:
        use_one_backward(engine)
    return engine, monitors


def trained_parameter_groups(module):
    """(the optimizer's parameter groups, the parameters kept in fp32 whatever the precision: those transformers
    keeps in fp32, models/sigmoid_router.py FP32_MARKER, DeepSeek-V3's router, frozen under LoRA or not). The trained
    ones form a group of their own, whose flat partitions, master weights and gradients stay fp32 beside the others'
    in the training dtype."""
    kept = [p for p in module.parameters() if getattr(p, FP32_MARKER, False)]
    params = [p for p in module.parameters() if p.requires_grad]
    if not any(p.requires_grad for p in kept):
        return params, kept
    # named, as DeepSpeed's expert parameter groups (expert parallelism) need
    return [{"params": [p for p in params if not getattr(p, FP32_MARKER, False)], "name": "params"},
            {"params": [p for p in kept if p.requires_grad], "name": "kept_in_fp32"}], kept


def prepare_output_dir(spec):
    """Rank 0 removes what an interrupted save left behind and, when asked, an older run's checkpoints, and warns
    when the disk cannot hold the checkpoints the run keeps."""
    cfg, resume_from = spec.cfg, spec.resume_from
    if dist.get_rank() == 0:
        removed = remove_incomplete_checkpoints(cfg.output_dir)
        if removed:
            say(f"removed incomplete checkpoints left by an interrupted save: {removed}")
        if resume_from is None and cfg.overwrite_output_dir and not cfg.eval_only:
            clear_previous_run(cfg.output_dir)
        warning = None if cfg.eval_only else storage_warning(cfg.output_dir, spec.checkpoint_bytes,
                                                             cfg.save_total_limit)
        if warning:
            say(f"trainer_pipe: {warning}")
    collectives.barrier()


def load_lm_eval_tasks(spec):
    """The run's eval_tasks loaded and checked on every rank before anything starts (evaluation/lm_eval_tasks.py;
    lm-eval is an optional extra), or None."""
    if not spec.cfg.eval_tasks:
        return None
    try:
        from evaluation.lm_eval_tasks import LmEvalTasks
    except ImportError as error:
        raise ConfigError(f"eval_tasks needs lm-evaluation-harness ({error}): pip install -r "
                          f"requirements-eval.txt") from None
    path = spec.tokenizer_dir or spec.cfg.tokenizer_name_or_path or spec.model_files_dir  # pre-tokenized data too
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer_files(path) else None
    first_rank = int(os.environ.get("RANK", "0")) == 0
    return LmEvalTasks(spec.cfg, tokenizer, log=lambda line: first_rank and say(line),
                       quiet=spec.cfg.log_level != "debug")


def evaluation_record(loss, extra):
    """evaluate's result as logged: eval_loss and eval_ppl, or under a preference objective eval_loss and TRL's
    metrics with eval_ in front."""
    if isinstance(extra, dict):
        return {"eval_loss": loss, **{f"eval_{name}": value for name, value in extra.items()}}
    return {"eval_loss": loss, "eval_ppl": extra}


def run(cfg):
    check_deepspeed_internals()  # an untested DeepSpeed fails here, in one line, before anything is started
    set_threads_per_process()
    if cfg.plan_only:  # no processes, weights or devices needed: the world is the one the config describes
        return print_memory_plan(plan_spec(cfg))
    spec = run_spec(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # every check, before anything is started
    cfg = spec.cfg
    quiet_libraries(cfg.log_level)
    lm_eval_tasks = load_lm_eval_tasks(spec)
    shortfall = None
    if cfg.async_save and not cfg.eval_only:
        this_node = node_ranks()
        shortfall = snapshot_shortfall(cfg.async_save, snapshot_bytes_of_ranks(spec, this_node), len(this_node))
    check_devices(cfg.precision)
    if error := elastic_restart_error(os.environ):
        raise ConfigError(error)
    trace_dir = set_up_flight_recorder(os.path.join(cfg.output_dir, HANG_DIR))  # read as the process group starts
    init_distributed(cfg.dist_timeout_minutes)
    if cfg.async_save == "auto":  # from here on, true or false alike on every rank
        cfg.async_save = not cfg.eval_only and agreed_async_save(shortfall)
    with output_dir_lease(cfg.output_dir):  # before anything in output_dir is touched
        record = start_record(cfg.output_dir, int(os.environ.get("RANK", "0")))  # names this rank if it dies
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)  # where NCCL writes its trace when a collective times out
        return run_started(spec, lm_eval_tasks, record)


def run_started(spec, lm_eval_tasks, record):
    """run() once the process group is up and this job holds output_dir."""
    spec = agreed_start(spec)  # collective: the checkpoint rank 0 chose, a rollback's abandoned branch moved aside
    spec = measured_partition(spec)  # collective: every rank partitions alike, on the device's measured costs
    cfg, resume_from = spec.cfg, spec.resume_from
    prepare_output_dir(spec)
    seed_everything(cfg.seed)
    log_rank0(describe_stages(spec))
    if warning := accumulation_warning(cfg):
        log_rank0(f"trainer_pipe: {warning}")
    if resumed := describe_resume(spec):
        log_rank0(resumed)
    topology = parallel_topology(spec.num_stages, spec.tensor_parallel)
    coord = topology.get_coord(dist.get_rank())
    reads_data = stage_reads_data(cfg.pipeline_schedule, spec.num_stages, coord.pipe, cfg.virtual_stages)
    if cfg.verify_checksums:
        verify_checkpoint(start_checkpoint_dir(cfg.model_name_or_path, resume_from),
                          weights_only=resume_from is None or cfg.resume_weights_only)
        if resume_from and spec.lora.enabled:  # the frozen base the adapters resume on
            verify_checkpoint(start_checkpoint_dir(cfg.model_name_or_path, None), weights_only=True)
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir) if spec.tokenizer_dir else None
    pad_id = pad_token_id(tokenizer, spec.model_config)
    data = RunData(spec, tokenizer, reads_data)

    if cfg.eval_only:
        return evaluate_only(spec, data, pad_id, lm_eval_tasks)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * data.steps_per_epoch(spec))
    if data.train_buckets:
        log_rank0(f"data.length_buckets: train_file's rows, {data.train_buckets.describe()}: "
                  f"{data.steps_per_epoch(spec)} steps of one bucket each per epoch")
    step = spec.trainer_state.get("step", 0)
    if cfg.data.format == "indexed":
        data.open_blend(spec, spec.trainer_state.get("consumed_samples", 0) + (total_steps - step) *
                        spec.samples_per_step)
    engine, monitors = build_engine(spec, total_steps)
    load_with_reference(engine, spec, data, pad_id)
    # built after the reference pass: DPO's rows carry their reference log-probabilities
    stream = training_stream(engine, spec, data, coord, pad_id)
    watchdog = hang_watchdog(cfg, engine, total_steps, record)
    try:
        return train(engine, spec, stream, data, pad_id, monitors, step, total_steps, lm_eval_tasks)
    finally:
        watchdog.stop()


def evaluate_only(spec, data, pad_id, lm_eval_tasks):
    """eval_only: the starting checkpoint's eval-set loss and lm-eval scores, logged as one record of its step."""
    cfg = spec.cfg
    engine, monitors = build_engine(spec, total_steps=1)
    load_with_reference(engine, spec, data, pad_id)
    step = spec.trainer_state.get("step", 0)
    record = evaluation_record(*evaluate(engine, data.eval, data.eval_length, cfg, pad_id)) if data.eval_length \
        else {}
    if lm_eval_tasks:
        record.update(lm_eval_tasks.score(engine, cfg, pad_id, data.reads_data, step))
    logger = RunLogger(cfg.output_dir, monitors, total_steps=0, start_step=0)
    logger.log({"step": step, **record, "eval_examples": data.eval_length})
    logger.close()
    return record


def training_stream(engine, spec, data, coord, pad_id):
    """This rank's endless stream of training micro-batches from where the run's data position is (token shards:
    the blend's next sample; files: the epoch and micro-batch consumed samples give), split over the context group
    and checked identical across the tensor-parallel group when those are on."""
    cfg = spec.cfg
    consumed_samples = spec.trainer_state.get("consumed_samples", 0)
    # the ranks of a context group (on DeepSpeed's data axis) read one replica's samples
    dp_rank = coord.data // cfg.context_parallel_size
    if cfg.data.format == "indexed":
        stream = blend_micro_batches(data.blend, reads_data=data.reads_data, dp_rank=dp_rank,
                                     dp_size=spec.data_parallel, micro_batch_size=cfg.micro_batch_size,
                                     seq_length=cfg.seq_length, pad_id=pad_id, start_sample=consumed_samples)
    else:
        loader = build_stage_loader(data.train if data.reads_data else range(data.train_length),
                                    reads_data=data.reads_data, dp_rank=dp_rank, dp_size=spec.data_parallel,
                                    micro_batch_size=cfg.micro_batch_size, seq_length=cfg.seq_length,
                                    pad_id=pad_id, seed=cfg.seed, buckets=data.train_buckets)
        epoch, consumed = data_position(spec.trainer_state, len(loader), spec.data_parallel, cfg.micro_batch_size)
        stream = infinite_micro_batches(loader, epoch, consumed)
    if cfg.context_parallel_size > 1:
        stream = map(engine.module.context.split_micro_batch, stream)
    if spec.tensor_parallel > 1 and data.reads_data:
        stream = check_identical_across_group(stream, engine.grid.get_slice_parallel_group(),
                                              batches_per_check=cfg.gradient_accumulation_steps)
    return stream


class StepBatch(NamedTuple):
    """A step's micro-batches (on the stages that read data; the stream itself on the others) and their totals."""
    micro_batches: object
    totals: StepTotals


def train(engine, spec, stream, data, pad_id, monitors, step, total_steps, lm_eval_tasks=None):
    """Train from `step` to total_steps, each step in the same order: its batch, the step, its metrics, the
    evaluation and the checkpoint when due; then the export. The last evaluation's records, {} without one."""
    run = TrainingRun(engine, spec, data, pad_id, monitors, step, total_steps, lm_eval_tasks)
    while run.step < total_steps:
        batch = run.next_batch(stream)
        loss = run.train_step(batch)
        run.log_metrics(batch, loss)
        run.evaluate_if_due()
        run.checkpoint_if_due()
    run.finish()
    return run.result


class TrainingRun:
    """What the training loop keeps between steps: the step, the newest checkpoint of this run's history, the window
    of steps the next log record covers (MetricsWindow) and the helpers that watch the steps (profile, stragglers,
    preemption, the background save). Each of train()'s steps is a method."""

    def __init__(self, engine, spec, data, pad_id, monitors, step, total_steps, lm_eval_tasks):
        cfg = self.cfg = spec.cfg
        self.engine, self.spec, self.data, self.pad_id, self.lm_eval_tasks = engine, spec, data, pad_id, lm_eval_tasks
        self.step, self.total_steps = step, total_steps
        # where the consumed samples are counted from: the global batch may have changed since the checkpoint
        self.start_step, self.start_consumed = step, spec.trainer_state.get("consumed_samples", 0)
        self.logger = RunLogger(cfg.output_dir, monitors, total_steps, step, replays_after=step)
        # the newest checkpoint of this output_dir's history: the one resumed (rank 0's choice, every rank's alike)
        self.last_checkpoint = (spec.resume_from if spec.resume_from and os.path.realpath(spec.resume_from[0]) ==
                                os.path.realpath(cfg.output_dir) else None)
        self.checkpoint_size = (checkpoint_bytes(os.path.join(*self.last_checkpoint)) if self.last_checkpoint
                                else spec.checkpoint_bytes)
        self.preemption = PreemptionWatch(cfg.preemption_grace_seconds)
        self.peak_tflops = device_peak_tflops(cfg.peak_tflops, cfg.precision)
        self.profile = (StepProfile(engine, cfg.output_dir, dist.get_rank(),
                                    planned_stage_tflops(spec, engine.stage_id)) if cfg.profile else NoProfile())
        self.stragglers = StragglerWatch(engine, cfg.straggler_margin)
        self.balancing = CorrectionBiasBalancing(engine, cfg.moe.bias_update_rate) if cfg.moe.bias_update_rate else None
        self.background = BackgroundSave() if cfg.async_save else None
        if self.background:
            add_instruction_listener(engine, self.background)  # the optimizer step waits for the snapshot's copy
        self.window = MetricsWindow()
        self.result = {}

    @property
    def consumed_samples(self):
        return self.start_consumed + (self.step - self.start_step) * self.spec.samples_per_step

    def next_batch(self, stream):
        """The step's micro-batches and their loss units and width, agreed over the job (one all-reduce)."""
        micro_batches = step_micro_batches(self.engine, stream, self.cfg.gradient_accumulation_steps)
        batch = StepBatch(micro_batches, step_totals(self.engine, micro_batches))
        self.profile.lap("micro-batches and token count")
        return batch

    def train_step(self, batch):
        """One optimizer step on the batch at its width, the loss its global token mean; the step's loss, or None
        when the batch has no labelled token (no update). A non-finite loss stops the run or is skipped, as
        nan_policy says."""
        engine, cfg = self.engine, self.cfg
        self.step += 1
        if batch.totals.units:
            use_sequence_length(engine, batch.totals.width)
            micro_batches = token_mean_micro_batches(engine, batch.micro_batches, batch.totals.units)
            loss = float(engine.train_batch(iter(micro_batches)))
            if self.balancing:  # DeepSeek-V3's correction biases, after the optimizer step
                self.balancing.step(updated=math.isfinite(loss))
        else:
            loss = None
            log_rank0(f"step {self.step}: the global batch has no labelled token (every label is -100): no update")
        self.profile.lap("train_batch")
        if loss is not None and not math.isfinite(loss) and cfg.nan_policy == "stop":
            raise FloatingPointError(
                f"loss is {loss} at step {self.step}; stopping (nan_policy=stop). Last good checkpoint: "
                f"{os.path.join(*self.last_checkpoint) if self.last_checkpoint else 'none saved yet'}.")
        return loss

    def log_metrics(self, batch, loss):
        """The step counted into the window; every logging_steps steps and at the last, the window's record logged
        (a collective: the preference and router metrics and the stragglers are gathered over the job)."""
        spec, cfg, engine, window = self.spec, self.cfg, self.engine, self.window
        length = batch.totals.width * cfg.context_parallel_size  # seq_length, or the step's bucket's length
        sequences_per_sample = 2 if spec.preference.preference else 1  # a pair: its chosen and rejected sequences
        window.add_step(spec.samples_per_step * sequences_per_sample * length,
                        training_flops_per_token(spec.model_config, length, spec.lora), loss)
        if loss is not None and not math.isfinite(loss):
            log_rank0(f"loss is {loss} at step {self.step}: optimizer step skipped (nan_policy=skip, "
                      f"{window.skipped} so far)")
        self.logger.advance()
        if self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
            preference_metrics = engine.module.loss_fn.take_metrics() if spec.preference.preference else {}
            router = getattr(engine.module.loss_fn, "router", None)  # an MoE model's: aux_loss, expert_load/*
            router_metrics = router.take_metrics(cfg.expert_parallel_size) if router else {}
            elapsed = window.elapsed()
            grad_norm = engine.get_global_grad_norm()
            tokens_per_sec = window.tokens / elapsed
            self.logger.log({"step": self.step, "loss": window.mean_loss(), "lr": engine.get_lr()[0],
                             "grad_norm": float(grad_norm) if grad_norm is not None else None,
                             "tokens_per_sec": tokens_per_sec,
                             **compute_throughput(tokens_per_sec, window.flops / window.tokens,
                                                  dist.get_world_size(), self.peak_tflops),
                             **preference_metrics, **router_metrics,
                             "samples_per_sec": window.steps * spec.samples_per_step / elapsed,
                             "elapsed_s": window.run_elapsed(),
                             **({"skipped_steps": window.skipped} if window.skipped else {}),
                             **self.stragglers.window_report(log_rank0),
                             **self.data.epochs(self.consumed_samples)})
            window.reset()
            if overload := rank_overload_warning(router_metrics, cfg.moe.rank_load_warning, self.step):
                log_rank0(overload)
        self.profile.lap("logging")

    def evaluate_if_due(self):
        """The eval set's loss and lm-eval's tasks every eval_steps steps and at the last, each logged."""
        cfg, step = self.cfg, self.step
        if step == self.total_steps or (cfg.eval_steps and step % cfg.eval_steps == 0):
            if self.data.eval_length:
                self.log_evaluation(evaluation_record(*evaluate(self.engine, self.data.eval, self.data.eval_length,
                                                                cfg, self.pad_id)))
            if self.lm_eval_tasks:
                self.log_evaluation(self.lm_eval_tasks.score(self.engine, cfg, self.pad_id, self.data.reads_data,
                                                             step))
        self.profile.lap("evaluation")

    def log_evaluation(self, record):
        self.logger.log({"step": self.step, **record})
        self.result.update(record)

    def checkpoint_if_due(self):
        """A background save that finished is completed; a checkpoint is saved every save_steps steps, at the last
        and when the job is being preempted, after which the run stops (Preempted)."""
        cfg, step = self.cfg, self.step
        preempted = self.preemption.should_stop() and step < self.total_steps
        self.profile.lap("preemption check")
        if self.background is not None and (saved := self.background.complete_if_written()):
            self.last_checkpoint, self.checkpoint_size = os.path.split(saved), checkpoint_bytes(saved)
            log_rank0(f"checkpoint: saved {saved} (written in the background)")
        if preempted or step == self.total_steps or (cfg.save_steps and step % cfg.save_steps == 0):
            spec = self.spec
            saved = save_checkpoint(self.engine, cfg, spec.model_files_dir, {
                "step": step, "consumed_samples": self.consumed_samples, "topology": spec.layout,
                "settings": spec.settings, **spec.lora_record, **spec.reference_record}, self.checkpoint_size,
                self.background, wait=preempted or step == self.total_steps)
            if saved:  # else written in the background, and complete after a later step
                self.last_checkpoint, self.checkpoint_size = os.path.split(saved), checkpoint_bytes(saved)
                log_rank0(f"checkpoint: saved {saved}")
        self.profile.lap("checkpoint")
        self.profile.step_done()
        if preempted:
            self.logger.close()
            raise Preempted(f"preempted ({self.preemption.reason}) after step {step}: saved "
                            f"{os.path.join(*self.last_checkpoint)} {time.time() - self.preemption.requested_at:.1f}s "
                            f"after the request; rerun with resume=auto to continue")

    def finish(self):
        """The logs closed, the profile written and, when asked, the last checkpoint exported by rank 0."""
        cfg = self.cfg
        self.logger.close()
        self.profile.write()
        if cfg.export_hf and dist.get_rank() == 0:
            convert_ds_to_hf(cfg.output_dir, os.path.join(cfg.output_dir, "hf"), overwrite=True,
                             verify_checksums=cfg.verify_checksums)
            say(f"exported {'a peft adapter' if self.spec.lora.enabled else 'Hugging Face model'} to "
                f"{os.path.join(cfg.output_dir, 'hf')}")
        collectives.barrier()
