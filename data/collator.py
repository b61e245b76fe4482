"""Rows of token ids → the tensor tuple DeepSpeed's pipeline engine feeds its first and last stage."""

import torch

from .formats import IGNORE_INDEX
from .length_buckets import padded_length


def collate_causal_lm(examples, seq_length: int, pad_id: int):
    """Right-pad every row to exactly `seq_length`; returns `((input_ids, document_ids, position_ids), labels)`.

    All tensors are torch.long of shape (batch, seq_length): integer tensors cross stage boundaries without the
    engine asking for their gradients, and stay linear in seq_length. Position t learns to predict labels[t + 1]:
    rows whose labels run one token past their inputs (token shards' samples of seq_length + 1, Megatron's) make
    labels seq_length + 1 wide, so that the last position learns the token after the row (models/loss.py). A row
    is one document, or, when it has a `lengths` field (packed rows, data/packing.py), the documents of those
    lengths one after another.
    document_ids is k on the tokens of the row's k-th document (1 for a one-document row) and 0 on padding: the
    model attends only within a document. position_ids restart at 0 with every document (padding continues the
    last one's count); labels are -100 on padding and on the first token of each later document, which the
    previous document's last token must not learn to predict. Every micro-batch of a step has one width, the
    shapes the engine takes from its first (`collate` picks it: seq_length, or a length bucket's).
    """
    batch_size = len(examples)
    input_ids = torch.full((batch_size, seq_length), pad_id, dtype=torch.long)
    carried = int(any(len(example["labels"]) > len(example["input_ids"]) for example in examples))
    labels = torch.full((batch_size, seq_length + carried), IGNORE_INDEX, dtype=torch.long)
    document_ids = torch.zeros((batch_size, seq_length), dtype=torch.long)
    position_ids = torch.arange(seq_length, dtype=torch.long).repeat(batch_size, 1)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        if length > seq_length:
            raise ValueError(f"example of {length} tokens does not fit seq_length={seq_length}")
        input_ids[row, :length] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels[row, :len(example["labels"])] = torch.as_tensor(example["labels"], dtype=torch.long)
        start = 0
        for document, document_length in enumerate(example.get("lengths") or [length], start=1):
            document_ids[row, start:start + document_length] = document
            if start:  # the loss drops position 0 anyway (nothing precedes it)
                position_ids[row, start:] = torch.arange(seq_length - start)
                labels[row, start] = IGNORE_INDEX
            start += document_length
    return (input_ids, document_ids, position_ids), labels


def collate_preference(pairs, seq_length: int, pad_id: int):
    """Preference pairs → `((input_ids, document_ids, position_ids), (labels, reference_logps))`: the chosen
    sequences in the first half of the rows, the rejected in the second (TRL's order), so a pair never leaves its
    micro-batch. reference_logps (float32, one per row) are the reference model's summed response log-probabilities
    (evaluation/reference.py), zeros before they are computed."""
    rows = [{"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"]}
            for side in ("chosen", "rejected") for pair in pairs]
    inputs, labels = collate_causal_lm(rows, seq_length, pad_id)
    reference = torch.tensor([pair.get(f"ref_{side}_logps", 0.0) for side in ("chosen", "rejected") for pair in pairs],
                             dtype=torch.float32)
    return inputs, (labels, reference)


def collate(examples, seq_length: int, pad_id: int, bounds=None):
    """The collator the rows' kind needs: preference pairs or single sequences, padded to seq_length, or with
    bounds (data.length_buckets: data/length_buckets.py) to the smallest of them that holds the longest row."""
    length = padded_length(examples, bounds) if bounds else seq_length
    if examples and "chosen_input_ids" in examples[0]:
        return collate_preference(examples, length, pad_id)
    return collate_causal_lm(examples, length, pad_id)


def row_layout(data):
    """What every row of a run's data config (its `data` node) holds, known before any is read: 'packed', several
    documents (data.packing, data.document_isolation); 'full', one document's tokens filling the row (text blocks,
    token shards); 'padded', one document then padding. The model picks its attention masks from it
    (models/attention.py StageAttentionInputs)."""
    if data.packing or data.document_isolation:
        return "packed"
    return "full" if data.format in ("text", "indexed") else "padded"


def empty_row(example):
    """A row of `example`'s kind with no token: what evaluation pads a shard's last micro-batch with."""
    return {key: [] for key in example if key.endswith(("input_ids", "labels"))}
