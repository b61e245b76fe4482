"""Rows grouped by length (data.length_buckets): each step's global batch is rows of one bucket, padded to that
bucket's length rather than to seq_length; the next step's bucket may differ.

Every micro-batch of a step shares one length, as DeepSpeed's pipeline engine needs (it sizes its receive buffers
from the step's first micro-batch; engines/sequence_length.py re-sizes them when the next step's length differs).
The order is a function of the seed, the epoch and the global batch size only: each epoch, every bucket's rows are
shuffled and cut into global batches (the bucket's last partial batch, fewer than a global batch of rows, waits for
another epoch, a different random set each time), and the batches of all buckets are shuffled together. The n-th
micro-batch of data-parallel rank r in a step takes rows [n·D·B + r·B, n·D·B + (r + 1)·B) of the step's global
batch (D ranks, B rows each, as token shards' blend: data/loader.py), so any layout with the same global batch reads
the same rows in the same steps, and a resume from consumed samples goes on at exactly the next step.
"""
import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import Sampler


def bucket_bounds(length_buckets, seq_length):
    """The buckets' lengths, ascending, seq_length the last (rows longer than every listed length pad to it)."""
    return tuple(sorted({*length_buckets, seq_length}))


def row_lengths(dataset):
    """Each row's token count from the Arrow columns (no row is read): a preference pair's, the longer of its two
    sequences, which share a micro-batch (data/collator.py)."""
    names = [name for name in dataset.column_names if name.endswith("input_ids")]
    lengths = [pc.list_value_length(dataset.data.column(name)).to_numpy() for name in names]
    return np.maximum.reduce(lengths)


def padded_length(rows, bounds):
    """The length a micro-batch of `rows` (collator rows: dicts of token lists) pads to: the smallest bucket holding
    its longest sequence. Every row of a step is of one bucket, so every micro-batch of the step gets that bucket's."""
    longest = max((len(row[name]) for row in rows for name in row if name.endswith("input_ids")), default=0)
    return bounds[min(int(np.searchsorted(bounds, longest)), len(bounds) - 1)]  # too long: the collator says so


class LengthBuckets:
    """The rows of a dataset grouped by bucket, and the epochs' global batches of them (see the module's docstring).
    lengths: each row's token count (row_lengths); global_batch: rows per step over all data-parallel ranks."""

    def __init__(self, bounds, lengths, global_batch, seed):
        self.bounds, self.global_batch, self.seed = tuple(bounds), global_batch, seed
        self.row_buckets = np.searchsorted(self.bounds, lengths)
        self.counts = np.bincount(self.row_buckets, minlength=len(self.bounds))

    @property
    def steps_per_epoch(self):
        return int((self.counts // self.global_batch).sum())

    def describe(self):
        """The rows each bucket holds, as a start-up line or an error names them."""
        return ", ".join(f"{count} of at most {bound} tokens" for bound, count in zip(self.bounds, self.counts))

    def epoch_batches(self, epoch):
        """The epoch's global batches in step order: arrays of row indices, each of one bucket."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        batches = []
        for bucket in range(len(self.bounds)):
            rows = np.flatnonzero(self.row_buckets == bucket)
            rows = rows[torch.randperm(len(rows), generator=generator).numpy()]
            batches += [rows[start:start + self.global_batch]
                        for start in range(0, len(rows) - self.global_batch + 1, self.global_batch)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


class BucketedSampler(Sampler):
    """One data-parallel rank's rows of an epoch, in micro-batch order (its micro-batches of each step in turn);
    set_epoch as torch's DistributedSampler."""

    def __init__(self, buckets: LengthBuckets, dp_rank, dp_size, micro_batch_size):
        self.buckets, self.dp_rank, self.dp_size, self.micro_batch_size = buckets, dp_rank, dp_size, micro_batch_size
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.buckets.steps_per_epoch * self.buckets.global_batch // self.dp_size

    def __iter__(self):
        micro_step = self.dp_size * self.micro_batch_size
        for batch in self.buckets.epoch_batches(self.epoch):
            for start in range(self.dp_rank * self.micro_batch_size, len(batch), micro_step):
                yield from batch[start:start + self.micro_batch_size].tolist()
