"""A training run from a validated RunSpec (training/run_spec.py): build this rank's stage, load its weights, read
data on the first and last stage, then train, evaluate, log and save."""
import math
import os
import random
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import collectives
from checkpoints.compatibility import dropped_state, layout_change
from checkpoints.background_save import BackgroundSave, agreed_async_save, snapshot_shortfall
from checkpoints.disk_space import checkpoint_bytes, storage_warning
from checkpoints.ds_to_hf import convert_ds_to_hf
from checkpoints.files import has_tokenizer_files
from checkpoints.integrity import verify_checkpoint
from checkpoints.layer_files import load_layer_slice
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
from training.metrics import RunLogger, compute_throughput, device_peak_tflops
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
from training.resume import start_checkpoint_dir
from errors import ConfigError
from engines.cost_calibration import measured_partition
from training.run_spec import plan_spec, run_spec
from training.start_point import agreed_start, load_with_reference
from resilience.stragglers import StragglerWatch
from training.token_mean import step_micro_batches, step_totals, token_mean_loss


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_engine(spec, total_steps, layer_loader=load_layer_slice):
    """The DeepSpeed pipeline engine of this rank's stage, as every run trains it. layer_loader=None: random weights
    (the benches measure the trainer's engine without a checkpoint)."""
    cfg = spec.cfg
    module = build_pipeline_module(spec.model_config, parallel_topology(spec.num_stages, spec.tensor_parallel),
                                   stage_bounds=spec.stage_bounds, attention_impl=cfg.attention_impl,
                                   activation_checkpoint_interval=cfg.activation_checkpoint_interval,
                                   dtype=PRECISION_DTYPES[cfg.precision], sequence_parallel=cfg.sequence_parallel,
                                   recompute_sequence_gather=cfg.recompute_sequence_gather,
                                   layer_loader=layer_loader, context_parallel_size=cfg.context_parallel_size,
                                   loss_chunk_tokens=cfg.loss_chunk_tokens if cfg.loss_impl == "chunked" else 0,
                                   grad_accum_dtype=PRECISION_DTYPES[cfg.grad_accum_dtype], lora=spec.lora,
                                   seed=cfg.seed, objective=spec.preference,
                                   seq_length=cfg.seq_length if cfg.data.format == "indexed" else None,
                                   row_layout=row_layout(cfg.data),
                                   chunk_ids=rank_chunk_ids(cfg.pipeline_schedule, spec.num_stages, cfg.virtual_stages),
                                   expert_parallel_size=cfg.expert_parallel_size)
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
            print(f"removed incomplete checkpoints left by an interrupted save: {removed}", flush=True)
        if resume_from is None and cfg.overwrite_output_dir and not cfg.eval_only:
            clear_previous_run(cfg.output_dir)
        warning = None if cfg.eval_only else storage_warning(cfg.output_dir, spec.checkpoint_bytes,
                                                             cfg.save_total_limit)
        if warning:
            print(warning, flush=True)
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
    return LmEvalTasks(spec.cfg, tokenizer, log=lambda line: first_rank and print(line, flush=True))


def evaluation_record(loss, extra):
    """evaluate's result as logged: eval_loss and eval_ppl, or under a preference objective eval_loss and TRL's
    metrics with eval_ in front."""
    if isinstance(extra, dict):
        return {"eval_loss": loss, **{f"eval_{name}": value for name, value in extra.items()}}
    return {"eval_loss": loss, "eval_ppl": extra}


def describe_resume(spec):
    """What a resume changes about the run that wrote its checkpoint (a line at start-up), or None."""
    if spec.resume_from is None or spec.cfg.resume_weights_only:
        return None
    changes = layout_change(spec.trainer_state, spec.layout, spec.settings)
    if not changes:
        return None
    consumed = spec.trainer_state.get("consumed_samples", 0)
    per_micro_step = spec.data_parallel * spec.cfg.micro_batch_size
    # token shards continue at the very next sample of the blend; the sampler rounds down to whole micro-batches
    again = (f", of which the last {consumed % per_micro_step} are read again: the position rounds down to a whole "
             f"micro-batch of each of the {spec.data_parallel} data-parallel ranks"
             if consumed % per_micro_step and spec.cfg.data.format != "indexed" else "")
    return (f"resuming {os.path.join(*spec.resume_from)} with another layout ({'; '.join(changes)}): the optimizer "
            f"state is resharded from its per-layer files; the data position is kept in samples ({consumed} "
            f"consumed{again})"
            + "".join(f"; dropped: {state}" for state in
                      dropped_state(spec.trainer_state.get("settings", {}), spec.settings)))


def data_position(trainer_state, micro_batches_per_epoch, dp_size, micro_batch_size):
    """(epoch, micro-batches consumed in it) to continue from. Derived from consumed samples, which every rank
    knows (middle stages pull no data) and which stays meaningful when the data-parallel degree changes."""
    consumed = trainer_state.get("consumed_samples", 0) // (dp_size * micro_batch_size)
    return divmod(consumed, micro_batches_per_epoch)


def run(cfg):
    check_deepspeed_internals()  # an untested DeepSpeed fails here, in one line, before anything is started
    set_threads_per_process()
    if cfg.plan_only:  # no processes, weights or devices needed: the world is the one the config describes
        return print_memory_plan(plan_spec(cfg))
    spec = run_spec(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # every check, before anything is started
    cfg = spec.cfg
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
        log_rank0(warning)
    if describe_resume(spec):
        log_rank0(describe_resume(spec))
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
        engine, monitors = build_engine(spec, total_steps=1)
        load_with_reference(engine, spec, data, pad_id)
        step = spec.trainer_state.get("step", 0)
        record = evaluation_record(*evaluate(engine, data.eval, data.eval_length, cfg, pad_id)) if data.eval_length \
            else {}
        if lm_eval_tasks:
            record.update(lm_eval_tasks.score(engine, cfg, pad_id, reads_data, step))
        logger = RunLogger(cfg.output_dir, monitors, total_steps=0, start_step=0)
        logger.log({"step": step, **record, "eval_examples": data.eval_length})
        logger.close()
        return record

    indexed = cfg.data.format == "indexed"
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * data.steps_per_epoch(spec))
    if data.train_buckets:
        log_rank0(f"data.length_buckets: train_file's rows, {data.train_buckets.describe()}: "
                  f"{data.steps_per_epoch(spec)} steps of one bucket each per epoch")
    step = spec.trainer_state.get("step", 0)
    consumed_samples = spec.trainer_state.get("consumed_samples", 0)
    if indexed:
        data.open_blend(spec, consumed_samples + (total_steps - step) * spec.samples_per_step)
    engine, monitors = build_engine(spec, total_steps)
    load_with_reference(engine, spec, data, pad_id)
    if indexed:
        stream = blend_micro_batches(data.blend, reads_data=reads_data,
                                     dp_rank=coord.data // cfg.context_parallel_size, dp_size=spec.data_parallel,
                                     micro_batch_size=cfg.micro_batch_size, seq_length=cfg.seq_length,
                                     pad_id=pad_id, start_sample=consumed_samples)
    else:
        # built after the reference pass: DPO's rows carry their reference log-probabilities
        loader = build_stage_loader(data.train if reads_data else range(data.train_length), reads_data=reads_data,
                                    # the ranks of a context group (on DeepSpeed's data axis) read one replica's samples
                                    dp_rank=coord.data // cfg.context_parallel_size, dp_size=spec.data_parallel,
                                    micro_batch_size=cfg.micro_batch_size, seq_length=cfg.seq_length,
                                    pad_id=pad_id, seed=cfg.seed, buckets=data.train_buckets)
        epoch, consumed = data_position(spec.trainer_state, len(loader), spec.data_parallel, cfg.micro_batch_size)
        stream = infinite_micro_batches(loader, epoch, consumed)
    if cfg.context_parallel_size > 1:
        stream = map(engine.module.context.split_micro_batch, stream)
    if spec.tensor_parallel > 1 and reads_data:
        stream = check_identical_across_group(stream, engine.grid.get_slice_parallel_group(),
                                              batches_per_check=cfg.gradient_accumulation_steps)
    watchdog = hang_watchdog(cfg, engine, total_steps, record)
    try:
        return train(engine, spec, stream, data, pad_id, monitors, step, total_steps, lm_eval_tasks)
    finally:
        watchdog.stop()


def train(engine, spec, stream, data, pad_id, monitors, step, total_steps, lm_eval_tasks=None):
    cfg = spec.cfg
    samples_per_step = spec.samples_per_step
    sequences_per_sample = 2 if spec.preference.preference else 1  # a pair: its chosen and rejected sequences
    logger = RunLogger(cfg.output_dir, monitors, total_steps, step, replays_after=step)
    start_step, start_consumed = step, spec.trainer_state.get("consumed_samples", 0)  # the global batch may change
    # the newest checkpoint of this output_dir's history: the one resumed (rank 0's choice, every rank's alike)
    last_checkpoint = (spec.resume_from if spec.resume_from and os.path.realpath(spec.resume_from[0]) ==
                       os.path.realpath(cfg.output_dir) else None)
    checkpoint_size = checkpoint_bytes(os.path.join(*last_checkpoint)) if last_checkpoint else spec.checkpoint_bytes
    preemption = PreemptionWatch(cfg.preemption_grace_seconds)
    peak_tflops = device_peak_tflops(cfg.peak_tflops, cfg.precision)
    profile = (StepProfile(engine, cfg.output_dir, dist.get_rank(), planned_stage_tflops(spec, engine.stage_id))
               if cfg.profile else NoProfile())
    stragglers = StragglerWatch(engine, cfg.straggler_margin)
    balancing = CorrectionBiasBalancing(engine, cfg.moe.bias_update_rate) if cfg.moe.bias_update_rate else None
    background = BackgroundSave() if cfg.async_save else None
    if background:
        add_instruction_listener(engine, background)  # the optimizer step waits for the snapshot's copy
    start_time = window_start = time.time()
    window_steps, window_tokens, window_flops, losses, skipped, unlabelled = 0, 0, 0, [], 0, 0
    result = {}
    while step < total_steps:
        micro_batches = step_micro_batches(engine, stream, cfg.gradient_accumulation_steps)
        totals = step_totals(engine, micro_batches)
        profile.lap("micro-batches and token count")
        step += 1
        window_steps += 1
        length = totals.width * cfg.context_parallel_size  # the step's sequence length: seq_length, or its bucket's
        tokens = samples_per_step * sequences_per_sample * length
        window_tokens += tokens
        window_flops += tokens * training_flops_per_token(spec.model_config, length, spec.lora)
        if totals.units:
            use_sequence_length(engine, totals.width)
            with token_mean_loss(engine, totals.units):
                loss = float(engine.train_batch(iter(micro_batches)))
            if balancing:  # DeepSeek-V3's correction biases, after the optimizer step
                balancing.step(updated=math.isfinite(loss))
        else:
            loss, unlabelled = None, unlabelled + 1
            log_rank0(f"step {step}: the global batch has no labelled token (every label is -100): no update")
        profile.lap("train_batch")
        if loss is not None and not math.isfinite(loss):
            if cfg.nan_policy == "stop":
                raise FloatingPointError(
                    f"loss is {loss} at step {step}; stopping (nan_policy=stop). Last good checkpoint: "
                    f"{os.path.join(*last_checkpoint) if last_checkpoint else 'none saved yet'}.")
            skipped += 1
            log_rank0(f"loss is {loss} at step {step}: optimizer step skipped (nan_policy=skip, {skipped} so far)")
        elif loss is not None:
            losses.append(loss)
        logger.advance()
        if step % cfg.logging_steps == 0 or step == total_steps:
            preference_metrics = engine.module.loss_fn.take_metrics() if spec.preference.preference else {}
            router = getattr(engine.module.loss_fn, "router", None)  # an MoE model's: aux_loss, expert_load/*
            router_metrics = router.take_metrics(cfg.expert_parallel_size) if router else {}
            elapsed = time.time() - window_start
            grad_norm = engine.get_global_grad_norm()
            tokens_per_sec = window_tokens / elapsed
            # No loss at all where every step of the window had nothing to learn; NaN where NaN steps were skipped.
            no_loss = None if unlabelled == window_steps else float("nan")
            logger.log({"step": step, "loss": sum(losses) / len(losses) if losses else no_loss,
                        "lr": engine.get_lr()[0],
                        "grad_norm": float(grad_norm) if grad_norm is not None else None,
                        "tokens_per_sec": tokens_per_sec,
                        **compute_throughput(tokens_per_sec, window_flops / window_tokens, dist.get_world_size(),
                                             peak_tflops),
                        **preference_metrics, **router_metrics,
                        "samples_per_sec": window_steps * samples_per_step / elapsed,
                        "elapsed_s": time.time() - start_time, **({"skipped_steps": skipped} if skipped else {}),
                        **stragglers.window_report(log_rank0),
                        **data.epochs(start_consumed + (step - start_step) * samples_per_step)})
            window_start, window_steps, window_tokens, window_flops, losses, unlabelled = time.time(), 0, 0, 0, [], 0
            if overload := rank_overload_warning(router_metrics, cfg.moe.rank_load_warning, step):
                log_rank0(overload)
        profile.lap("logging")
        evaluation_due = step == total_steps or (cfg.eval_steps and step % cfg.eval_steps == 0)
        if data.eval_length and evaluation_due:
            record = evaluation_record(*evaluate(engine, data.eval, data.eval_length, cfg, pad_id))
            logger.log({"step": step, **record})
            result.update(record)
        if lm_eval_tasks and evaluation_due:
            record = lm_eval_tasks.score(engine, cfg, pad_id, data.reads_data, step)
            logger.log({"step": step, **record})
            result.update(record)
        profile.lap("evaluation")
        preempted = preemption.should_stop() and step < total_steps
        profile.lap("preemption check")
        if background is not None and (saved := background.complete_if_written()):
            last_checkpoint, checkpoint_size = os.path.split(saved), checkpoint_bytes(saved)
        if preempted or step == total_steps or (cfg.save_steps and step % cfg.save_steps == 0):
            consumed = start_consumed + (step - start_step) * samples_per_step
            saved = save_checkpoint(engine, cfg, spec.model_files_dir, {
                "step": step, "consumed_samples": consumed, "topology": spec.layout, "settings": spec.settings,
                **spec.lora_record, **spec.reference_record}, checkpoint_size, background,
                wait=preempted or step == total_steps)
            if saved:  # else written in the background, and complete after a later step
                last_checkpoint, checkpoint_size = os.path.split(saved), checkpoint_bytes(saved)
        profile.lap("checkpoint")
        profile.step_done()
        if preempted:
            logger.close()
            raise Preempted(f"preempted ({preemption.reason}) after step {step}: saved "
                            f"{os.path.join(*last_checkpoint)} {time.time() - preemption.requested_at:.1f}s after "
                            f"the request; rerun with resume=auto to continue")
    logger.close()
    profile.write()
    if cfg.export_hf and dist.get_rank() == 0:
        convert_ds_to_hf(cfg.output_dir, os.path.join(cfg.output_dir, "hf"), overwrite=True,
                         verify_checksums=cfg.verify_checksums)
        print(f"exported {'a peft adapter' if spec.lora.enabled else 'Hugging Face model'} to "
              f"{os.path.join(cfg.output_dir, 'hf')}", flush=True)
    collectives.barrier()
    return result
