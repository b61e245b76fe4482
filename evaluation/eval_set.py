"""Evaluation over a whole dataset, each example exactly once, as a token-weighted mean loss.

DeepSpeed's eval_batch averages micro-batch means and needs full micro-batches on every data-parallel rank; so each
rank takes every dp_size-th example, the shards are padded to the same number of full micro-batches with rows that
carry no labels, and every micro-batch loss is weighted by its number of labelled tokens. Under context parallelism
the ranks of a context group read the same examples (sharded by replica) and each takes its tokens of them.
"""
import math
from functools import partial

import torch
from torch.utils.data import DataLoader

import collectives
from cluster.console import ProgressBar
from data.collator import collate, empty_row
from data.loader import check_identical_across_group
from deepspeed_internals.access import clear_total_loss
from engines.sequence_length import use_sequence_length
from models.loss import split_micro_batch
from models.preference import PreferenceLoss


class PaddedShard(torch.utils.data.Dataset):
    def __init__(self, dataset, dp_rank, dp_size, micro_batch_size):
        self.dataset = dataset
        self.indices = list(range(dp_rank, len(dataset), dp_size))
        per_rank = math.ceil(len(dataset) / dp_size)
        self.length = math.ceil(per_rank / micro_batch_size) * micro_batch_size
        self.empty = empty_row(dataset[0]) if len(dataset) else None

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.dataset[self.indices[i]] if i < len(self.indices) else self.empty


def evaluate(engine, dataset, dataset_length, cfg, pad_id):
    """(token-weighted mean loss, perplexity) over the whole dataset, the same value on every rank; under a
    preference objective (pair-weighted mean loss, {TRL's metric: its mean over the pairs}) instead.
    Middle stages pass dataset=None and read nothing. A mixture of experts' loss holds its load-balancing term, as
    transformers' outputs.loss and training's `loss` do, and a run training the MTP layer's its MTP term, as
    training's `loss` does; the perplexity is of the cross-entropy alone."""
    context = engine.module.context
    dp_rank, dp_size = context.replica(engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size())
    micro_batch = cfg.micro_batch_size
    num_micro_batches = math.ceil(math.ceil(dataset_length / dp_size) / micro_batch)
    token_counts = []
    batches = None
    if dataset is not None:
        loader = DataLoader(PaddedShard(dataset, dp_rank, dp_size, micro_batch), batch_size=micro_batch,
                            collate_fn=lambda rows: collate(rows, cfg.seq_length, pad_id))
        units = engine.module.loss_fn.units  # labelled tokens, or scored pairs
        batches = (token_counts.append(int(units(b[1], whole=True))) or split_micro_batch(context, b) for b in loader)
        if cfg.tensor_parallel_size > 1:
            batches = check_identical_across_group(batches, engine.grid.get_slice_parallel_group())
    loss_fn = engine.module.loss_fn
    preference = isinstance(loss_fn, PreferenceLoss)  # its evaluation's metric sums are kept apart from training's
    loss_sum, cross_entropy_sum, tokens = 0.0, 0.0, 0
    use_sequence_length(engine, cfg.seq_length // context.size)  # rows of seq_length, whatever training's last were
    with ProgressBar(num_micro_batches, "eval", leave=False) as bar:
        for start in range(0, num_micro_batches, cfg.gradient_accumulation_steps):
            chunk = min(cfg.gradient_accumulation_steps, num_micro_batches - start)
            losses = engine.eval_batch(batches, reduce_output=None, bcast_loss=False, num_micro_batches=chunk)
            # each micro-batch's added terms (load balancing, a trained MTP layer's), which its loss holds
            terms = [] if preference else [float(term) for term in loss_fn.take_aux_terms()]
            terms = terms or [0.0] * chunk
            if engine.is_last_stage() and engine.grid.get_slice_parallel_rank() == 0:  # once per tensor-parallel group
                for loss, count, term in zip(losses, token_counts[start:start + chunk], terms):
                    if count:  # each context rank holds size x its share of the loss (ContextParallel.loss)
                        loss_sum += float(loss) * count / context.size
                        cross_entropy_sum += (float(loss) - term) * count / context.size
                        tokens += count / context.size
            bar.update(chunk)
    # Only last-stage ranks hold losses; a world-wide sum gives every rank the total.
    totals = torch.tensor([loss_sum, cross_entropy_sum, tokens], dtype=torch.float64, device=collectives.device())
    collectives.all_reduce(totals)
    mean = (totals[0] / totals[2]).item() if totals[2] else float("nan")
    if preference:
        return mean, loss_fn.take_metrics(evaluation=True)
    cross_entropy = (totals[1] / totals[2]).item() if totals[2] else float("nan")
    return mean, math.exp(min(cross_entropy, 80.0))


def score_examples(engine, dataset, dataset_length, cfg, pad_id, width, per_example=lambda output: output,
                   desc="scoring"):
    """(dataset_length, width) float32 on every rank: each data-parallel replica runs its share of the examples
    (evaluation's sharding) forward through the pipeline, whose loss_fn returns values per row; per_example turns a
    micro-batch's output into `width` values per example. One all-reduce, to which only the first tensor- and
    context-parallel rank of each last stage adds, assembles them. Every rank calls it; middle stages pass
    dataset=None and read nothing. desc: the progress bar's name."""
    context = engine.module.context
    # the ranks of a context group score the same examples, each its tokens of them
    dp_rank, dp_size = context.replica(engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size())
    micro_batch = cfg.micro_batch_size
    num_micro_batches = math.ceil(math.ceil(dataset_length / dp_size) / micro_batch)
    batches = None
    if dataset is not None:
        shard = PaddedShard(dataset, dp_rank, dp_size, micro_batch)
        loader = DataLoader(shard, batch_size=micro_batch,
                            collate_fn=lambda rows: collate(rows, cfg.seq_length, pad_id))
        batches = map(partial(split_micro_batch, context), loader)
    outputs = []
    clear_total_loss(engine)  # eval_batch would add these outputs to the last step's loss
    use_sequence_length(engine, cfg.seq_length // context.size)
    with ProgressBar(num_micro_batches, desc, leave=False) as bar:
        for start in range(0, num_micro_batches, cfg.gradient_accumulation_steps):
            chunk = min(cfg.gradient_accumulation_steps, num_micro_batches - start)
            outputs += engine.eval_batch(batches, reduce_output=None, bcast_loss=False, num_micro_batches=chunk) or []
            bar.update(chunk)
    values = torch.zeros(dataset_length, width, dtype=torch.float32, device=collectives.device())
    if outputs and engine.grid.get_slice_parallel_rank() == 0 and context.rank == 0:
        scores = torch.cat([per_example(output.float()) for output in outputs])  # shard order
        owned = len(range(dp_rank, dataset_length, dp_size))  # the rest pads the last micro-batch
        values[dp_rank::dp_size] = scores[:owned].to(values.device)
    collectives.all_reduce(values)
    return values.cpu()
