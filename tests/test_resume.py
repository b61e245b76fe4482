"""Resume on any layout: the reference run's step-4 checkpoint (2 stages x 2 data-parallel, ZeRO-1, fp32) goes on
under other stage counts, tensor- and data-parallel sizes, ZeRO stages and offload with its whole training state,
and its losses equal the run that never stopped; what cannot resume is refused before anything is built."""
import os
import re
import shutil

import pytest

from tests.launch import REFERENCE, check_ok, demo_overrides, launch_trainer, lm_eval_overrides, per_step_losses, \
    read_metrics, run_in_process
from tests.helpers import edit_json
from tests.test_lm_eval import assert_loop_equals_lm_eval, log_likelihoods, read_samples

# fp32 reduction-order noise: the same sums over other ranks and stage boundaries.
EXACT = dict(abs=1e-5, rel=0)
# What the resumed runs skip, these tests asserting neither: their end-of-run evaluation (its loss after a resume on
# another layout: tests/test_reliability.py; under the schedules: tests/test_schedule.py) and their export
# (tests/test_conversion.py, tests/test_trainer.py).
NO_EVAL_OR_EXPORT = dict(eval_file="null", export_hf="false")


def resumed_losses(demo_model, reference_run, out, procs, layout, start, **extra):
    result = check_ok(launch_trainer(procs, demo_overrides(demo_model, out, **{**REFERENCE, **NO_EVAL_OR_EXPORT,
                                                                               **layout, "resume": str(start),
                                                                               **extra})))
    assert [r["step"] for r in read_metrics(out) if "loss" in r][0] == int(start.name.removeprefix("global_step")) + 1
    return result, per_step_losses(out)


@pytest.mark.parametrize("procs,layout,changes", [
    (1, dict(num_stages=1, gradient_accumulation_steps=4, zero_stage=0),
     "num_stages 2 -> 1; data_parallel 2 -> 1; stage_bounds [0, 3, 7] -> [0, 7]; zero_stage 1 -> 0"),
    (4, dict(num_stages=4, gradient_accumulation_steps=4, save_steps=0),
     "num_stages 2 -> 4; data_parallel 2 -> 1; stage_bounds [0, 3, 7] -> [0, 2, 3, 4, 7]"),
], ids=["1_process_zero0", "4_stages"])
@pytest.mark.slow
def test_resume_on_another_layout_equals_the_run_that_never_stopped(demo_model, demo_tasks, reference_run, tmp_path,
                                                                   procs, layout, changes):
    """On 1 process the resumed run also scores the lm-eval tasks at step 8: the reference run's accuracies, each
    log-likelihood within fp32 noise of its, and lm-eval's on its own export."""
    scored = lm_eval_overrides(demo_tasks) if procs == 1 else {}
    result, losses = resumed_losses(demo_model, reference_run, tmp_path / "run", procs, layout,
                                    reference_run / "global_step4", **scored)
    assert (f"resuming {reference_run}/global_step4 with another layout ({changes}): the optimizer state is "
            f"resharded from its per-layer files; the data position is kept in samples (32 consumed)") in result.stdout
    assert losses == pytest.approx(per_step_losses(reference_run)[4:], **EXACT)
    if scored:
        resumed, reference = (read_samples(run, 8, "pipeline") for run in (tmp_path / "run", reference_run))
        for task, samples in reference.items():
            for ours, theirs in zip(resumed[task], samples, strict=True):
                assert all(ours[m] == theirs[m] for m in ours if m.startswith("acc")), task
                assert log_likelihoods(ours) == pytest.approx(log_likelihoods(theirs), abs=1e-4), task
        assert_loop_equals_lm_eval(tmp_path / "run", demo_tasks, tmp_path / "lm_eval")


def test_a_changed_global_batch_is_said_at_start_up(demo_model, reference_run):
    """2 data-parallel ranks of 3 sequences per micro-batch (the global batch 8 -> 6): 32 consumed samples are 5
    micro-batches and 2 samples; the 2 are read again, and the line says so."""
    from tests.helpers import compose_config
    from training.resume import describe_resume
    from training.run_spec import run_spec
    overrides = demo_overrides(demo_model, "unused", **{**REFERENCE, "num_stages": 1, "micro_batch_size": 3,
                                                         "gradient_accumulation_steps": 1,
                                                         "resume": str(reference_run / "global_step4")})
    spec = run_spec(compose_config(overrides), 2)
    assert describe_resume(spec) == (
        f"resuming {reference_run}/global_step4 with another layout (num_stages 2 -> 1; stage_bounds [0, 3, 7] -> "
        f"[0, 7]; global_batch_size 8 -> 6): the optimizer state is resharded from its per-layer files; the data "
        f"position is kept in samples (32 consumed, of which the last 2 are read again: the position rounds down to "
        f"a whole micro-batch of each of the 2 data-parallel ranks)")


@pytest.mark.slow
def test_resume_into_tensor_parallel_and_back_out_with_offload(demo_model, reference_run, tmp_path):
    """2 stages x 2 data-parallel -> 1 stage x tensor parallel 2 (steps 5-8, saved at 6) -> 2 stages x 1
    data-parallel with offload_optimizer=cpu (steps 7-8): each leg's losses equal the uninterrupted run's. (max_steps
    stays 8: it sets the LR schedule's length.)"""
    reference = per_step_losses(reference_run)
    tp_run = tmp_path / "tp2"
    _, losses = resumed_losses(demo_model, reference_run, tp_run, 2, dict(
        num_stages=1, tensor_parallel_size=2, gradient_accumulation_steps=4),
        reference_run / "global_step4")
    assert losses == pytest.approx(reference[4:], **EXACT)
    assert sorted(name for name in os.listdir(tp_run / "global_step6") if name.startswith("layer_01")) == [
        "layer_01-model_00-model_states.pt", "layer_01-model_00-optim_states.pt",
        "layer_01-model_01-model_states.pt", "layer_01-model_01-optim_states.pt"]
    result, losses = resumed_losses(demo_model, reference_run, tmp_path / "offload", 2, dict(
        gradient_accumulation_steps=4, offload_optimizer="cpu"),
        tp_run / "global_step6")
    assert "tensor_parallel 2 -> 1" in result.stdout and "offload_optimizer none -> cpu" in result.stdout
    assert losses == pytest.approx(reference[6:8], **EXACT)


@pytest.mark.slow
def test_resume_across_schedules_equals_the_run_that_never_stopped(demo_model, reference_run, tmp_path):
    """1F1B's checkpoint (2 stages x 2 data-parallel, ZeRO-1) goes on under ZB-V's 4 chunks (steps 5-8, saved at 6),
    and ZB-V's under interleaving's (v = 2, steps 7-8) with its optimizer state moved to the host by
    offload_optimizer=cpu, and under 1F1B on 4 stages (steps 7-8): each with the whole optimizer state, its losses
    the uninterrupted run's."""
    reference = per_step_losses(reference_run)
    zbv_run = tmp_path / "zbv"
    result, losses = resumed_losses(demo_model, reference_run, zbv_run, 4, dict(pipeline_schedule="zbv"),
                                    reference_run / "global_step4")
    assert "with another layout (stage_bounds [0, 3, 7] -> [0, 2, 3, 4, 7]; pipeline_schedule 1f1b -> zbv)" in (
        result.stdout)
    assert losses == pytest.approx(reference[4:], **EXACT)
    assert "zbv_times=auto: each stage's F/B/W ms in the measured step" in result.stdout
    # partition_costs=auto: balanced on the units timed before the pipeline was built (one decoder a chunk here)
    assert "pipeline partition 'balanced' on costs measured on cpu, mean of 4 ranks, ms per micro-batch" in (
        result.stdout)
    result, losses = resumed_losses(demo_model, reference_run, tmp_path / "interleaved", 4, dict(
        pipeline_schedule="interleaved_1f1b", virtual_stages=2, offload_optimizer="cpu"), zbv_run / "global_step6")
    assert (f"resuming {zbv_run}/global_step6 with another layout (offload_optimizer none -> cpu; pipeline_schedule "
            f"zbv -> interleaved_1f1b): the optimizer state is resharded from its per-layer files; the data position "
            f"is kept in samples (48 consumed)") in result.stdout
    assert "zbv_times" not in result.stdout  # zbv's default: interleaving measures nothing, rebuilds nothing
    assert losses == pytest.approx(reference[6:8], **EXACT)
    # ZB-V's rank 0 held chunks 0 and 3 (the embedding and the head), rank 1 chunks 1 and 2: 1F1B's 4 stages take them
    # in order, each from the rank that saved it
    result, losses = resumed_losses(demo_model, reference_run, tmp_path / "four_stages", 4, dict(
        num_stages=4, gradient_accumulation_steps=4, save_steps=0), zbv_run / "global_step6")
    assert (f"resuming {zbv_run}/global_step6 with another layout (num_stages 2 -> 4; data_parallel 2 -> 1; "
            f"pipeline_schedule zbv -> 1f1b)") in result.stdout
    assert losses == pytest.approx(reference[6:8], **EXACT)


def copy_of_checkpoint(reference_run, tmp_path):
    tag = tmp_path / "ckpt" / "global_step4"
    shutil.copytree(reference_run / "global_step4", tag)
    (tmp_path / "ckpt" / "latest").write_text("global_step4")
    return tag


@pytest.mark.parametrize("fault,overrides,message", [
    ("other_model", {}, "is of another model than model_name_or_path (num_hidden_layers 6 there, 4 here): resume a "
                        "checkpoint of this model, or set model_name_or_path to the converted model the checkpoint "
                        "was trained from."),
    ("missing_state", {}, "has no optimizer state for layer 3 (layer_03-optim_states.pt); set "
                          "resume_weights_only=true to continue from its weights with a fresh optimizer."),
    ("from_fp16", {"precision": "bf16"}, "cannot carry over fp16's loss scale (the run goes from fp16 to bf16); set "
                                         "resume_drop_state=true to start it fresh, or resume with the checkpoint's "
                                         "settings."),
])
def test_a_checkpoint_that_cannot_resume_is_refused_before_anything_is_built(demo_model, reference_run, tmp_path,
                                                                             fault, overrides, message):
    tag = copy_of_checkpoint(reference_run, tmp_path)
    if fault == "other_model":
        edit_json(tag / "config.json", lambda config: config.update(num_hidden_layers=6))
    elif fault == "missing_state":
        os.remove(tag / "layer_03-optim_states.pt")
    else:
        edit_json(tag / "trainer_state.json", lambda state: state["settings"].update(precision="fp16"))
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", **{**REFERENCE, **overrides},
                                      resume=str(tag)), 4)
    assert not (tmp_path / "run").exists()


def test_a_change_of_split_that_is_recorded_only_above_1_is_named():
    """Tensor- and context-parallel sizes are recorded only when above 1: leaving either is still a change."""
    from training.resume import layout_change
    settings = {"precision": "fp32", "zero_stage": 1}
    saved = {"topology": {"num_stages": 1, "data_parallel": 1, "context_parallel": 2, "tensor_parallel": 2,
                          "stage_bounds": [0, 7]}, "settings": settings}
    assert layout_change(saved, {"num_stages": 1, "data_parallel": 1, "stage_bounds": [0, 7]}, settings) == [
        "tensor_parallel 2 -> 1", "context_parallel 2 -> 1"]
    assert layout_change(saved, saved["topology"], settings) == []
