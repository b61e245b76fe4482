"""The training loss as the global batch's token mean: every labelled token of a step (all micro-batches, all
data- and context-parallel ranks) weighs the same, whatever the micro-batch size, padding and rank count, as in
transformers' Trainer (`num_items_in_batch`, since 4.46), Megatron (`calculate_per_token_loss`) and torchtitan.

DeepSpeed divides each micro-batch's loss by the accumulation steps and averages gradients and the reported loss
over its data axis (data x context ranks); so a micro-batch's summed loss divided by the global batch's labelled
tokens / (accumulation steps x data-axis ranks) makes both exactly the token mean. The count must be known before
the step's first backward: the ranks that read data take the step's micro-batches first, and one all-reduce of an
integer per step tells every rank the total (and so whether the step has anything to learn from). The divisor then
travels with each micro-batch's labels to the loss, which DeepSpeed's pipeline engine calls as loss_fn(outputs,
labels).
Under a preference objective (models/preference.py) the unit is the pair, not the token: the step's loss is the
mean over its pairs, TRL's.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist

import collectives
from models.loss import with_step_divisor


def step_micro_batches(engine, stream, count):
    """The step's micro-batches on the stages that read data, on the device: their loss units are counted there
    (a count over the context group is a collective), and train_batch's own move finds them there; the stream
    itself on the other stages (no reads)."""
    if engine.is_first_stage() or engine.is_last_stage():
        return [on_device(next(stream)) for _ in range(count)]
    return stream


def on_device(batch):
    """A micro-batch (nested tuples of tensors) on the accelerator's current device. non_blocking: a copy from the
    loader's pinned memory does not make the host wait (CUDA counts a blocking one as a sync per micro-batch)."""
    if isinstance(batch, (tuple, list)):
        return tuple(on_device(item) for item in batch)
    return batch.to(collectives.device(), non_blocking=True)


class StepTotals(NamedTuple):
    units: int  # labelled tokens (preference objectives: scored pairs) of the whole global batch
    width: int  # positions of the step's rows as the stages hold them (data.length_buckets: its bucket's length)


def step_totals(engine, micro_batches):
    """The step's StepTotals, on every rank: its loss units, the last stage's, once per tensor-parallel group,
    counted on the device; and the width of its rows, which global rank 0 adds (it reads data under every schedule:
    it holds the model's first chunk) and which the stages that read nothing learn here. One all-reduce of two
    integers, read once per step: no host sync per micro-batch. Every rank that reads data checks its own
    micro-batches' width against it (host shapes), so a replica of another width stops here rather than hang."""
    totals = torch.zeros(2, dtype=torch.int64, device=collectives.device())
    if engine.is_last_stage() and engine.grid.get_slice_parallel_rank() == 0:
        for _, labels in micro_batches:
            totals[0] += engine.module.loss_fn.units(labels)
    if dist.get_rank() == 0:
        totals[1] = row_width(micro_batches[0])
    collectives.all_reduce(totals)
    totals = StepTotals(*totals.tolist())
    widths = {row_width(batch) for batch in micro_batches} if isinstance(micro_batches, list) else set()
    if widths - {totals.width}:
        raise RuntimeError(f"this rank's micro-batches of the step are {sorted(widths)} positions wide, rank 0's "
                           f"{totals.width}: every micro-batch of a step must have one width (data/length_buckets.py)")
    return totals


def global_loss_units(engine, micro_batches):
    """The global batch's loss units, on every rank (step_totals)."""
    return step_totals(engine, micro_batches).units


def row_width(micro_batch):
    """Positions of a collated micro-batch's rows (its input ids' last dimension)."""
    inputs, _ = micro_batch
    return inputs[0].shape[-1]


def token_mean_micro_batches(engine, micro_batches, global_units):
    """The step's micro-batches, each one's labels carrying the divisor that makes the step's loss the global
    batch's mean over its loss units (with_step_divisor): one device tensor for the whole step, made
    from the count step_totals read once. The stages that read nothing get their stream as it is."""
    if not isinstance(micro_batches, list):
        return micro_batches
    divisor = torch.tensor(global_units / (engine.gradient_accumulation_steps()
                                           * engine.grid.get_data_parallel_world_size()),
                           dtype=torch.float32, device=collectives.device())
    return [(inputs, with_step_divisor(labels, divisor)) for inputs, labels in micro_batches]
