"""One rank of a schedule comparison: the same model trained for a few steps under 1F1B and under each of a case's
other schedules (zero_bubble, zbv, interleaved_1f1b), every step's loss, fp16's loss scaler, every gradient the
optimizer steps with and the weights it leaves written as JSON for the test to compare, 1F1B's run the reference of
them all. The chunked schedules place other layers on each rank: their gradients and weights are compared with 1F1B's
across all ranks by name. Each step runs as the trainer's does (training/token_mean.py: the micro-batches read first,
the global batch's loss units counted); a preference case (DPO, SimPO) trains on pairs through the trainer's
collator, DPO against reference log-probabilities computed by the schedule's own reference pass
(evaluation/reference.py), and records them and each step's rewards; under context parallelism every rank takes its
tokens of its replica's micro-batches."""
import copy
import functools
import json
import os
import sys
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from checkpoints.layer_files import load_layer_slice  # noqa: E402
import collectives  # noqa: E402
from data.collator import collate_preference  # noqa: E402
from models.lora import NO_LORA, LoraSettings  # noqa: E402
from models.loss import split_micro_batch  # noqa: E402
from models.pipeline import build_pipeline_module, partition_stages  # noqa: E402
from models.preference import PreferenceSettings  # noqa: E402
from tests.distributed import ProcessGroupPool  # noqa: E402
from tests.parity_worker import CHUNK_TOKENS, micro_batches, record_deferred_weights  # noqa: E402
from tests.tiny_models import make_batch  # noqa: E402
from deepspeed_internals.access import checkpoints_without_expert_files, loss_scaler_state  # noqa: E402
from planner.workload import Workload  # noqa: E402
from training.config_checks import checked_config  # noqa: E402
from engines.cost_calibration import agreed_unit_costs  # noqa: E402
from cluster.distributed import init_distributed, parallel_topology  # noqa: E402
from training.run_spec import configured_stage_bounds  # noqa: E402
from engines.chunked_engine import rank_chunk_ids, use_chunked_pipeline  # noqa: E402
from engines.pipeline_engine import use_one_backward, use_zero_bubble  # noqa: E402
from evaluation.reference import WithReference, compute_reference  # noqa: E402
from training.token_mean import global_loss_units, step_micro_batches, token_mean_micro_batches  # noqa: E402

PROMPT_TOKENS = 3  # a pair's shared prompt, unlabelled: each response is scored on the rest of its row


def record_optimizer_gradients(engine):
    """Keep a copy of the gradients the engine's innermost optimizer steps with: after data-parallel and tied
    reduction, clipping and, under bf16 or ZeRO, in its fp32 (partitioned, possibly offloaded) buffers."""
    optimizer, recorded = engine.basic_optimizer, []
    names = {p: n for n, p in engine.module.named_parameters()}
    step = optimizer.step

    def recording_step(*args, **kwargs):
        recorded.append({names.get(p, f"group{i}.{j}"): p.grad.detach().clone()
                         for i, group in enumerate(optimizer.param_groups)
                         for j, p in enumerate(group["params"]) if p.grad is not None})
        return step(*args, **kwargs)

    optimizer.step = recording_step
    return recorded


@functools.cache
def read_config(hf_dir):
    """A checkpoint's config, read once per rank (transformers takes ~10 ms of CPU a read; the cases' 49 runs read
    6 checkpoints); each run gets its own copy."""
    return AutoConfig.from_pretrained(hf_dir)


def train(case, schedule, steps, micro_batch_size, gas, seq_len):
    config = copy.deepcopy(read_config(case["hf_dir"]))
    config.update(case.get("model_config", {}))  # a run's settings the model reads from its config
    num_stages, tensor_parallel = case["stages"], case.get("tensor_parallel", 1)
    objective = PreferenceSettings(case.get("objective", "sft"))
    virtual_stages = case.get("virtual_stages") if schedule == "interleaved_1f1b" else None
    chunks, bounds = rank_chunk_ids(schedule, num_stages, virtual_stages), None
    units = None
    if chunks is not None and case.get("partition_costs") == "measured":
        units, bounds = measured_bounds(case, schedule, config, micro_batch_size, gas, seq_len)
    elif chunks is not None:
        num_chunks = sum(map(len, chunks))  # the decoder layers shared out, the first chunks taking one more
        layers, extra = divmod(config.num_hidden_layers, num_chunks)
        bounds = partition_stages(config, num_chunks, [layers + (chunk < extra) for chunk in range(num_chunks)])
    module = build_pipeline_module(config, parallel_topology(num_stages, tensor_parallel), layer_loader=load_layer_slice,
                                   stage_bounds=bounds, chunk_ids=chunks,
                                   activation_checkpoint_interval=case.get("checkpoint_interval", 0),
                                   sequence_parallel=case.get("sequence_parallel", True),
                                   recompute_sequence_gather=case.get("recompute_sequence_gather", False),
                                   context_parallel_size=case.get("context_parallel", 1), objective=objective,
                                   loss_chunk_tokens=case.get("loss_chunk_tokens", CHUNK_TOKENS),
                                   grad_accum_dtype=(torch.float32 if case.get("deepspeed", {}).get("data_types")
                                                     else None),
                                   lora=LoraSettings(**case["lora"]) if "lora" in case else NO_LORA,
                                   expert_parallel_size=case.get("expert_parallel", 1))
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config={
        "train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}, **case.get("deepspeed", {})})
    checkpointed = count_calls(module, "activation_checkpoint_func")
    checkpoints_without_expert_files(engine)
    engine.load_checkpoint(case["ds_dir"], load_module_only=True)
    waiting = []
    if schedule == "zero_bubble":
        use_zero_bubble(engine, case.get("max_waiting"))
        waiting = record_waiting_before_backward(engine.module.parallel.weight_grads)
    elif chunks is not None:
        use_chunked_pipeline(engine, schedule, virtual_stages,
                             zbv_times=case.get("zbv_times") if schedule == "zbv" else None)
    else:
        use_one_backward(engine)
    # the parameters whose weight gradients a W computed (ZB-H1's and ZB-V's), filled as the steps run
    deferred = record_deferred_weights(engine) if schedule in ("zero_bubble", "zbv") else set()
    recorded = record_optimizer_gradients(engine)
    at_step = [None]  # the step running, for overflow_in_gradient
    overflowed = overflow_in_gradient(engine, *case["overflow_in_gradient"], at_step) if (
        "overflow_in_gradient" in case) else []
    replica, replicas = module.context.replica(engine.grid.data_parallel_id, engine.grid.get_data_parallel_world_size())
    batch = make_batch(micro_batch_size * gas * replicas * (2 if objective.preference else 1), seq_len,
                       config.vocab_size, seed=1)
    held = {}
    if objective.preference:
        pairs = preference_pairs(batch)
        if objective.needs_reference:
            pairs, held["reference"] = reference_pass(engine, pairs, micro_batch_size, gas, seq_len, tensor_parallel)
        rows = lambda count: pair_micro_batches(pairs, micro_batch_size, count, replicas, replica, seq_len)  # noqa
    else:
        rows = lambda count: micro_batches(batch, micro_batch_size, count, replicas, replica)  # noqa
    losses, read, rewards, scales = [], [], [], []
    for at_step[0] in range(steps):  # the same batch every step: the loss must fall
        stream = counted(map(functools.partial(split_micro_batch, module.context), rows(gas)), read)
        step_batches = step_micro_batches(engine, stream, gas)
        step_batches = token_mean_micro_batches(engine, step_batches, global_loss_units(engine, step_batches))
        losses.append(float(engine.train_batch(iter(step_batches))))
        scales.append(loss_scaler_state(engine))
        if objective.preference:
            rewards.append(module.loss_fn.take_metrics())
    where = f"dp{engine.grid.data_parallel_id}.tp{engine.grid.get_slice_parallel_rank()}"
    # the weights the steps leave (ZeRO's flat fp32 partitions, offloaded or not, copied back into the module's)
    weights = all_ranks_gradients([{name: p.detach().clone() for name, p in engine.module.named_parameters()}], where)
    # evaluation: 3 micro-batches (no multiple of the stages), the loss broadcast from the last chunk's rank
    eval_rows = map(functools.partial(split_micro_batch, module.context), rows(3))
    eval_loss = float(engine.eval_batch(eval_rows, num_micro_batches=3))
    received = getattr(engine, "_input_shapes", {})  # the chunked engine's: each boundary's tuple it receives
    return losses, recorded, weights, {**held, "where": where, "stage": engine.stage_id,
                                       "data_parallel_rank": engine.grid.data_parallel_id,
                                       "waiting": max(waiting, default=0), "read": len(read), "eval_loss": eval_loss,
                                       "checkpointed": len(checkpointed), "rewards": rewards, "loss_scales": scales,
                                       "overflowed": overflowed, "deferred_weights": sorted(deferred),
                                       "measured_times": getattr(engine, "zbv_measured_times", None),
                                       "expert_slices": sorted({tuple(p.expert_slice) for p in module.parameters()
                                                                if hasattr(p, "expert_slice")}),
                                       "bounds": bounds, "unit_costs": units and units.numbers(),
                                       "received_tuples": sorted(map(len, received.values()))}


def measured_bounds(case, schedule, config, micro_batch_size, gas, seq_len):
    """The trainer's partition=balanced on the device's measured costs (engines/cost_calibration.py: every rank
    times the units, all of them take the mean) for this case: (the agreed UnitCosts, the chunks' bounds)."""
    virtual_stages = case.get("virtual_stages") if schedule == "interleaved_1f1b" else None
    zbv_times = case.get("zbv_times") if schedule == "zbv" else None
    cfg = checked_config(OmegaConf.create(dict(
        pipeline_schedule=schedule, num_stages=case["stages"], virtual_stages=virtual_stages,
        partition_costs="measured", precision="fp32", zero_stage=1, micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gas, seq_length=seq_len, loss_chunk_tokens=case.get("loss_chunk_tokens",
                                                                                        CHUNK_TOKENS),
        zbv_times=list(zbv_times) if zbv_times else None)))
    units = agreed_unit_costs(cfg, config)
    workload = Workload(seq_length=seq_len, micro_batch_size=micro_batch_size, micro_batches=gas, precision="fp32",
                        pipeline_schedule=schedule, virtual_stages=virtual_stages or 1, zbv_times=cfg.zbv_times and
                        OmegaConf.to_container(cfg.zbv_times), loss_chunk_tokens=cfg.loss_chunk_tokens)
    return units, list(configured_stage_bounds(cfg, config, workload, units))


def preference_pairs(batch):
    """Pairs from a batch's rows as the trainer tokenizes them (lists of ids, labels -100 on the prompt): rows 2i
    and 2i + 1 are pair i's chosen and rejected responses to one prompt."""
    input_ids, attention_mask, _ = batch
    rows = [ids[:int(mask.sum())].tolist() for ids, mask in zip(input_ids, attention_mask)]
    pairs = []
    for chosen, rejected in zip(rows[0::2], rows[1::2]):
        rejected = chosen[:PROMPT_TOKENS] + rejected[PROMPT_TOKENS:]
        pairs.append({f"{side}_{key}": ids if key == "input_ids" else [-100] * PROMPT_TOKENS + ids[PROMPT_TOKENS:]
                      for side, ids in (("chosen", chosen), ("rejected", rejected))
                      for key in ("input_ids", "labels")})
    return pairs


def reference_pass(engine, pairs, micro_batch_size, gas, seq_len, tensor_parallel):
    """The pairs with their reference log-probabilities, computed by the engine's schedule (forward only, the
    starting weights, adapters off), and those values."""
    cfg = SimpleNamespace(micro_batch_size=micro_batch_size, seq_length=seq_len, gradient_accumulation_steps=gas,
                          tensor_parallel_size=tensor_parallel)
    reads_data = engine.is_first_stage() or engine.is_last_stage()
    reference = compute_reference(engine, pairs if reads_data else None, len(pairs), cfg, pad_id=0)
    return WithReference(pairs, reference["chosen"], reference["rejected"]), [
        reference[side].tolist() for side in ("chosen", "rejected")]


def pair_micro_batches(pairs, micro_batch_size, count, replicas, replica, seq_len):
    """The micro-batches of one replica: pair block (step * replicas + replica) for each step, collated."""
    for step in range(count):
        start = (step * replicas + replica) * micro_batch_size
        yield collate_preference([pairs[i] for i in range(start, start + micro_batch_size)], seq_len, pad_id=0)


def worst_error(ref_steps, steps, what):
    """The largest error of a tensor (a gradient, a weight) relative to its largest element, over all steps, and
    where it is."""
    errors = [(((g[n].float() - r[n].float()).abs().max() / r[n].float().abs().max().clamp(min=1e-30)).item(), step,
               n) for step, (r, g) in enumerate(zip(ref_steps, steps)) for n in r]
    error, step, name = max(errors, default=(0.0, None, None))
    return {f"max_{what}_error": error, f"worst_{what}": f"step {step} {name}"}


def count_calls(owner, name):
    """[None per call] of owner.<name> from now on."""
    calls, function = [], getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(None)
        return function(*args, **kwargs)
    setattr(owner, name, counting)
    return calls


def counted(items, read):
    for item in items:
        read.append(1)
        yield item


def all_ranks_gradients(recorded, replica):
    """Each step's gradients of every rank, keyed by the rank's data-parallel replica and tensor-parallel rank, and
    by name. The flat buffers of ZeRO and the bf16 optimizer (named group<i>.<j>) hold other parameters under another
    layout: there the losses, equal bit for bit, are the comparison. Gathered as fp32 numpy arrays, which pickle as
    their bytes (a tensor pickles through a torch.save of its own: most of a gather's CPU); bf16 values are exact in
    fp32, where worst_error compares them anyway."""
    local = [{name: grad.float().numpy() for name, grad in step.items() if not name.startswith("group")}
             for step in recorded]
    gathered = [None] * torch.distributed.get_world_size()
    collectives.all_gather_object(gathered, (replica, local))
    return [{f"{where}.{compared_name(name, rank)}": torch.from_numpy(grad) for rank, (where, steps) in
             enumerate(gathered) for name, grad in steps[step].items()} for step in range(len(recorded))]


def compared_name(name, rank):
    """A parameter's name as runs under different schedules compare it: Gemma 4's per-layer norm is one Parameter
    a rank, named by the rank's first decoder layer, which the chunked schedules place elsewhere than 1F1B; summed
    over the stages as a tied weight's, each rank's copy holds the whole gradient, so it goes by the rank."""
    return f"rank{rank}.per_layer_projection_norm.weight" if name.endswith(".per_layer_projection_norm.weight") \
        else name


def overflow_in_gradient(engine, name, step, at_step):
    """One element of parameter `name`'s gradient made inf as it is computed in step `step` (its first micro-batch),
    on the rank that holds it: by the backward (a gradient hook), or by W where the schedule defers it (ZB-H1 and
    ZB-V: the W work the queue computes, before autograd's accumulation and DeepSpeed's hooks take it), after the B
    that sent the input gradients on finite. fp16's loss scaler must see it and skip the step. Returns [where it was
    computed: "W" or "backward"] on that rank."""
    param = dict(engine.module.named_parameters()).get(name)
    if param is None:
        return []
    computed = []

    def with_inf(grad, where):
        if at_step[0] != step or computed:
            return grad
        computed.append(where)
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad
    queue = engine.module.parallel.weight_grads
    if queue is not None:
        add = queue.add
        queue.add = lambda work: add(lambda: [(p, with_inf(g, "W") if p is param else g) for p, g in work()])
    param.register_hook(lambda grad: grad if grad is None else with_inf(grad, "backward"))  # None: B deferred it
    return computed


def record_waiting_before_backward(queue):
    """[micro-batches waiting for their W as each B starts]: what the schedule's cap bounds."""
    waiting, defer = [], queue.defer

    def recording_defer():
        waiting.append(len(queue))
        return defer()
    queue.defer = recording_defer
    return waiting


def compared(reference, run):
    """One schedule's run against 1F1B's: what the test asserts."""
    (ref_losses, ref_grads, ref_weights, ref_held), (losses, grads, weights, held) = reference, run
    return {**held, "losses": losses, "ref_losses": ref_losses, "ref_eval_loss": ref_held["eval_loss"],
            "ref_rewards": ref_held["rewards"], "ref_reference": ref_held.get("reference"),
            "ref_loss_scales": ref_held["loss_scales"], "grad_steps": [len(ref_grads), len(grads)],
            "grad_names": [sorted(g) for g in ref_grads] == [sorted(g) for g in grads],
            "weight_names": sorted(ref_weights[0]) == sorted(weights[0]),
            **worst_error(ref_grads, grads, "grad"), **worst_error(ref_weights, weights, "weight"),
            "compared_grads": sum(len(r) for r in ref_grads), "compared_weights": len(ref_weights[0])}


def by_name(run):
    """A run with every rank's gradients, by name: the chunked schedules' ranks hold other layers than 1F1B's."""
    losses, recorded, weights, held = run
    return losses, all_ranks_gradients(recorded, held["where"]), weights, held


def allow_fp16_on_cpu():
    """DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (CPUs without AVX512-FP16 or AMX);
    torch computes fp16 on any CPU all the same (slower), and the schedules' arithmetic is what the cases check."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def run(rank, cases, steps, micro_batch_size, gas, seq_len, out_dir):
    init_distributed(timeout_minutes=2)
    allow_fp16_on_cpu()
    results, groups = {}, ProcessGroupPool()  # every run's engine its own groups, made once for them all
    for case in cases:
        case_steps = case.get("steps", steps)
        with groups.run():
            reference = train(case, "1f1b", case_steps, micro_batch_size, gas, seq_len)
        named_reference, results[case["name"]] = by_name(reference), {}
        for schedule in case["schedules"]:  # ZB-H1 runs 1F1B's layers per rank: each rank's own gradients compared
            with groups.run():
                ours = train(case, schedule, case_steps, micro_batch_size, gas, seq_len)
            results[case["name"]][schedule] = (compared(reference, ours) if schedule == "zero_bubble" else
                                               compared(named_reference, by_name(ours)))
        torch.distributed.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
