"""data.length_buckets: each step's rows are of one length bucket and padded to it, the next step's may be of another
(data/length_buckets.py); the engines re-size what they take from the first micro-batch when the length changes
(engines/sequence_length.py). The loss of a bucketed run equals the run padding the same rows to seq_length under
every schedule, DPO included, an evaluation at seq_length between its steps too; the order is the seed's, so a resume
on another layout goes on exactly; what cannot be bucketed is refused at start-up."""
import glob
import itertools
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from data.collator import collate
from data.length_buckets import LengthBuckets, bucket_bounds, padded_length, row_lengths
from data.loader import build_stage_loader, infinite_micro_batches
from errors import ConfigError
from planner.workload import Workload
from tests import length_bucket_worker
from tests.distributed import spawn
from tests.launch import check_ok, demo_overrides, launch_trainer, per_step_losses, read_metrics, run_in_process
from training.config_checks import checked_config
from training.run_data import RunData
from training.run_spec import check_length_buckets_split

STEPS, MICRO_BATCH, GAS, SEQ = 3, 2, 4, 16


def rows_of_lengths(lengths):
    return [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]


def random_lengths(count, longest, seed=0):
    return np.random.default_rng(seed).integers(2, longest + 1, count)


def test_each_step_takes_one_bucket_in_an_order_of_the_seed():
    lengths = random_lengths(300, 64)
    buckets = LengthBuckets(bucket_bounds([16, 32], 64), lengths, global_batch=8, seed=3)
    batches = buckets.epoch_batches(0)
    assert len(batches) == buckets.steps_per_epoch == sum(n // 8 for n in buckets.counts) > 0
    for batch in batches:  # a global batch of rows of one bucket
        assert len(batch) == 8 and len({padded_length(rows_of_lengths(lengths[batch]), buckets.bounds)}) == 1
        assert len({int(np.searchsorted(buckets.bounds, n)) for n in lengths[batch]}) == 1
    used = np.concatenate(batches)
    assert len(set(used.tolist())) == len(used)  # no row twice; each bucket's unused rows: its last partial batch
    assert [int(n) for n in np.bincount(buckets.row_buckets[np.setdiff1d(np.arange(300), used)], minlength=3)] == [
        int(n) % 8 for n in buckets.counts]
    same = LengthBuckets(buckets.bounds, lengths, 8, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(same.epoch_batches(0), batches, strict=True))
    for other in (LengthBuckets(buckets.bounds, lengths, 8, seed=4).epoch_batches(0), buckets.epoch_batches(1)):
        assert not all(np.array_equal(a, b) for a, b in zip(other, batches))
    assert buckets.describe() == ", ".join(f"{n} of at most {bound} tokens"
                                           for n, bound in zip(buckets.counts, (16, 32, 64)))


def loader_steps(rows, buckets, dp_size, gas, start=(0, 0), steps=None):
    """[(set of row ids, {widths}) per step] over all data-parallel ranks of a layout, from position start."""
    streams = [infinite_micro_batches(build_stage_loader(
        rows, reads_data=True, dp_rank=rank, dp_size=dp_size, micro_batch_size=8 // dp_size // gas, seq_length=64,
        pad_id=0, seed=3, buckets=buckets), *start) for rank in range(dp_size)]
    out = []
    for _ in range(steps):
        batches = [next(stream) for stream in streams for _ in range(gas)]
        ids = {int(row[0]) for (inputs, _, _), _ in batches for row in inputs}  # each row's first id: its index
        out.append((ids, {inputs.shape[1] for (inputs, _, _), _ in batches}))
    return out


def test_the_loader_pads_each_step_to_its_bucket_and_every_layout_reads_the_same_steps():
    """2 data-parallel ranks x 2 micro-batches of 2 and 1 rank x 1 micro-batch of 8: the same rows in each step,
    padded to the step's bucket; a stream started at epoch 1's third step (a resume) goes on as the one that never
    stopped, into epoch 2."""
    lengths = random_lengths(120, 64, seed=1)
    rows = [{"input_ids": [index + 1] * int(n), "labels": [index + 1] * int(n)} for index, n in enumerate(lengths)]
    buckets = LengthBuckets(bucket_bounds([16, 32], 64), lengths, global_batch=8, seed=3)
    per_epoch = buckets.steps_per_epoch
    whole = loader_steps(rows, buckets, dp_size=2, gas=2, steps=2 * per_epoch + 2)
    assert whole == loader_steps(rows, buckets, dp_size=1, gas=1, steps=2 * per_epoch + 2)
    for ids, widths in whole:
        assert len(ids) == 8 and len(widths) == 1
        assert widths == {padded_length(rows_of_lengths(lengths[sorted(i - 1 for i in ids)]), buckets.bounds)}
    assert {width for _, (width,) in whole} == {16, 32, 64}
    assert whole[per_epoch + 2:] == loader_steps(rows, buckets, dp_size=2, gas=2, start=(1, 2 * 2),
                                                 steps=per_epoch)


def test_row_lengths_read_the_arrow_columns_a_pair_its_longer_sequence():
    import datasets
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * 3, [2] * 7], "labels": [[1] * 3, [2] * 7]})
    chosen, rejected = [[1] * 5, [1] * 9], [[2] * 8, [2] * 4]
    pairs = datasets.Dataset.from_dict({"chosen_input_ids": chosen, "chosen_labels": chosen,
                                        "rejected_input_ids": rejected, "rejected_labels": rejected})
    assert row_lengths(rows).tolist() == [3, 7] and row_lengths(pairs).tolist() == [8, 9]


def test_a_micro_batch_pads_to_the_smallest_bucket_holding_its_longest_row():
    bounds = bucket_bounds([8, 12], 16)
    (inputs, documents, _), labels = collate(rows_of_lengths([3, 9]), 16, pad_id=0, bounds=bounds)
    assert inputs.shape == documents.shape == labels.shape == (2, 12)
    assert collate(rows_of_lengths([3, 8]), 16, pad_id=0, bounds=bounds)[0][0].shape == (2, 8)
    assert collate(rows_of_lengths([3, 8]), 16, pad_id=0)[0][0].shape == (2, 16)  # no buckets: seq_length
    pairs = [{"chosen_input_ids": [1] * 5, "chosen_labels": [1] * 5, "rejected_input_ids": [2] * 13,
              "rejected_labels": [2] * 13}]
    (inputs, _, _), (labels, _) = collate(pairs, 16, pad_id=0, bounds=bounds)  # a pair: its longer sequence
    assert inputs.shape == labels.shape == (2, 16)


REFUSED_LIST = ("is not a list of row lengths: set ascending positive token counts up to seq_length=64, e.g. [256, "
                "512, 1024] (rows longer than the last pad to seq_length), or [] to pad every row to seq_length.")


@pytest.mark.parametrize("data,message", [
    ({"length_buckets": [32, 16]}, f"data.length_buckets=[32, 16] {REFUSED_LIST}"),
    ({"length_buckets": [16, 128]}, f"data.length_buckets=[16, 128] {REFUSED_LIST}"),
    ({"length_buckets": [0, 16]}, f"data.length_buckets=[0, 16] {REFUSED_LIST}"),
    ({"length_buckets": 16}, f"data.length_buckets=16 {REFUSED_LIST}"),
    ({"length_buckets": [16], "format": "text"}, "data.length_buckets=[16] with data.format=text: its rows fill "
     "seq_length (documents are cut into blocks of it), so there is nothing to bucket; remove data.length_buckets."),
])
def test_bad_length_buckets_are_refused(data, message):
    with pytest.raises(ConfigError) as error:
        checked_config(OmegaConf.create({"seq_length": 64, "data": {"format": "chat", **data}}))
    assert str(error.value) == message


@pytest.mark.parametrize("workload,message", [
    (Workload(context_parallel=2, micro_batch_size=2), "data.length_buckets=[16, 30, 42]: 30, 42 do not split over "
     "context_parallel_size=2 (2 x 2 equal chunks of each sequence); use lengths that are multiples of 4."),
    (Workload(tensor_parallel=4, micro_batch_size=1), "data.length_buckets=[16, 30, 42]: 30, 42 do not split over "
     "tensor_parallel_size=4 with sequence_parallel (a micro-batch's tokens, 1 x the length); use lengths that are "
     "multiples of 4."),
    (Workload(tensor_parallel=4, context_parallel=2, micro_batch_size=1), "data.length_buckets=[16, 30, 42]: 30, 42 "
     "do not split over context_parallel_size=2 (2 x 2 equal chunks of each sequence) and tensor_parallel_size=4 with "
     "sequence_parallel (a micro-batch's tokens, 1 x the length); use lengths that are multiples of 8."),
])
def test_buckets_that_do_not_split_over_the_layout_are_refused(workload, message):
    cfg = OmegaConf.create({"data": {"length_buckets": [16, 30, 42]}})
    with pytest.raises(ConfigError) as error:
        check_length_buckets_split(cfg, workload)
    assert str(error.value) == message
    check_length_buckets_split(OmegaConf.create({"data": {"length_buckets": [16, 32, 48]}}), workload)
    check_length_buckets_split(cfg, Workload(tensor_parallel=4, sequence_parallel=False))
    check_length_buckets_split(cfg, Workload(tensor_parallel=4, micro_batch_size=2))  # 2 rows x 30 tokens split


def test_buckets_none_of_which_holds_a_step_are_refused():
    data = object.__new__(RunData)
    data.train_buckets = LengthBuckets(bucket_bounds([16], 64), [5, 6, 7, 40, 50], global_batch=4, seed=0)
    spec = SimpleNamespace(cfg=OmegaConf.create({"data": {"length_buckets": [16]}}), samples_per_step=4)
    with pytest.raises(ConfigError) as error:
        data.steps_per_epoch(spec)
    assert str(error.value) == (
        "data.length_buckets=[16] group train_file's rows as 3 of at most 16 tokens, 2 of at most 64 tokens: no bucket "
        "holds one step's 4 rows (a step's rows share a bucket); use fewer buckets, add data or lower the batch size.")


# name: (tiny config, case settings), all on 4 processes; buckets of SEQ = 16, rows of 4 ... 16 tokens.
# order_seed: the bucket order's, which gives each case's steps widths 8, 8, 16 (128 rows; DPO's 12, 12, 16) or
# 12, 8, 16 (64 rows): the evaluation at 16 after step 1, and step 2, change the length.
CASES = {
    # ZB-V's rank 1 holds neither the first nor the last chunk: it reads no data and learns each step's width
    "2stages_x_2dp_zbv": ("llama3", dict(stages=2, schedule="zbv", length_buckets=[8, 12], rows=128, order_seed=10)),
    "2stages_x_2dp_dpo_zero_bubble": ("llama3", dict(stages=2, schedule="zero_bubble", objective="dpo",
                                                     length_buckets=[8, 12], rows=128, order_seed=10)),
    "2stages_x_tp2_interleaved": ("llama3", dict(stages=2, schedule="interleaved_1f1b", virtual_stages=2,
                                                 tensor_parallel=2, length_buckets=[8, 12], rows=64, order_seed=14)),
    "2stages_x_cp2_1f1b": ("llama3", dict(stages=2, schedule="1f1b", context_parallel=2, length_buckets=[8, 12],
                                          rows=64, order_seed=14)),
    # 1F1B on 2 x 2 with the Gated DeltaNet hybrid with experts (LLaMA under the other schedules): its recurrent
    # state, convolution window and load-balancing loss see the real tokens only, however many padded positions
    # follow them. Its decay's gradients (A_log, dt_bias) sum over the chunk's cumulative decays in fp32:
    # transformers' own move by 1.6e-6 of the largest between rows padded to 8 and to 16, one step; three steps
    # here reach 2.3e-6.
    "2stages_x_2dp_qwen3_5_moe": ("qwen3_5_moe", dict(stages=2, schedule="1f1b", length_buckets=[8, 12], rows=128,
                                                      order_seed=10, grad_tolerance=5e-6)),
    # Gemma 3 (sliding windows of 4 shorter than the rows, (1 + w) q/k norms, the scaled tied embedding across the
    # stages, the final soft cap in the chunked loss) on 1F1B: its q/k norms' gradients sum each head's normalised
    # queries and keys over the tokens, with much cancellation, so fp32's other summation order shows more of the
    # largest element: transformers' own (SDPA; eager 8.2e-6) move by 1.1e-5 between rows padded to 8 and to 16
    # over three such steps, ours 1.3e-5 here, and the weights they leave 2.1e-6.
    "2stages_x_2dp_gemma3": ("gemma3_text", dict(stages=2, schedule="1f1b", length_buckets=[8, 12], rows=128,
                                                 order_seed=10, grad_tolerance=2e-5, weight_tolerance=3e-6)),
    # Gemma 4 E2B-like under ZB-H1: per-layer embeddings, layer 4 reusing layer 2's keys and values from the other
    # stage, both carried in the stage tuple at the step's width, the soft cap. SGD at 1e-3: at 0.1 its tiny model
    # amplifies fp32's rounding step after step, transformers' own three steps on random rows padded to 8 and to 16
    # parting from 1e-5 of the largest gradient to 1.1e-3 (SDPA; eager 2.6e-4), a gap ours showed too (3.9e-3 on
    # these rows); at 1e-3 transformers' stay within the first step's 1e-5, ours within 1.6e-5.
    "2stages_x_2dp_gemma4_zero_bubble": ("gemma4_e2b", dict(stages=2, schedule="zero_bubble", length_buckets=[8, 12],
                                                            rows=128, order_seed=10, learning_rate=1e-3,
                                                            grad_tolerance=3e-5)),
}


@pytest.mark.slow
def test_bucketed_losses_equal_padded_ones_under_every_schedule(tiny_checkpoints, tiny_hybrid_checkpoints,
                                                                tiny_layer_type_checkpoints, tmp_path):
    """Each case trains on the same rows in the same steps with each step padded to its bucket and to seq_length:
    the same loss units (the token mean's denominators), losses within 1e-6, an evaluation at seq_length after step
    1 alike, every step's gradients within 2e-6 of the largest (the hybrid's within 5e-6, Gemma's within 2e-5 and
    3e-5: CASES) and the weights the steps leave within 1e-6 (Gemma 3's 3e-6) (fp32 sums over other shapes; under
    tensor and context parallelism the real tokens sit on other ranks when the rows are shorter, and are summed in
    another order); DPO's reference pass the same."""
    checkpoints = {**tiny_checkpoints, **tiny_hybrid_checkpoints, **tiny_layer_type_checkpoints}
    cases = [dict(name=name, hf_dir=checkpoints[model][0], ds_dir=checkpoints[model][1], **settings)
             for name, (model, settings) in CASES.items()]
    spawn(length_bucket_worker.run, 4, cases, STEPS, MICRO_BATCH, GAS, SEQ, str(tmp_path))
    ranks = [json.load(open(path)) for path in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(ranks) == 4
    for (name, (_, settings)), rank in itertools.product(CASES.items(), ranks):
        result, context = rank[name], settings.get("context_parallel", 1)
        local = SEQ // context  # the positions each rank holds
        losses, units, widths = zip(*result["steps"])
        padded_losses, padded_units, padded_widths = zip(*result["padded_steps"])
        assert padded_widths == (local,) * STEPS and units == padded_units and min(units) > 0, name
        # the length changes at the evaluation at seq_length after step 1, after it, and between steps
        assert widths[0] != local and widths[1] != local and len(set(widths)) > 1, name
        assert set(widths) <= {length // context for length in (8, 12, 16)}, name
        # the engine's shapes made again at each change of length (DPO's reference pass at seq_length comes first),
        # never while it stays
        lengths = [local] * (settings.get("objective") == "dpo") + [widths[0], local, *widths[1:]]
        assert result["resets"] == sum(a != b for a, b in zip(lengths, lengths[1:])) and not result["padded_resets"]
        assert losses == pytest.approx(padded_losses, abs=1e-6, rel=0), name
        assert result["eval_loss"] == pytest.approx(result["padded_eval_loss"], abs=1e-6, rel=0), name
        assert result["grad_steps"] == [STEPS, STEPS], name
        assert result["max_grad_error"] <= settings.get("grad_tolerance", 2e-6), (name, result["worst_grad"])
        assert result["max_weight_error"] <= settings.get("weight_tolerance", 1e-6), (name, result["worst_weight"])
        if settings.get("objective") == "dpo":
            assert result["reference"] == result["padded_reference"] and result["reference"][0], name


def pretokenized_file(path, count, seed):
    """Rows of 4 ... 64 ids of the demo model's vocabulary (384), as data.format=pretokenized reads them."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"input_ids": rng.integers(0, 384, int(rng.integers(4, 65))).tolist()}) + "\n")
    return str(path)


@pytest.mark.slow
def test_a_bucketed_run_resumed_on_another_layout_equals_the_run_that_never_stopped(demo_model, tmp_path):
    """2 stages (evaluating at seq_length every 2 steps) stopped at step 2, resumed on 1 stage with the same global
    batch: steps 3 and 4 take the same rows, their losses the uninterrupted run's."""
    common = {"train_file": pretokenized_file(tmp_path / "train.jsonl", 120, seed=0), "data.format": "pretokenized",
              "data.length_buckets": "[16,32]", "max_steps": 4, "logging_steps": 1, "export_hf": "false",
              "warmup_steps": 1}
    result = check_ok(launch_trainer(2, demo_overrides(demo_model, tmp_path / "run", **common, save_steps=2,
                                                       eval_steps=2, eval_file=pretokenized_file(
                                                           tmp_path / "eval.jsonl", 6, seed=1))))
    assert "data.length_buckets: train_file's rows, " in result.stdout
    whole = per_step_losses(tmp_path / "run")
    assert len(whole) == 4 and len([r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]) == 2
    check_ok(launch_trainer(1, demo_overrides(demo_model, tmp_path / "resumed", **common, num_stages=1,
                                              resume=str(tmp_path / "run" / "global_step2"), eval_file="null")))
    assert per_step_losses(tmp_path / "resumed") == pytest.approx(whole[2:], abs=1e-5, rel=0)


def test_a_layout_the_buckets_do_not_split_over_is_refused_at_start_up(demo_model, tmp_path):
    """The trainer's own start-up: 2 stages x context parallel 2, before any process group or file exists."""
    overrides = demo_overrides(demo_model, tmp_path / "run", **{
        "train_file": pretokenized_file(tmp_path / "train.jsonl", 8, seed=0), "data.format": "pretokenized",
        "data.length_buckets": "[16,30]", "context_parallel_size": 2})
    with pytest.raises(ConfigError) as error:
        run_in_process(overrides, 4)
    assert str(error.value) == ("data.length_buckets=[16, 30]: 30 does not split over context_parallel_size=2 (2 x 2 "
                                "equal chunks of each sequence); use lengths that are multiples of 4.")
    assert not os.path.exists(tmp_path / "run")
