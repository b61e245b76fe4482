"""The zero-bubble schedule (training/schedule.py) against DeepSpeed's 1F1B: same losses and gradients, and the
orders it runs are valid and fill the bubble. Resuming across the two: tests/test_reliability.py (the killed save's
and the SIGTERM's resumes)."""
import glob
import json

import pytest

from tests import schedule_worker
from tests.distributed import spawn
from tests.launch import demo_overrides, run_in_process
from training.schedule import simulate, stage_orders

STEPS, MICRO_BATCH, GAS, SEQ = 3, 2, 4, 16  # 3 steps of one batch: every step's gradients compared, the loss falls
CASES = {  # name: (tiny config, case settings); all on 4 processes
    # zero_bubble_max_waiting: 2 caps stage 3 of 4 (ZB-H1 holds 3 there), 0 runs each W right after its B
    "4stages_max_waiting_2": ("llama2", dict(stages=4, max_waiting=2)),
    "2stages_x_2dp_tied_checkpointing_max_waiting_0": ("tied", dict(stages=2, checkpoint_interval=1, max_waiting=0)),
    "2stages_x_tp2": ("llama3", dict(stages=2, tensor_parallel=2)),
    "2stages_x_tp2_recompute_gather": ("llama2", dict(stages=2, tensor_parallel=2, recompute_sequence_gather=True)),
    "2stages_x_tp2_no_sequence_parallel": ("qwen2", dict(stages=2, tensor_parallel=2, sequence_parallel=False)),
    # DeepSpeed's other gradient buffers, bf16 losses bit-identical: ZeRO-1's (bf16: the trainer's default), the bf16
    # optimizer's fp32 accumulation (filled after each backward, or by gradient hooks) and offloaded ZeRO-1's.
    "2stages_x_2dp_zero1_clipped": ("qwen2", dict(stages=2, deepspeed=dict(
        zero_optimization={"stage": 1}, gradient_clipping=0.5))),
    "2stages_x_2dp_bf16_zero1": ("qwen2", dict(stages=2, tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1}, bf16={"enabled": True}))),
    "2stages_x_2dp_bf16_fp32_accumulation": ("llama3", dict(stages=2, tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}))),
    "2stages_x_2dp_bf16_fp32_accumulation_in_hooks": ("llama2", dict(stages=2, tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1}, bf16={"enabled": True, "immediate_grad_update": True},
        data_types={"grad_accum_dtype": "fp32"}))),
    "2stages_x_2dp_bf16_offload": ("tied", dict(stages=2, tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True}))),
    # fp32 sums (the trainer's default) where the bf16 optimizer does not take them: offloaded ZeRO-1's grad_accum
    # (filled by gradient hooks, W's included), and the bf16 optimizer under tensor parallelism.
    "2stages_x_2dp_bf16_offload_fp32_accumulation": ("llama2", dict(stages=2, tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True},
        data_types={"grad_accum_dtype": "fp32"}))),
    "2stages_x_tp2_bf16_fp32_accumulation": ("qwen2", dict(stages=2, tensor_parallel=2, tolerance=0.0, deepspeed=dict(
        zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}))),
}


@pytest.mark.slow
def test_losses_and_gradients_equal_1f1b(tiny_checkpoints, tmp_path):
    cases = [dict(name=name, hf_dir=tiny_checkpoints[model][0], ds_dir=tiny_checkpoints[model][1], **settings)
             for name, (model, settings) in CASES.items()]
    spawn(schedule_worker.run, 4, cases, STEPS, MICRO_BATCH, GAS, SEQ, str(tmp_path))
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(ranks) == 4
    for name, (_, settings) in CASES.items():
        tolerance = settings.get("tolerance", 1e-6)
        for rank in ranks:
            result = rank[name]
            assert result["grad_steps"] == [STEPS, STEPS] and result["grad_names"] and result["compared_grads"], name
            assert result["losses"] == pytest.approx(result["ref_losses"], abs=tolerance, rel=0), name
            assert result["max_grad_error"] <= tolerance, name
            assert result["losses"][-1] < result["losses"][0], name  # it trained
            order = stage_orders(settings["stages"], GAS, max_waiting=settings.get("max_waiting"))[result["stage"]]
            assert result["waiting"] == max(sum(k == "B" for k, _ in order[:i]) - sum(k == "W" for k, _ in order[:i])
                                            for i, (kind, _) in enumerate(order) if kind == "B"), name


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
    ({"pipeline_schedule": "gpipe"}, "pipeline_schedule 'gpipe' is not one of ('1f1b', 'zero_bubble')"),
    ({"pipeline_schedule": "zero_bubble", "precision": "fp16", "zero_stage": 1},
     "pipeline_schedule=zero_bubble does not support precision=fp16 yet (it runs with precision fp32 or bf16); use "
     "pipeline_schedule=1f1b."),
    ({"pipeline_schedule": "zero_bubble", "zero_bubble_max_waiting": -1},
     "zero_bubble_max_waiting=-1 is not a number of micro-batches: set an integer >= 0, or null for ZB-H1's "
     "(stage s holds s)."),
])
def test_bad_schedule_config_is_refused_before_start(demo_model, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **overrides), 2)
    assert not (tmp_path / "run").exists()
