"""Data pipeline: demo corpus and tokenizer, tokenized datasets, the causal-LM collator, stage-aware loaders."""

from .collator import collate_causal_lm
from .corpus import train_demo_tokenizer, write_demo_corpus
from .datasets import BuildStats, build_dataset, build_dataset_distributed
from .formats import IGNORE_INDEX
from .loader import (
    MicroBatchStream,
    StageLoader,
    build_stage_loader,
    infinite_micro_batches,
    micro_batches_per_epoch,
)

__all__ = [
    "IGNORE_INDEX", "BuildStats", "MicroBatchStream", "StageLoader", "build_dataset", "build_dataset_distributed",
    "build_stage_loader", "collate_causal_lm", "infinite_micro_batches", "micro_batches_per_epoch",
    "train_demo_tokenizer", "write_demo_corpus",
]
