"""One rank of the length-bucket parity launch: each case trains the same model twice from the same weights on the
same rows in the same steps (data/length_buckets.py's order for the case's global batch), once with every step's
rows padded to their bucket's length (the length changes between steps) and once padded to seq_length, each step as
the trainer runs it (training/token_mean.py step_totals, engines/sequence_length.py, token_mean_micro_batches), with an
evaluation of rows of seq_length (evaluation/eval_set.py) after the first step. Writes both runs' losses, loss
units, widths, eval losses and the weights they leave, as JSON for tests/test_length_buckets.py to compare."""
import json
import os
import sys
from functools import partial
from itertools import islice, repeat
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from checkpoints.layer_files import load_layer_slice  # noqa: E402
from cluster.distributed import init_distributed, parallel_topology  # noqa: E402
from data.collator import collate  # noqa: E402
from data.length_buckets import BucketedSampler, LengthBuckets, bucket_bounds  # noqa: E402
from engines.chunked_engine import rank_chunk_ids, stage_reads_data, use_chunked_pipeline  # noqa: E402
from engines.pipeline_engine import use_zero_bubble  # noqa: E402
from engines.sequence_length import use_sequence_length  # noqa: E402
from evaluation.eval_set import evaluate  # noqa: E402
from evaluation.reference import WithReference, compute_reference  # noqa: E402
from models.loss import split_micro_batch  # noqa: E402
from models.pipeline import build_pipeline_module, partition_stages  # noqa: E402
from models.preference import PreferenceSettings  # noqa: E402
from tests.distributed import ProcessGroupPool  # noqa: E402
from tests.schedule_worker import (all_ranks_gradients, count_calls, record_optimizer_gradients,  # noqa: E402
                                   worst_error)
from training.token_mean import step_micro_batches, step_totals, token_mean_micro_batches  # noqa: E402

PROMPT = 3  # a pair's shared prompt (unlabelled), and an SFT row's unlabelled head


def ragged_rows(count, seq_len, vocab_size, objective, seed):
    """Rows as the trainer's datasets hold them, of lengths 4 ... seq_len: SFT rows with their first PROMPT tokens
    unlabelled, or preference pairs (chosen and rejected of their own lengths) sharing a prompt."""
    rng = np.random.default_rng(seed)
    tokens = lambda n: rng.integers(0, vocab_size, n).tolist()  # noqa: E731
    rows = []
    for _ in range(count):
        ids = tokens(int(rng.integers(4, seq_len + 1)))
        labels = [-100] * PROMPT + ids[PROMPT:]
        if objective == "sft":
            rows.append({"input_ids": ids, "labels": labels})
            continue
        rejected = ids[:PROMPT] + tokens(int(rng.integers(PROMPT + 1, seq_len + 1)) - PROMPT)
        rows.append({"chosen_input_ids": ids, "chosen_labels": labels, "rejected_input_ids": rejected,
                     "rejected_labels": [-100] * PROMPT + rejected[PROMPT:]})
    return rows


def row_length(row):
    return max(len(row[name]) for name in row if name.endswith("input_ids"))


def build_engine(case, schedule, config, micro_batch_size, gas):
    num_stages, tensor_parallel = case["stages"], case.get("tensor_parallel", 1)
    virtual_stages = case.get("virtual_stages")
    chunks, bounds = rank_chunk_ids(schedule, num_stages, virtual_stages), None
    if chunks is not None:
        num_chunks = sum(map(len, chunks))
        bounds = partition_stages(config, num_chunks, [config.num_hidden_layers // num_chunks] * num_chunks)
    module = build_pipeline_module(config, parallel_topology(num_stages, tensor_parallel),
                                   layer_loader=load_layer_slice, stage_bounds=bounds, chunk_ids=chunks,
                                   loss_chunk_tokens=7, context_parallel_size=case.get("context_parallel", 1),
                                   objective=PreferenceSettings(case.get("objective", "sft")))
    # SGD: a weight moves by its gradient (Adam's normalised step would blow fp32 noise on a near-zero gradient up to
    # a whole step, which the later steps' comparison would then measure); a case may take a smaller rate
    # (tests/test_length_buckets.py CASES says why Gemma 4's does)
    optimizer = torch.optim.SGD(module.parameters(), lr=case.get("learning_rate", 0.1))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           config={"train_micro_batch_size_per_gpu": micro_batch_size,
                                                   "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
                                                   "gradient_clipping": 0.0,
                                                   "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
    engine.load_checkpoint(case["ds_dir"], load_module_only=True)
    if schedule == "zero_bubble":
        use_zero_bubble(engine)
    elif chunks is not None:
        use_chunked_pipeline(engine, schedule, virtual_stages)
    return engine


def train(case, bounds, steps, micro_batch_size, gas, seq_len):
    """One run: (per step [loss, units, width], eval loss, each step's gradients (all ranks'), the weights the steps
    leave, DPO's reference values, the engine's shape resets)."""
    config = AutoConfig.from_pretrained(case["hf_dir"])
    schedule = case["schedule"]
    engine = build_engine(case, schedule, config, micro_batch_size, gas)
    recorded, resets = record_optimizer_gradients(engine), count_calls(engine, "reset_activation_shape")
    context = engine.module.context
    replica, replicas = context.replica(engine.grid.data_parallel_id, engine.grid.get_data_parallel_world_size())
    objective = case.get("objective", "sft")
    rows = ragged_rows(case["rows"], seq_len, config.vocab_size, objective, seed=5)
    eval_rows = ragged_rows(5, seq_len, config.vocab_size, objective, seed=6)
    reads = stage_reads_data(schedule, case["stages"], engine.stage_id, case.get("virtual_stages"))
    cfg = SimpleNamespace(micro_batch_size=micro_batch_size, seq_length=seq_len, gradient_accumulation_steps=gas,
                          tensor_parallel_size=case.get("tensor_parallel", 1))
    reference = None
    if objective == "dpo":  # each run's own reference pass, at seq_length (the starting weights: the same values)
        reference = compute_reference(engine, rows if reads else None, len(rows), cfg, pad_id=0)
        rows = WithReference(rows, reference["chosen"], reference["rejected"])
    buckets = LengthBuckets(bucket_bounds(case["length_buckets"], seq_len), [row_length(r) for r in rows],
                            replicas * micro_batch_size * gas, seed=case["order_seed"])
    order = iter(BucketedSampler(buckets, replica, replicas, micro_batch_size))
    records, eval_loss = [], None
    for step in range(steps):
        indices = list(islice(order, micro_batch_size * gas))
        batches = (collate([rows[i] for i in indices[k:k + micro_batch_size]], seq_len, 0, bounds)
                   for k in range(0, len(indices), micro_batch_size))
        stream = map(partial(split_micro_batch, context), batches) if reads else repeat(None)
        micro_batches = step_micro_batches(engine, stream, gas)
        totals = step_totals(engine, micro_batches)
        use_sequence_length(engine, totals.width)
        micro_batches = token_mean_micro_batches(engine, micro_batches, totals.units)
        records.append([float(engine.train_batch(iter(micro_batches))), totals.units, totals.width])
        if step == 0:  # rows of seq_length between two steps of their own lengths
            eval_loss = evaluate(engine, eval_rows if reads else None, len(eval_rows), cfg, pad_id=0)[0]
    where = f"dp{engine.grid.data_parallel_id}.tp{engine.grid.get_slice_parallel_rank()}"
    weights = all_ranks_gradients([{name: p.detach().clone() for name, p in engine.module.named_parameters()}], where)
    return (records, eval_loss, all_ranks_gradients(recorded, where), weights,
            reference and [reference[side].tolist() for side in ("chosen", "rejected")], len(resets))


def run(rank, cases, steps, micro_batch_size, gas, seq_len, out_dir):
    init_distributed(timeout_minutes=2)
    results = {}
    for case in ProcessGroupPool().runs(cases):  # the cases' engines share their process groups
        padded = train(case, None, steps, micro_batch_size, gas, seq_len)
        bucketed = train(case, bucket_bounds(case["length_buckets"], seq_len), steps, micro_batch_size, gas, seq_len)
        results[case["name"]] = {
            "steps": bucketed[0], "padded_steps": padded[0], "eval_loss": bucketed[1], "padded_eval_loss": padded[1],
            **worst_error(padded[2], bucketed[2], "grad"), **worst_error(padded[3], bucketed[3], "weight"),
            "grad_steps": [len(padded[2]), len(bucketed[2])], "resets": bucketed[5], "padded_resets": padded[5],
            "reference": bucketed[4], "padded_reference": padded[4]}
        torch.distributed.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
