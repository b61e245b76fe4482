"""DPO's reference log-probabilities: each pair's summed chosen and rejected response log-probabilities under the
starting weights, computed once before training in a forward-only pass through the pipeline (TRL's
`precompute_ref_log_probs`), so that no second model exists at any time; under LoRA the base with its adapters off.

They are stored beside the tokenized data (`<cache_dir>/<data file>-reference-<key>.pt`), keyed by the tokenized
rows (their cache files name the source, tokenizer, settings and seq_length) and by the manifest checksum of the
checkpoint the weights came from; a later run or a resume on the same data and checkpoint reads them instead of
computing them again. The last stage reads them with its micro-batches (data/collator.py `collate_preference`).
"""
import hashlib
import json
import os

import torch
import torch.distributed as dist

import collectives
from checkpoints.files import atomic_write
from errors import ConfigError
from models.lora import adapters_off
from models.preference import ReferenceLogProbs
from evaluation.eval_set import score_examples
from cluster.shared_files import VISIBLE_WITHIN_S, wait_for_files


class WithReference(torch.utils.data.Dataset):
    """A preference dataset whose rows carry their reference log-probabilities (float32 per pair)."""

    def __init__(self, dataset, chosen, rejected):
        self.dataset, self.chosen, self.rejected = dataset, chosen, rejected

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return {**self.dataset[index], "ref_chosen_logps": float(self.chosen[index]),
                "ref_rejected_logps": float(self.rejected[index])}


def reference_path(cache_dir, dataset, checkpoint):
    """Where the reference log-probabilities of `dataset`'s rows under `checkpoint` (a manifest checksum) live."""
    rows = [os.path.basename(f["filename"]) for f in dataset.cache_files]
    key = hashlib.sha256(json.dumps([rows, checkpoint]).encode()).hexdigest()[:16]
    stem = rows[0].split("-preference-")[0] if rows else "data"
    return os.path.join(cache_dir, f"{stem}-reference-{key}.pt")


def stored_everywhere(path):
    """Whether the file is stored, as rank 0 finds it: all ranks compute it, or none (a pass some ranks skip would
    hang); when it is, the others wait (bounded) for it to show on their node, as a shared filesystem may lag."""
    found = torch.tensor([int(os.path.isfile(path))], device=collectives.device())
    collectives.broadcast(found, src=0)
    if found:
        wait_for_files([path], VISIBLE_WITHIN_S)
    return bool(found)


def with_reference(engine, dataset, dataset_length, path, checkpoint, cfg, pad_id, log=print):
    """`dataset` (None on middle stages, which only take part in the pass) with each pair's reference
    log-probabilities: read from `path`, or computed with the engine's current weights (adapters off) and stored
    there. Every rank calls it."""
    if stored_everywhere(path):
        stored = torch.load(path, weights_only=True)
        log(f"reference log-probabilities of {dataset_length} pairs read from {path}")
    else:
        log(f"computing the reference log-probabilities of {dataset_length} pairs (forward only, starting weights"
            f"{', adapters off' if has_adapters(engine.module) else ''})")
        stored = {"checkpoint": checkpoint, **compute_reference(engine, dataset, dataset_length, cfg, pad_id)}
        if dist.get_rank() == 0:  # one writer for the whole job; the file object keeps the bytes free of its name
            atomic_write(path, lambda f: torch.save(stored, f))
        log(f"stored them in {path}")
    if stored["checkpoint"] != checkpoint:
        raise ConfigError(f"{path} holds reference log-probabilities of checkpoint {stored['checkpoint']}, not of "
                          f"{checkpoint} this run starts from; delete it to compute them again.")
    return None if dataset is None else WithReference(dataset, stored["chosen"], stored["rejected"])


def has_adapters(module):
    return any(hasattr(m, "lora_scaling") for m in module.modules())


def compute_reference(engine, dataset, dataset_length, cfg, pad_id):
    """{"chosen": (pairs,), "rejected": (pairs,)} float32 on every rank: each data-parallel replica scores its
    share of the pairs, the last stage summing each response's log-probabilities (evaluation/eval_set.py
    score_examples)."""
    module = engine.module
    preference = module.loss_fn
    module.loss_fn = ReferenceLogProbs(preference)  # each row's log-probability instead of the pairs' loss
    try:
        with adapters_off(module):  # a micro-batch's chosen rows, then its rejected ones: one pair per row
            values = score_examples(engine, dataset, dataset_length, cfg, pad_id, width=2,
                                    per_example=lambda logps: torch.stack(logps.chunk(2), dim=1), desc="reference")
    finally:
        module.loss_fn = preference
    return {"chosen": values[:, 0].clone(), "rejected": values[:, 1].clone()}
