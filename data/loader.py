"""Stage-aware micro-batch loading for a pipeline × data-parallel topology.

The first pipeline stage needs the inputs and the last the labels, so both read the same micro-batches: same
dataset, seed and data-parallel rank give them the same `DistributedSampler` order. Middle stages read nothing but
still count the same number of micro-batches, so every stage agrees on the epoch length.

Epoch semantics (per epoch, over all data-parallel ranks; N examples, D ranks, B = micro_batch_size):
  drop_last=True: each rank takes floor(N/D) examples and the whole micro-batches of those, floor(floor(N/D)/B);
                  no example repeats, the remaining N - D·B·len examples (a different random set every epoch) wait.
  drop_last=False: each rank takes ceil(ceil(N/D)/B) micro-batches; every example is used at least once and the
                  D·B·len - N (< D·B) extra slots repeat examples: DistributedSampler's padding to a multiple of D,
                  then each rank's wrap-around to a whole last micro-batch.
Micro-batches are always full: the pipeline engine fixes tensor shapes on its first micro-batch. With length
buckets (data/length_buckets.py) a step's global batch is rows of one bucket instead, padded to its length.
"""

import math
from functools import partial
from itertools import count, cycle, islice, repeat
from typing import Sized

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

import collectives
from errors import ConfigError
from .collator import collate, collate_causal_lm
from .length_buckets import BucketedSampler, LengthBuckets


def micro_batches_per_epoch(num_examples: int, dp_size: int, micro_batch_size: int, drop_last: bool = True) -> int:
    """Micro-batches one data-parallel rank gets per epoch; a function of the sizes only, the same on every stage."""
    if drop_last:
        return num_examples // dp_size // micro_batch_size
    return math.ceil(math.ceil(num_examples / dp_size) / micro_batch_size)


class _EpochIndices(Sampler):
    """One rank's example indices for the current epoch: the sampler's order (DistributedSampler's, or the length
    buckets'), wrapped or cut to `count`, minus the first `skip` that a resumed run has already trained on (skipped as
    indices, never read)."""

    def __init__(self, sampler: DistributedSampler | BucketedSampler, count: int):
        self.sampler, self.count, self.skip = sampler, count, 0

    def __len__(self) -> int:
        return self.count - self.skip

    def __iter__(self):
        return islice(cycle(self.sampler), self.skip, self.count)


class StageLoader:
    """Micro-batches of one data-parallel rank for one pipeline stage; see `build_stage_loader`."""

    def __init__(self, dataset: Sized, *, reads_data: bool, dp_rank: int, dp_size: int, micro_batch_size: int,
                 seq_length: int, pad_id: int, seed: int, drop_last: bool = True, num_workers: int = 0,
                 buckets: LengthBuckets | None = None):
        self.micro_batch_size = micro_batch_size
        if buckets is None:
            self.num_micro_batches = micro_batches_per_epoch(len(dataset), dp_size, micro_batch_size, drop_last)
        else:
            self.num_micro_batches = buckets.steps_per_epoch * buckets.global_batch // (dp_size * micro_batch_size)
        if self.num_micro_batches == 0:
            raise ConfigError(f"{len(dataset)} examples give no micro-batch of {micro_batch_size} to each of "
                              f"{dp_size} data-parallel ranks")
        self.epoch, self.start = 0, 0
        self._loader = None
        if reads_data:
            self._sampler = (DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed,
                                                drop_last=drop_last) if buckets is None else
                             BucketedSampler(buckets, dp_rank, dp_size, micro_batch_size))
            self._indices = _EpochIndices(self._sampler, self.num_micro_batches * micro_batch_size)
            bounds = buckets.bounds if buckets else None
            self._loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self._indices,
                                      num_workers=num_workers, pin_memory=collectives.device().type != "cpu",
                                      collate_fn=partial(collate, seq_length=seq_length, pad_id=pad_id, bounds=bounds))

    def __len__(self) -> int:
        """Micro-batches in a whole epoch (an iteration after `set_position(e, k)` yields `len - k` of them)."""
        return self.num_micro_batches

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; its order is a function of (seed, epoch, dp rank)."""
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, consumed_micro_batches: int) -> None:
        """Make the next iteration continue `epoch` after its first `consumed_micro_batches` micro-batches."""
        if not 0 <= consumed_micro_batches <= self.num_micro_batches:
            raise ValueError(f"consumed_micro_batches={consumed_micro_batches} outside [0, {self.num_micro_batches}]")
        self.epoch, self.start = epoch, consumed_micro_batches
        if self._loader is not None:
            self._sampler.set_epoch(epoch)
            self._indices.skip = consumed_micro_batches * self.micro_batch_size

    def __iter__(self):
        """First/last stage: `((input_ids, attention_mask, position_ids), labels)` tuples; middle stage: None."""
        if self._loader is None:
            return repeat(None, self.num_micro_batches - self.start)
        return iter(self._loader)


def build_stage_loader(dataset: Sized, *, reads_data: bool, dp_rank: int, dp_size: int, micro_batch_size: int,
                       seq_length: int, pad_id: int, seed: int, drop_last: bool = True,
                       num_workers: int = 0, buckets: LengthBuckets | None = None) -> StageLoader:
    """Loader for one stage of data-parallel rank `dp_rank`: real micro-batches when `reads_data` (first and last
    pipeline stage), otherwise placeholders (None) of the same count. A middle stage only needs `len(dataset)`, so
    any sized object, e.g. `range(n)`, will do there. buckets: the rows grouped by length, each step's padded to its
    bucket (the epoch's order theirs: data/length_buckets.py); None: DistributedSampler's order, padded to
    seq_length."""
    return StageLoader(dataset, reads_data=reads_data, dp_rank=dp_rank, dp_size=dp_size,
                       micro_batch_size=micro_batch_size, seq_length=seq_length, pad_id=pad_id, seed=seed,
                       drop_last=drop_last, num_workers=num_workers, buckets=buckets)


class MicroBatchStream:
    """Endless micro-batches across epochs, moving the loader to the next epoch at each epoch's end.

    `position` = (epoch, micro-batches handed out in it): save it in a checkpoint and pass it back as
    `infinite_micro_batches(loader, *position)` to continue with exactly the micro-batches not yet seen. It counts
    what was pulled; DeepSpeed's pipeline engine pulls only on the first and last stage, so read it there.
    """

    def __init__(self, loader: StageLoader, start_epoch: int = 0, consumed_micro_batches: int = 0):
        self.loader = loader
        self.epoch, self.consumed = start_epoch, consumed_micro_batches
        self._iterator = None

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.consumed

    def __iter__(self):
        return self

    def __next__(self):
        if self._iterator is None:
            self.loader.set_position(self.epoch, self.consumed)
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.epoch, self.consumed = self.epoch + 1, 0
            self.loader.set_epoch(self.epoch)
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        self.consumed += 1
        return batch


def infinite_micro_batches(loader: StageLoader, start_epoch: int = 0,
                           consumed_micro_batches: int = 0) -> MicroBatchStream:
    """An endless iterator over `loader`'s micro-batches from (start_epoch, consumed_micro_batches); see
    `MicroBatchStream` for its `position`."""
    return MicroBatchStream(loader, start_epoch, consumed_micro_batches)


def blend_micro_batches(samples, *, reads_data: bool, dp_rank: int, dp_size: int, micro_batch_size: int,
                        seq_length: int, pad_id: int, start_sample: int):
    """Endless micro-batches of one data-parallel rank from a sample sequence every layout reads alike
    (data/indexed.py's Blend): the n-th micro-step from `start_sample` takes samples
    [start + n·D·B, start + (n+1)·D·B), rank r the B of them from r·B. Each step thus takes the next global batch
    of samples whatever the layout, and a resume from consumed samples goes on at exactly the next sample. Middle
    stages (reads_data False) get None and read nothing."""
    if not reads_data:
        return repeat(None)
    first = start_sample + dp_rank * micro_batch_size
    return (collate_causal_lm([samples[g] for g in range(base, base + micro_batch_size)], seq_length, pad_id)
            for base in count(first, dp_size * micro_batch_size))


def check_identical_across_group(batches, group, batches_per_check=1):
    """Yield `batches`, first checking that every rank of `group` (a tensor-parallel group, whose ranks must
    compute on the same tokens) got the same micro-batches, `batches_per_check` at a time (the training loop's: a
    step's, so the answer is read on the host once per step, not per micro-batch): one all-reduce of two integers
    per check."""
    batches = iter(batches)
    for first in count(0, batches_per_check):
        held = list(islice(batches, batches_per_check))
        if not held:
            return
        digest = batch_fingerprint(tuple(held))
        extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=collectives.device())
        collectives.all_reduce(extremes, op=collectives.ReduceOp.MAX, group=group)
        if extremes[0] != -extremes[1]:
            which = f"{first}" if len(held) == 1 else f"{first} to {first + len(held) - 1}"
            raise ConfigError(
                f"tensor-parallel ranks {dist.get_process_group_ranks(group)} received different micro-batches "
                f"(micro-batch {which} of this run): every rank of a tensor-parallel group must see the same data. "
                f"Usual cause: random augmentation, shuffling or sampling seeded per global rank; seed it by the "
                f"data-parallel rank instead.")
        yield from held


def batch_fingerprint(batch) -> int:
    """A position-weighted sum of every integer in a (nested) tuple of tensors: equal batches, equal fingerprints."""
    if isinstance(batch, (tuple, list)):
        return sum(batch_fingerprint(item) * (i + 1) for i, item in enumerate(batch)) % 2 ** 61
    values = batch.reshape(-1).to(torch.int64)
    return int((values * (torch.arange(values.numel()) % 65521 + 1)).sum())
