"""Rows of token ids → the tensor tuple DeepSpeed's pipeline engine feeds its first and last stage."""

import torch

from .datasets import IGNORE_INDEX


def collate_causal_lm(examples, seq_length: int, pad_id: int):
    """Right-pad every row to exactly `seq_length`; returns `((input_ids, attention_mask, position_ids), labels)`.

    All tensors are torch.long of shape (batch, seq_length): integer tensors cross stage boundaries without the
    engine asking for their gradients. attention_mask is 1 on real tokens, 0 on padding; position_ids count from 0 in
    every row; labels are -100 on padding. A fixed width keeps the shapes the engine saw on its first micro-batch.
    """
    batch_size = len(examples)
    input_ids = torch.full((batch_size, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, seq_length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, seq_length), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        if length > seq_length:
            raise ValueError(f"example of {length} tokens does not fit seq_length={seq_length}")
        input_ids[row, :length] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels[row, :length] = torch.as_tensor(example["labels"], dtype=torch.long)
        attention_mask[row, :length] = 1
    position_ids = torch.arange(seq_length, dtype=torch.long).repeat(batch_size, 1)
    return (input_ids, attention_mask, position_ids), labels
