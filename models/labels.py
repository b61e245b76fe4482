"""What each position of a row learns to predict: the next token's id, or IGNORE_INDEX (transformers' -100) where
nothing is learned. One place for both the loss (models/loss.py) and the context-parallel split, which shifts the
labels while a sequence is still whole (models/context_parallel.py)."""
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels, positions=None):
    """(rows, positions): position t's label is labels[:, t + 1] (the labels shifted, rather than the logits).
    Labels as wide as the rows (`positions` None or equal): the last position predicts nothing; one wider (token
    shards' samples, data/collator.py): it predicts the token after the row."""
    positions = labels.shape[1] if positions is None else positions
    return F.pad(labels[:, 1:], (0, positions + 1 - labels.shape[1]), value=IGNORE_INDEX)
