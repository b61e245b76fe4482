"""Rows of at most seq_length tokens from full token sequences: text documents packed into blocks of exactly
seq_length, overlong sequences truncated or split (chat at the ends of assistant turns), and whole examples packed
best-fit into rows that list their documents' lengths, so that the collator keeps each example to itself."""
import bisect
from itertools import accumulate, chain

import datasets

from errors import ConfigError

from .formats import IGNORE_INDEX, TOKEN_FEATURE

PACKED_FEATURES = datasets.Features({"input_ids": TOKEN_FEATURE, "labels": TOKEN_FEATURE, "lengths": TOKEN_FEATURE})
# A preference pair's two sequences (prompt + response), labels -100 on the prompt.
PAIR_ROW_FEATURES = datasets.Features({f"{side}_{column}": TOKEN_FEATURE for side in ("chosen", "rejected")
                                       for column in ("input_ids", "labels")})


def pack_blocks(batch, *, seq_length: int, isolate: bool) -> dict:
    """Concatenate the batch's documents and cut the stream into blocks of exactly seq_length (tail dropped);
    with `isolate`, each block also lists the lengths of the document pieces it holds."""
    stream = list(chain.from_iterable(batch["input_ids"]))
    starts = range(0, len(stream) - seq_length + 1, seq_length)
    blocks = [stream[start:start + seq_length] for start in starts]
    if not isolate:
        return {"input_ids": blocks, "labels": blocks}
    boundaries = list(accumulate(len(ids) for ids in batch["input_ids"] if ids))
    lengths = []
    for start in starts:
        inside = boundaries[bisect.bisect_right(boundaries, start):bisect.bisect_left(boundaries, start + seq_length)]
        edges = [start, *inside, start + seq_length]
        lengths.append([end - begin for begin, end in zip(edges, edges[1:])])
    return {"input_ids": blocks, "labels": blocks, "lengths": lengths}


def pack_examples(batch, *, seq_length: int) -> dict:
    """Best-fit decreasing within the batch: each example, longest first, goes into the row whose free space it
    fills most tightly, or a new row. Rows keep whole examples and list their lengths (data/collator.py)."""
    order = sorted(range(len(batch["input_ids"])), key=lambda i: -len(batch["input_ids"][i]))
    rows, free = [], []  # free: sorted (space left, row index)
    for i in order:
        length = len(batch["input_ids"][i])
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):
            rows.append([])
            space, row = seq_length, len(rows) - 1
        else:
            space, row = free.pop(slot)
        rows[row].append(i)
        bisect.insort(free, (space - length, row))
    pick = lambda column, row: list(chain.from_iterable(batch[column][i] for i in row))  # noqa: E731
    return {"input_ids": [pick("input_ids", row) for row in rows], "labels": [pick("labels", row) for row in rows],
            "lengths": [[len(batch["input_ids"][i]) for i in row] for row in rows]}


def cut_sequences(batch, *, seq_length: int, split: bool) -> dict:
    """Truncate each sequence to seq_length, or split it into pieces of at most seq_length (chat: at the ends of
    assistant turns, `turn_pieces`); keep pieces with a target.

    A piece needs a label after its first position: the model predicts token t from tokens before t, so a piece of
    one token, or of prompt only, adds nothing to the loss (and a micro-batch of only such pieces would divide by 0).
    """
    all_labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    all_turn_ends = batch["turn_ends"] if "turn_ends" in batch else [None] * len(all_labels)
    input_ids, labels = [], []
    for ids, targets, turn_ends in zip(batch["input_ids"], all_labels, all_turn_ends):
        if not split:
            pieces = [(0, seq_length)]
        elif turn_ends is None:
            pieces = [(start, start + seq_length) for start in range(0, len(ids), seq_length)]
        else:
            pieces = turn_pieces(len(ids), turn_ends, seq_length)[0]
        for start, end in pieces:
            piece_labels = targets[start:end]
            if any(label != IGNORE_INDEX for label in piece_labels[1:]):
                input_ids.append(ids[start:end])
                labels.append(piece_labels)
    return {"input_ids": input_ids, "labels": labels}


def turn_pieces(length: int, turn_ends: list[int], seq_length: int) -> tuple[list[tuple[int, int]], int]:
    """A conversation of `length` tokens cut at assistant-turn ends into (start, end) pieces of at most seq_length
    tokens, each holding as many whole turns as fit; and how many pieces were cut inside a turn (a single
    exchange longer than seq_length keeps its first seq_length tokens). Tokens after the last assistant turn
    (nothing to learn) are dropped from a split conversation."""
    if length <= seq_length:
        return [(0, length)], 0
    pieces, truncated, start, next_end = [], 0, 0, 0
    while next_end < len(turn_ends):
        fits = bisect.bisect_right(turn_ends, start + seq_length, lo=next_end)
        if fits > next_end:
            end, next_end = turn_ends[fits - 1], fits
        else:
            end, next_end, truncated = start + seq_length, next_end + 1, truncated + 1
        pieces.append((start, end))
        start = turn_ends[next_end - 1]
    return pieces, truncated


def cut_pairs(batch, indices, *, seq_length: int, skip: bool, path) -> dict:
    """Each pair as its two sequences, prompt + response, each cut to its first seq_length tokens (TRL's
    truncation_mode=keep_start with max_length=seq_length); labels only on the response. A pair whose response loses
    every token to the cut, or whose two sequences become the same, has nothing to learn: an error naming the
    example, or with `skip` (data.bad_lines=skip) dropped (and counted by the caller)."""
    rows = {name: [] for name in PAIR_ROW_FEATURES}
    for index, prompt, *responses in zip(indices, batch["prompt_ids"], batch["chosen_ids"], batch["rejected_ids"]):
        sequences = [(prompt + response)[:seq_length] for response in responses]
        problem = None
        if len(prompt) >= seq_length:
            problem = f"its prompt of {len(prompt)} tokens leaves no response token within seq_length={seq_length}"
        elif sequences[0] == sequences[1]:
            problem = f"its chosen and rejected responses are the same within seq_length={seq_length}"
        if problem:
            if skip:
                continue
            raise ConfigError(f"{path}: example {index}: {problem}; raise seq_length, shorten it, or drop such pairs "
                              "with data.bad_lines=skip")
        for side, ids in zip(("chosen", "rejected"), sequences):
            rows[f"{side}_input_ids"].append(ids)
            rows[f"{side}_labels"].append([IGNORE_INDEX] * len(prompt) + ids[len(prompt):])
    return rows
