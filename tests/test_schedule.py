"""The schedules against DeepSpeed's 1F1B: zero_bubble (ZB-H1, schedules/orders.py), zbv and interleaved_1f1b
(engines/chunked_engine.py) give the same losses and gradients, and the orders they run are valid and fill the
bubble; their bad configs are refused at start-up. Resuming across schedules: tests/test_resume.py and
tests/test_reliability.py."""
import glob
import itertools
import json

import pytest
from omegaconf import OmegaConf
from transformers import LlamaConfig

from checkpoints.hf_to_ds import convert_hf_to_ds
from models.partition import decoder_counts_of_bounds, rank_chunk_layers, stage_bounds_from_decoder_counts
from planner.stage_costs import format_stage_plan, stage_plan
from planner.workload import Workload
from tests import schedule_worker
from tests.conftest import HEAVY_LAUNCHES
from tests.distributed import spawn
from tests.launch import demo_overrides, run_in_process
from tests.tiny_models import TINY_CONFIGS, make_model
from engines.chunked_engine import stage_reads_data
from errors import ConfigError
from training.config_checks import checked_config
from training.run_spec import configured_stage_bounds
from schedules.orders import rank_orders, stage_orders
from schedules.rules import chunk_ids, chunks_per_rank
from schedules.simulator import simulate

# 2 steps of one batch: the second step's gradients are taken at the weights and Adam state the first step left, the
# weights after both compared, and the loss falls; fp16's case takes 4 (its second and fourth overflow and are
# skipped).
STEPS, MICRO_BATCH, GAS, SEQ = 2, 2, 4, 16
CHUNKED = ("zbv", "interleaved_1f1b")  # interleaved_1f1b with virtual_stages=2 (the cases' virtual_stages)
# name: (tiny config, case settings); all on 4 processes, each case's schedules against its one 1F1B run. The matrix
# the cases make (what each covers: docs/pipeline-schedules.md#tested).
CASES = {
    # Several chunks per rank (engines/chunked_engine.py), on 4 and 2 ranks, tied and untied: "8layers" models
    # have a decoder layer per chunk on 4 ranks. Their ranks hold other layers than 1F1B's: every gradient is
    # compared by name across all ranks (and data-parallel replicas). ZB-V adds the tied weight's embedding and head
    # gradients on one rank in the order its Bs run, 1F1B as two partial sums all-reduced: fp32 rounding of ~1e-7
    # that Adam carries into later steps' gradients (up to 9.5e-7 here, 1.05e-6 of a layer norm's when the launch ran
    # 6 steps), hence zbv_tolerance 2e-6 for tied models. zero_bubble_max_waiting (max_waiting, ZB-H1's only): 2 caps
    # stage 3 of 4 (ZB-H1 holds 3 there), 0 runs each W right after its B.
    # zbv_times=auto (the trainer's default): step 2's F, B, W measured, step 3 in the V order made for them.
    "4stages_tied_checkpointing": ("tied_8layers", dict(
        stages=4, schedules=("zero_bubble", *CHUNKED), virtual_stages=2, checkpoint_interval=1, max_waiting=2,
        zbv_tolerance=2e-6, zbv_times="auto", steps=3)),
    # preference pairs (evaluation/reference.py's pass under each schedule for DPO; the rewards compared too), LoRA
    # (the adapters' gradients, the base frozen; ZB-V's W computes only theirs)
    "4stages_dpo_lora": ("llama2_8layers", dict(stages=4, schedules=CHUNKED, virtual_stages=2, objective="dpo",
                                                lora=dict(rank=4))),
    "2stages_x_2dp_tied_checkpointing_simpo": ("tied", dict(
        stages=2, schedules=("zero_bubble", *CHUNKED), virtual_stages=2, checkpoint_interval=1, max_waiting=0,
        objective="simpo", zbv_tolerance=2e-6)),
    "2stages_x_2dp_dpo_lora": ("llama2", dict(stages=2, schedules=CHUNKED, virtual_stages=2, objective="dpo",
                                              lora=dict(rank=4))),
    # tensor parallelism 2 (sequence parallel): each rank's shards, by tensor-parallel rank; a tied model's under
    # ZB-H1 with the recomputed gather, under the chunked schedules (4 chunks of one decoder layer, the tied embedding
    # and head on one pair under ZB-V) in 2stages_x_tp2_tied. Two stages show what four would (8 processes): each
    # stage's pair splits its chunks alike wherever the chunk sits.
    "2stages_x_tp2_tied_recompute_gather": ("tied", dict(stages=2, schedules=("zero_bubble",), tensor_parallel=2,
                                                         recompute_sequence_gather=True)),
    "2stages_x_tp2_tied": ("tied", dict(stages=2, schedules=CHUNKED, virtual_stages=2, tensor_parallel=2,
                                        zbv_tolerance=2e-6)),
    # context parallelism 2: each rank of a stage's pair takes its tokens of every sequence: SFT's token mean, and
    # DPO's pair mean and reference pass across them
    "2stages_x_cp2": ("llama3", dict(stages=2, schedules=CHUNKED, virtual_stages=2, context_parallel=2)),
    "2stages_x_cp2_dpo": ("llama3", dict(stages=2, schedules=CHUNKED, virtual_stages=2, context_parallel=2,
                                         objective="dpo")),
    # DeepSpeed's other gradient buffers, bf16 losses bit-identical: ZeRO-1's (bf16: the trainer's default), the bf16
    # optimizer's fp32 accumulation (filled after each backward, or by gradient hooks) and offloaded ZeRO-1's. Under
    # the chunked schedules the flat buffers hold other parameters under another layout: there the losses, and the
    # weights the steps leave, are the comparison.
    "2stages_x_2dp_zero1_clipped": ("qwen2", dict(stages=2, schedules=("zero_bubble",), deepspeed=dict(
        zero_optimization={"stage": 1}, gradient_clipping=0.5))),
    "2stages_x_2dp_bf16_zero1": ("qwen2", dict(stages=2, schedules=("zero_bubble",), tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1}, bf16={"enabled": True}))),
    # bf16 with fp32 sums (the trainer's default) and ZeRO-1
    "2stages_x_2dp_bf16_fp32_accumulation": ("llama3", dict(
        stages=2, schedules=("zero_bubble", *CHUNKED), virtual_stages=2, tolerance=0.0, deepspeed=dict(
            zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}))),
    "2stages_x_2dp_bf16_fp32_accumulation_in_hooks": ("llama2", dict(
        stages=2, schedules=("zero_bubble",), tolerance=0.0, deepspeed=dict(
            zero_optimization={"stage": 1}, bf16={"enabled": True, "immediate_grad_update": True},
            data_types={"grad_accum_dtype": "fp32"}))),
    "2stages_x_2dp_bf16_offload": ("tied", dict(stages=2, schedules=("zero_bubble",), tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True}))),
    # fp32 sums (the trainer's default) where the bf16 optimizer does not take them: offloaded ZeRO-1's grad_accum
    # (filled by gradient hooks, W's included), and the bf16 optimizer under tensor parallelism, here without
    # sequence parallelism (every rank of the pair runs every token: all-reduces instead of the token scatter).
    "2stages_x_2dp_bf16_offload_fp32_accumulation": ("llama2", dict(
        stages=2, schedules=("zero_bubble",), tolerance=0.0, deepspeed=dict(
            zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True},
            data_types={"grad_accum_dtype": "fp32"}))),
    "2stages_x_tp2_bf16_fp32_accumulation_no_sequence_parallel": ("qwen2", dict(
        stages=2, schedules=("zero_bubble",), tensor_parallel=2, sequence_parallel=False, tolerance=0.0,
        deepspeed=dict(zero_optimization={"stage": 1}, bf16={"enabled": True},
                       data_types={"grad_accum_dtype": "fp32"}))),
    # offload_optimizer=cpu (ZeRO-1's fp32 partition and Adam's moments on the host), fp32, under both, ZB-V's V order
    # made for measured times (zbv_times: F, B, W in ms; another order than F = B = W's), 8 layers in 4 chunks split
    # by partition_costs=measured (the units timed on every rank, their mean agreed: engines/cost_calibration.py)
    "2stages_x_2dp_offload_tied": ("tied_8layers", dict(
        stages=2, schedules=CHUNKED, virtual_stages=2, zbv_times=(102, 129, 63), zbv_tolerance=2e-6,
        partition_costs="measured",
        deepspeed=dict(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}))),
    # fp16 (ZeRO-1, fp32 sums) with its dynamic loss scaler at 2^20: the second step overflows, is skipped and halves
    # it, the third trains at the halved scale; in the fourth one element of the last decoder's down_proj weight
    # gradient is made inf (overflow_in_gradient: the parameter, the step), which ZB-H1 and ZB-V compute in W, after
    # every input gradient has gone on finite: the step is skipped and the scale halved again. Losses, loss scales,
    # ZB-H1's gradients and the weights the steps leave equal 1F1B's bit for bit.
    "2stages_x_2dp_fp16": ("llama3", dict(
        stages=2, schedules=("zero_bubble", *CHUNKED), virtual_stages=2, steps=4, tolerance=0.0,
        overflow_in_gradient=("4.mlp.down_proj.weight", 3), deepspeed=dict(
            zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "fp32"},
            fp16={"enabled": True, "initial_scale_power": 20, "hysteresis": 1}))),
}

def eight_layer_checkpoints(root, names):
    """{name_8layers: (hf_dir, ds_dir)}: tiny models with 8 decoder layers."""
    dirs = {}
    for name in names:
        config = TINY_CONFIGS[name]()
        config.num_hidden_layers = 8
        hf_dir, ds_dir = str(root / name / "hf"), str(root / name / "ds")
        make_model(config, hf_dir)
        convert_hf_to_ds(hf_dir, ds_dir)
        dirs[f"{name}_8layers"] = (hf_dir, ds_dir)
    return dirs


def launch_cases(cases, checkpoints, processes, tmp_path):
    """Every case's runs in one launch of `processes` ranks (tests/schedule_worker.py), each rank's run under each
    schedule checked against the case's 1F1B run; returns every rank's results."""
    launched = [dict(name=name, hf_dir=checkpoints[model][0], ds_dir=checkpoints[model][1], **settings)
                for name, (model, settings) in cases.items()]
    (tmp_path / "ranks").mkdir()
    spawn(schedule_worker.run, processes, launched, STEPS, MICRO_BATCH, GAS, SEQ, str(tmp_path / "ranks"))
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "ranks" / "rank*.json")))]
    assert len(ranks) == processes
    for (name, (_, settings)), rank in itertools.product(cases.items(), ranks):
        assert sorted(rank[name]) == sorted(settings["schedules"]), name
        for schedule, result in rank[name].items():
            assert_equals_1f1b(result, settings, schedule, (name, schedule))
    return ranks


@pytest.mark.slow
@pytest.mark.xdist_group(HEAVY_LAUNCHES)
def test_losses_and_gradients_equal_1f1b(tiny_checkpoints, tmp_path):
    checkpoints = {**tiny_checkpoints, **eight_layer_checkpoints(tmp_path / "models", ["llama2", "tied"])}
    ranks = launch_cases(CASES, checkpoints, 4, tmp_path)
    for (name, (_, settings)), rank in itertools.product(CASES.items(), ranks):
        if settings.get("zbv_times") == "auto":  # every rank agreed on each stage's measured [F, B, W]
            assert rank[name]["zbv"]["measured_times"] == ranks[0][name]["zbv"]["measured_times"], name
        for schedule in CHUNKED if settings.get("partition_costs") == "measured" else ():
            # every rank the same measured costs and partition, from times of its own (losses as 1F1B's: above)
            assert rank[name][schedule]["unit_costs"] == ranks[0][name][schedule]["unit_costs"], name
            assert rank[name][schedule]["bounds"] == ranks[0][name][schedule]["bounds"], name
            assert rank[name][schedule]["bounds"][-1] == 11 and min(rank[name][schedule]["unit_costs"][4:8]) > 0, name


def assert_equals_1f1b(result, settings, schedule, case):
    """One rank's run of a case under a schedule against the case's 1F1B run."""
    tolerance = settings.get(f"{schedule}_tolerance", settings.get("tolerance", 1e-6))
    steps = settings.get("steps", STEPS)
    flat_buffers = schedule in CHUNKED and "deepspeed" in settings
    # one step overflows at the loss scaler's 2^20, another where overflow_in_gradient makes an inf
    skipped = ("fp16" in settings.get("deepspeed", {})) + ("overflow_in_gradient" in settings)
    assert result["grad_steps"] == [steps - skipped] * 2 and result["grad_names"], case
    assert result["compared_grads"] or flat_buffers, case
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=tolerance, rel=0), case
    assert result["eval_loss"] == pytest.approx(result["ref_eval_loss"], abs=tolerance, rel=0), case
    assert result["max_grad_error"] <= tolerance, (case, result["worst_grad"])
    assert result["weight_names"] and result["compared_weights"], case
    assert result["max_weight_error"] <= tolerance, (case, result["worst_weight"])
    assert result["loss_scales"] == result["ref_loss_scales"], case
    auto = schedule == "zbv" and settings.get("zbv_times") == "auto"
    assert len(result["measured_times"] or []) == (settings["stages"] if auto else 0), case
    if skipped:  # and no other: the scale halved once for each
        assert len({s["last_overflow_iter"] for s in result["loss_scales"]} - {-1}) == skipped, case
    if "overflow_in_gradient" in settings and result["overflowed"]:  # the rank holding it: where its schedule took it
        assert result["overflowed"] == ["backward" if schedule in ("1f1b", "interleaved_1f1b") else "W"], case
    assert result["losses"][-1] < result["losses"][0], case  # it trained
    assert (result["checkpointed"] > 0) == ("checkpoint_interval" in settings), case
    if "expert_parallel" in settings:  # each data-parallel rank of a stage holds its own share of the experts
        first, count, total = result["expert_slices"][0]
        assert len(result["expert_slices"]) == 1 and count * settings["expert_parallel"] == total, case
        assert first == result["data_parallel_rank"] * count, case
    assert len(result["rewards"]) == (steps if "objective" in settings else 0) and all(result["rewards"]), case
    for ours, theirs in zip(result["rewards"], result["ref_rewards"]):
        assert ours == pytest.approx(theirs, rel=1e-6, abs=tolerance), case
    if settings.get("objective") == "dpo":
        chosen_and_rejected = sum(result["ref_reference"], [])
        assert sum(result["reference"], []) == pytest.approx(chosen_and_rejected, rel=1e-6, abs=0), case
    # the engine reads micro-batches on the ranks of the first and the last chunk only, where the trainer builds loaders
    reads_data = stage_reads_data(schedule, settings["stages"], result["stage"], settings.get("virtual_stages"))
    assert result["read"] == (steps * GAS if reads_data else 0), case
    if schedule in CHUNKED:
        return
    order = stage_orders(settings["stages"], GAS, max_waiting=settings.get("max_waiting"))[result["stage"]]
    assert result["waiting"] == max(sum(k == "B" for k, _ in order[:i]) - sum(k == "W" for k, _ in order[:i])
                                    for i, (kind, _) in enumerate(order) if kind == "B"), case


@pytest.mark.parametrize("max_waiting", [None, 0, 1, 3])
@pytest.mark.parametrize("stages,micro_batches", [(1, 3), (2, 1), (2, 8), (3, 5), (4, 8), (8, 64)])
def test_orders_are_complete_and_respect_memory(stages, micro_batches, max_waiting):
    for stage, order in enumerate(stage_orders(stages, micro_batches, max_waiting=max_waiting)):
        assert sorted(order) == sorted((kind, j) for kind in "FBW" for j in range(micro_batches))
        for kind in "FBW":  # every kind in micro-batch order: activations and gradients arrive in order
            assert [j for k, j in order if k == kind] == list(range(micro_batches))
        held = stage if max_waiting is None else min(stage, max_waiting)
        between, waiting_for_w = 0, 0
        for kind, _ in order:
            between += {"F": 1, "B": 0, "W": -1}[kind]
            waiting_for_w += {"F": 0, "B": 1, "W": -1}[kind]
            assert between <= stages  # never more micro-batches between F and W than 1F1B holds on stage 0
            assert waiting_for_w <= held + (kind == "B")  # the cap, but for the B whose W may come next


@pytest.mark.parametrize("max_waiting", [None, 0, 1, 3])
@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (2, 8), (4, 16), (8, 64)])
@pytest.mark.parametrize("forward,backward,weight", [(1, 1, 1), (1, 2, 1), (1, 1.2, 0.8), (1, 1.5, 0.5)])
def test_simulated_step_is_the_zb_h1_bound(stages, micro_batches, forward, backward, weight, max_waiting):
    times = [{"F": forward, "B": backward, "W": weight}] * stages
    step = {schedule: max(end for _, end in simulate(stages, micro_batches, times, schedule, max_waiting).values())
            for schedule in ("1f1b", "zero_bubble")}
    work = micro_batches * (forward + backward + weight)
    assert step["1f1b"] == pytest.approx(work + (stages - 1) * (forward + backward + weight))  # 1F1B's bubble
    # ZB-H1's (p-1)(F+B-W); each W fewer held back on the last stages costs one W
    filled = stages - 1 if max_waiting is None else min(max_waiting, stages - 1)
    assert step["zero_bubble"] == pytest.approx(work + (stages - 1) * (forward + backward) - filled * weight)


@pytest.mark.parametrize("overrides,message", [
    ({"pipeline_schedule": "gpipe"},
     "pipeline_schedule 'gpipe' is not one of ('1f1b', 'zero_bubble', 'interleaved_1f1b', 'zbv')."),
    ({"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2, "zero_bubble_max_waiting": 1},
     "zero_bubble_max_waiting=1 applies to pipeline_schedule=zero_bubble or zbv only (not interleaved_1f1b, whose "
     "backward is never split); set zero_bubble_max_waiting=null, or one of those schedules."),
    ({"pipeline_schedule": "zero_bubble", "zero_bubble_max_waiting": -1},
     "zero_bubble_max_waiting=-1 is not a number of micro-batches: set an integer >= 0, or null for ZB-H1's "
     "(stage s holds s)."),
    # the schedules with several chunks per rank (the demo model: 4 decoder layers, 2 stages)
    ({"virtual_stages": 2}, "virtual_stages=2 applies to pipeline_schedule=interleaved_1f1b only (not 1f1b); set "
     "virtual_stages=null, or pipeline_schedule=interleaved_1f1b."),
    ({"pipeline_schedule": "interleaved_1f1b"}, "pipeline_schedule=interleaved_1f1b with virtual_stages=null: set "
     "virtual_stages=2 or more (chunks of layers per rank)."),
    ({"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 3}, "pipeline_schedule=interleaved_1f1b splits the "
     "model into 6 chunks (2 stages x 3), more than its 4 decoder layers: use virtual_stages=2 or less."),
    ({"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2, "gradient_accumulation_steps": 3},
     "gradient_accumulation_steps=3 with pipeline_schedule=interleaved_1f1b on num_stages=2: Megatron's interleaved "
     "order takes micro-batches in groups of 2; use gradient_accumulation_steps=4 (a multiple of 2)."),
])
def test_bad_schedule_config_is_refused_before_start(demo_model, tmp_path, overrides, message):
    """The trainer's own start-up refuses each in one line, before any process group or file exists."""
    with pytest.raises(ValueError) as error:
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), 2)
    assert str(error.value) == message
    assert not (tmp_path / "run").exists()


def step_time(stages, micro_batches, times, schedule, **settings):
    return max(end for _, end in simulate(stages, micro_batches, times, schedule, **settings).values())


@pytest.mark.parametrize("stages,micro_batches", [(1, 3), (2, 1), (2, 4), (3, 7), (4, 8), (8, 16), (8, 64)])
@pytest.mark.parametrize("schedule,virtual_stages", [("zbv", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
def test_multi_chunk_orders_are_complete_and_respect_memory(stages, micro_batches, schedule, virtual_stages):
    if schedule == "interleaved_1f1b" and micro_batches % stages:
        with pytest.raises(ValueError, match=f"needs a multiple of {stages} micro-batches, not {micro_batches}"):
            rank_orders(schedule, stages, micro_batches, virtual_stages)
        return
    kinds = "FBW" if schedule == "zbv" else "FB"
    chunks = chunks_per_rank(schedule, virtual_stages)
    for rank, order in enumerate(rank_orders(schedule, stages, micro_batches, virtual_stages)):
        assert sorted(order) == sorted((kind, chunk, j) for kind in kinds for chunk in range(chunks)
                                       for j in range(micro_batches))
        for kind, chunk in itertools.product(kinds, range(chunks)):  # each chunk's micro-batches in order
            assert [j for k, c, j in order if (k, c) == (kind, chunk)] == list(range(micro_batches))
        change = {"F": 1, "B": 0 if schedule == "zbv" else -1, "W": -1}  # micro-batch-chunks held from F to W
        held = list(itertools.accumulate(change[kind] for kind, _, _ in order))
        if schedule == "zbv":  # 1F1B's first stage's activations: p whole-stage micro-batches = 2p chunks
            assert max(held) <= 2 * stages
        else:  # Megatron's warm-up count plus the steady state's one
            assert max(held) == min((stages - rank - 1) * 2 + (virtual_stages - 1) * stages + 1,
                                    micro_batches * virtual_stages)
    assert [chunk_ids(schedule, stages, rank, virtual_stages) for rank in range(stages)] == (
        [[rank, 2 * stages - 1 - rank] for rank in range(stages)] if schedule == "zbv" else
        [list(range(rank, stages * virtual_stages, stages)) for rank in range(stages)])


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("forward,backward,weight", [(1, 1, 1), (1, 2, 1), (1, 1.5, 0.5)])
def test_simulated_steps_are_the_closed_forms(stages, forward, backward, weight):
    """Each schedule's step against its closed form, m = p ... 64: 1F1B's (p-1)(F+B+W) bubble, interleaving's
    divided by v (Megatron's (p-1)/(v m) of the work), ZB-H1's (p-1)(F+B-W), and ZB-V at F = B = W: no bubble but
    the pipeline's fill, (p-1) chunk forwards (F/2), a third of ZB-H1's and below interleaving's for any v."""
    times = [{"F": forward, "B": backward, "W": weight}] * stages
    stage_time = forward + backward + weight
    for micro_batches in range(stages, 65, stages):
        work = micro_batches * stage_time
        assert step_time(stages, micro_batches, times, "1f1b") == pytest.approx(work + (stages - 1) * stage_time)
        for virtual_stages in (2, 4):
            assert step_time(stages, micro_batches, times, "interleaved_1f1b", virtual_stages=virtual_stages) == (
                pytest.approx(work + (stages - 1) * stage_time / virtual_stages))
        zb_h1 = step_time(stages, micro_batches, times, "zero_bubble")
        assert zb_h1 == pytest.approx(work + (stages - 1) * (forward + backward - weight))
        if forward == backward == weight:
            assert step_time(stages, micro_batches, times, "zbv") == pytest.approx(work + (stages - 1) * forward / 2)


@pytest.mark.parametrize("overrides,message", [
    (dict(pipeline_schedule="zbv", virtual_stages=2), "virtual_stages=2 applies to pipeline_schedule=interleaved_1f1b "
     "only (not zbv); set virtual_stages=null, or pipeline_schedule=interleaved_1f1b."),
    (dict(pipeline_schedule="interleaved_1f1b", virtual_stages=1), "pipeline_schedule=interleaved_1f1b with "
     "virtual_stages=1: set virtual_stages=2 or more (chunks of layers per rank)."),
    (dict(pipeline_schedule="interleaved_1f1b", virtual_stages=2, num_stages=4, gradient_accumulation_steps=6),
     "gradient_accumulation_steps=6 with pipeline_schedule=interleaved_1f1b on num_stages=4: Megatron's interleaved "
     "order takes micro-batches in groups of 4; use gradient_accumulation_steps=8 (a multiple of 4)."),
    (dict(zbv_times=[1, 2, 1]), "zbv_times=[1, 2, 1] applies to pipeline_schedule=zbv only (not 1f1b); set "
     "zbv_times=null, or pipeline_schedule=zbv."),
    *((dict(pipeline_schedule="zbv", num_stages=2, zbv_times=times), f"zbv_times={times} is not a chunk's [F, B, W] "
       "times: set three positive numbers within 8x of each other (the forward, input-gradient and weight-gradient "
       "times profile=true measures), or one such [F, B, W] per stage (2), auto to have the trainer measure them, or "
       "null for F = B = W.") for times in ([1, 9, 2], [1, 2], [[1, 2, 1]] * 3, [0, 1, 1], "measured")),
])
def test_bad_chunk_schedule_config_is_refused(overrides, message):
    with pytest.raises(ConfigError) as error:
        checked_config(OmegaConf.create(overrides))
    assert str(error.value) == message


def tiny_llama(layers):
    return LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       vocab_size=256)


@pytest.mark.parametrize("overrides,layers,message", [
    (dict(pipeline_schedule="zbv", num_stages=4), 6, "pipeline_schedule=zbv splits the model into 8 chunks (4 stages "
     "x 2), more than its 6 decoder layers: use num_stages=3 or less."),
    (dict(pipeline_schedule="interleaved_1f1b", virtual_stages=3, num_stages=2), 4, "pipeline_schedule="
     "interleaved_1f1b splits the model into 6 chunks (2 stages x 3), more than its 4 decoder layers: use "
     "virtual_stages=2 or less."),
    (dict(pipeline_schedule="zbv", num_stages=2, partition=[2, 2]), 8, "partition [2, 2] has 2 entries: "
     "pipeline_schedule=zbv splits the model into 4 chunks (2 stages x 2); give decoder layers per chunk, 4 entries."),
])
def test_chunks_the_model_cannot_fill_are_refused(overrides, layers, message):
    cfg = checked_config(OmegaConf.create(overrides))
    with pytest.raises(ConfigError) as error:
        configured_stage_bounds(cfg, tiny_llama(layers), Workload(pipeline_schedule=cfg.pipeline_schedule))
    assert str(error.value) == message


@pytest.mark.parametrize("schedule,virtual_stages,partition,counts", [
    ("zbv", None, "balanced", [2, 2, 2, 2]),  # embedding on chunk 0, head on chunk 3: both rank 0's
    ("zbv", None, [1, 3, 3, 1], [1, 3, 3, 1]),
    ("interleaved_1f1b", 2, "uniform", None),
])
def test_partition_splits_chunks(schedule, virtual_stages, partition, counts):
    cfg = checked_config(OmegaConf.create(dict(pipeline_schedule=schedule, virtual_stages=virtual_stages,
                                               num_stages=2, partition=partition)))
    bounds = configured_stage_bounds(cfg, tiny_llama(8), Workload(pipeline_schedule=schedule,
                                                                  zbv_times=cfg.zbv_times))
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == 8 + 3  # [embedding, 8 decoders, norm, head]
    if counts:
        assert decoder_counts_of_bounds(bounds) == counts
    layers = [rank_chunk_layers(bounds, schedule, 2, rank, virtual_stages) for rank in range(2)]
    assert sorted(sum(layers, [])) == list(zip(bounds, bounds[1:]))
    assert layers[0][0][0] == 0 and (bounds[3], 11) in layers[0 if schedule == "zbv" else 1]


def test_memory_plan_counts_each_schedules_chunks_in_flight():
    """The plan's micro-batch-chunks in flight per rank come from the orders: interleaving's warm-up raises the first
    ranks' ((p - r - 1)·2 + (v - 1)·p + 1 chunks of 1/v of a stage against 1F1B's p - r whole stages), ZB-V holds
    at most 2p half-stage chunks on every rank (1F1B's first stage's p); each row lists its rank's chunks; async_save's
    snapshots hold the same state under every schedule."""
    model, stages, micro_batches = tiny_llama(16), 4, 8
    plans = {}
    for schedule, virtual_stages in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 1)):
        workload = Workload(pipeline_schedule=schedule, virtual_stages=virtual_stages, micro_batches=micro_batches,
                            async_save=True)
        chunks = stages * chunks_per_rank(schedule, virtual_stages)
        bounds = stage_bounds_from_decoder_counts([16 // chunks] * chunks, 16)
        plans[schedule] = stage_plan(model, bounds, workload)
        for rank, row in enumerate(plans[schedule]):
            assert row["chunks"] == rank_chunk_layers(bounds, schedule, stages, rank, virtual_stages)
    assert [row["in_flight"] for row in plans["1f1b"]] == [4, 3, 2, 1]
    assert [row["in_flight"] for row in plans["interleaved_1f1b"]] == [11, 9, 7, 5]
    assert all(row["in_flight"] + row["waiting_for_weight_grads"] <= 2 * stages for row in plans["zbv"])
    first = {schedule: plan[0]["activation_bytes"] for schedule, plan in plans.items()}
    assert first["interleaved_1f1b"] > 1.3 * first["1f1b"]
    assert max(row["activation_bytes"] for row in plans["zbv"]) < 1.15 * first["1f1b"]
    assert format_stage_plan(plans["zbv"]).splitlines()[1].split()[:2] == ["0", "0-2+15-18"]  # embedding and head
    snapshots = {schedule: sum(row["snapshot_bytes"] for row in plan) for schedule, plan in plans.items()}
    assert snapshots["zbv"] == snapshots["interleaved_1f1b"] == snapshots["1f1b"] > 0  # async_save's: the same state


@pytest.mark.parametrize("stages,micro_batches", [(2, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("max_waiting", [0, 1, 3])
def test_zbv_holds_at_most_max_waiting_back_for_w(stages, micro_batches, max_waiting):
    """zero_bubble_max_waiting under zbv: at most that many micro-batch-chunks wait only for W on a rank (but for the
    B whose W may come next), and the cap costs step time only where it binds."""
    for order in rank_orders("zbv", stages, micro_batches, max_waiting=max_waiting):
        waiting = 0
        for kind, _, _ in order:
            waiting += {"F": 0, "B": 1, "W": -1}[kind]
            assert waiting <= max_waiting + (kind == "B")
    times = [{"F": 1, "B": 1, "W": 1}] * stages
    uncapped = step_time(stages, micro_batches, times, "zbv")
    capped = step_time(stages, micro_batches, times, "zbv", max_waiting=max_waiting)
    assert uncapped <= capped < step_time(stages, micro_batches, times, "1f1b")


# Mixtures of experts (docs/moe.md): the families of tests/tiny_models.py but Mixtral and GLM-4.5 (their experts and
# routers are OLMoE's and DeepSeek-V3's kinds; every family's math against transformers: tests/test_moe.py,
# tests/test_deepseek_v3.py), each case a layout, 4 chunks of one
# decoder layer under the chunked schedules, the routing statistics (counts; with the load-balancing loss the
# probability sums, whose gradient reaches every router) carried between chunks as between stages, handed over in
# place on the last rank under ZB-V; the experts' and routers' weight gradients computed in W under zero_bubble and
# zbv. Every stage's backward is one pass from all its floating outputs (engines/pipeline_engine.py), so the gradients
# are 1F1B's bit for bit; under ZB-V the tied Qwen3-MoE sums the embedding's and the head's on one rank, as the dense
# tied cases. ep2, expert parallelism 2: each data-parallel rank of a stage holds half of every sparse layer's
# experts, the tokens exchanged by all-to-all in every chunk's forward and backward (and recomputation), none in W.
# tp2 (sequence parallel): each rank routes its tokens through whole experts, their gradients summed over the group in
# W. bf16: the trainer's default (ZeRO-1, fp32 sums).
MOE = dict(stages=2, schedules=("zero_bubble", *CHUNKED), virtual_stages=2, tolerance=0.0)
BF16_ZERO1 = dict(zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
MOE_CASES = {
    "moe_qwen3_moe_2dp_ep2_checkpointing": ("qwen3_moe", dict(MOE, expert_parallel=2, checkpoint_interval=1,
                                                              zbv_tolerance=2e-6)),
    "moe_qwen2_moe_tp2": ("qwen2_moe", dict(MOE, tensor_parallel=2)),
    "moe_olmoe_2dp_ep2_bf16_fp32_accumulation": ("olmoe", dict(MOE, expert_parallel=2, deepspeed=BF16_ZERO1)),
    # GPT-OSS's expert and router biases: their gradients summed over the tensor-parallel pair in W (the chunked
    # schedules under tp2: moe_qwen2_moe_tp2)
    "moe_gpt_oss_tp2": ("gpt_oss", dict(MOE, schedules=("zero_bubble",), tensor_parallel=2)),
    # DeepSeek-V3's sequence-wise balance loss (moe.sequence_aux_loss_coef): its per-layer sums in the tuple's
    # floating slot, as the load-balancing loss's probability sums
    "moe_deepseek_v3_2dp_sequence_loss": ("deepseek_v3", dict(MOE, model_config={"sequence_aux_loss_coef": 0.1})),
    # DPO (the load-balancing loss added as TRL adds it) with LoRA on the attention and, as peft reads Qwen3-MoE's
    # gate/up/down, on the experts (their adapters' gradients in B: models/weight_grads.py parameter_or_view)
    "moe_qwen3_moe_2dp_dpo_lora": ("qwen3_moe", dict(MOE, objective="dpo", lora=dict(rank=4), zbv_tolerance=2e-6)),
    # fp16 as 2stages_x_2dp_fp16: the scaler overflows at 2^20 in the second step, and in the fourth the last sparse
    # layer's router weight gradient is made inf, which ZB-H1 and ZB-V compute in W
    "moe_qwen2_moe_2dp_fp16": ("qwen2_moe", dict(MOE, steps=4, overflow_in_gradient=("4.mlp.gate.weight", 3),
                                                  deepspeed=dict(zero_optimization={"stage": 1},
                                                                 data_types={"grad_accum_dtype": "fp32"},
                                                                 fp16={"enabled": True, "initial_scale_power": 20,
                                                                       "hysteresis": 1}))),
}


@pytest.mark.slow
@pytest.mark.xdist_group(HEAVY_LAUNCHES)
def test_moe_losses_and_gradients_equal_1f1b(tiny_moe_checkpoints, tiny_deepseek_checkpoints, tmp_path):
    launch_cases(MOE_CASES, {**tiny_moe_checkpoints, **tiny_deepseek_checkpoints}, 4, tmp_path)
