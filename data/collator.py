"""Rows of token ids → the tensor tuple DeepSpeed's pipeline engine feeds its first and last stage."""

import torch

from .formats import IGNORE_INDEX


def collate_causal_lm(examples, seq_length: int, pad_id: int):
    """Right-pad every row to exactly `seq_length`; returns `((input_ids, document_ids, position_ids), labels)`.

    All tensors are torch.long of shape (batch, seq_length): integer tensors cross stage boundaries without the
    engine asking for their gradients, and stay linear in seq_length. A row is one document, or, when it has a
    `lengths` field (packed rows, data/packing.py), the documents of those lengths one after another.
    document_ids is k on the tokens of the row's k-th document (1 for a one-document row) and 0 on padding: the
    model attends only within a document. position_ids restart at 0 with every document (padding continues the
    last one's count); labels are -100 on padding and on the first token of each later document, which the
    previous document's last token must not learn to predict. A fixed width keeps the shapes the engine saw on its
    first micro-batch.
    """
    batch_size = len(examples)
    input_ids = torch.full((batch_size, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, seq_length), IGNORE_INDEX, dtype=torch.long)
    document_ids = torch.zeros((batch_size, seq_length), dtype=torch.long)
    position_ids = torch.arange(seq_length, dtype=torch.long).repeat(batch_size, 1)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        if length > seq_length:
            raise ValueError(f"example of {length} tokens does not fit seq_length={seq_length}")
        input_ids[row, :length] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels[row, :length] = torch.as_tensor(example["labels"], dtype=torch.long)
        start = 0
        for document, document_length in enumerate(example.get("lengths") or [length], start=1):
            document_ids[row, start:start + document_length] = document
            if start:  # the loss drops position 0 anyway (nothing precedes it)
                position_ids[row, start:] = torch.arange(seq_length - start)
                labels[row, start] = IGNORE_INDEX
            start += document_length
    return (input_ids, document_ids, position_ids), labels
