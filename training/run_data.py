"""A run's datasets (RunData) and the id its padding takes: built once by rank 0 while the others wait, read only
by the first and last stage."""
import os

from data.datasets import build_dataset_distributed
from data.indexed import evaluation_samples, samples_per_epoch, training_blend
from data.length_buckets import LengthBuckets, bucket_bounds, row_lengths
from data.loader import micro_batches_per_epoch
from data.shard_files import parse_sources, read_shard_header
from errors import ConfigError
from evaluation.reference import reference_path, stored_everywhere, with_reference


class RunData:
    """Datasets of a run. Every rank takes part in building (rank 0 tokenizes, or for token shards builds the
    indices, while the others wait for it, then memory-map what it wrote); only the first and last stage read rows,
    middle stages use the lengths."""

    def __init__(self, spec, tokenizer, reads_data):
        cfg = spec.cfg
        self.cache_dir = cfg.data.cache_dir or os.path.join(cfg.output_dir, "data_cache")
        self.reads_data = reads_data
        self.train = self.eval = self.blend = self.train_sources = None  # blend, sources: token shards
        self.train_buckets = None  # data.length_buckets: the training rows grouped by length (every rank)
        self.train_length = self.eval_length = 0
        self.reference_files = {}  # DPO: split -> where its reference log-probabilities are stored
        for split in ("train", "eval"):
            path = cfg[f"{split}_file"]
            if not path or (split == "train" and cfg.eval_only):
                continue
            if cfg.data.format == "indexed":
                self._indexed(spec, split, path)
                continue
            dataset, _ = build_dataset_distributed(path, tokenizer, cfg.data, cfg.seq_length,
                                                   cache_dir=self.cache_dir, vocab_size=spec.model_config.vocab_size,
                                                   limit_minutes=cfg.data_build_timeout_minutes)
            if spec.preference.needs_reference:
                self.reference_files[split] = reference_path(self.cache_dir, dataset, spec.reference_checkpoint)
            if split == "train" and cfg.data.length_buckets:
                self.train_buckets = LengthBuckets(bucket_bounds(cfg.data.length_buckets, cfg.seq_length),
                                                   row_lengths(dataset), spec.samples_per_step, cfg.seed)
            setattr(self, f"{split}_length", len(dataset))
            setattr(self, split, dataset if reads_data else None)

    def _indexed(self, spec, split, path):
        """Token shards: the evaluation corpora now; for training, one epoch's length (an epoch of a blend: each
        corpus's samples once) until `open_blend` knows how many samples the run takes."""
        cfg = spec.cfg
        sources = parse_sources(path, f"{split}_file")
        if split == "train":
            self.train_sources = sources
            self.train_length = sum(samples_per_epoch(read_shard_header(s.prefix), cfg.seq_length) for s in sources)
            return
        self.eval, self.eval_length = evaluation_samples(
            sources, reads_data=self.reads_data, seed=cfg.seed, seq_length=cfg.seq_length,
            isolate=cfg.data.document_isolation, vocab_size=spec.model_config.vocab_size,
            build_limit_minutes=cfg.data_build_timeout_minutes, index_dir=cfg.data.index_dir)

    def steps_per_epoch(self, spec):
        """Optimizer steps in an epoch of the training data, the same on every rank; a ConfigError if not one."""
        cfg, samples_per_step = spec.cfg, spec.samples_per_step
        if self.train_buckets is not None:
            steps = self.train_buckets.steps_per_epoch
        elif cfg.data.format == "indexed":  # no sampler: the blend is one sequence of samples every layout reads alike
            steps = self.train_length // samples_per_step
        else:
            steps = (micro_batches_per_epoch(self.train_length, spec.data_parallel, cfg.micro_batch_size)
                     // cfg.gradient_accumulation_steps)
        if steps == 0 and self.train_buckets is not None:
            raise ConfigError(f"data.length_buckets={list(cfg.data.length_buckets)} group train_file's rows as "
                              f"{self.train_buckets.describe()}: no bucket holds one step's {samples_per_step} rows "
                              f"(a step's rows share a bucket); use fewer buckets, add data or lower the batch size.")
        if steps == 0:
            raise ConfigError(f"train_file gives {self.train_length} examples, fewer than one step's "
                              f"{samples_per_step} (data-parallel ranks x micro_batch_size x "
                              f"gradient_accumulation_steps); add data or lower the batch size.")
        return steps

    def open_blend(self, spec, total_samples):
        """Token shards: build (rank 0) and open (data-reading ranks) what the run's first `total_samples` need."""
        cfg = spec.cfg
        self.blend = training_blend(self.train_sources, reads_data=self.reads_data, seed=cfg.seed,
                                    seq_length=cfg.seq_length, isolate=cfg.data.document_isolation,
                                    blend_dir=os.path.join(cfg.output_dir, "data_index"),
                                    vocab_size=spec.model_config.vocab_size, total_samples=total_samples,
                                    build_limit_minutes=cfg.data_build_timeout_minutes, index_dir=cfg.data.index_dir)

    def epochs(self, consumed_samples):
        """Token shards: how many epochs of each corpus the run has read (metrics), on a data-reading rank."""
        return self.blend.epochs(consumed_samples) if self.blend is not None else {}

    def missing_reference(self):
        """Whether some split's reference log-probabilities are not stored yet (DPO), as every rank sees it."""
        return not all(stored_everywhere(path) for path in self.reference_files.values())

    def add_reference(self, engine, spec, pad_id, log):
        """DPO: every split with its pairs' reference log-probabilities (evaluation/reference.py), read or computed
        with the engine's current weights, which must be the starting ones. Every rank calls it."""
        for split, path in self.reference_files.items():
            dataset = with_reference(engine, getattr(self, split), getattr(self, f"{split}_length"), path,
                                     spec.reference_checkpoint, spec.cfg, pad_id, log=log)
            setattr(self, split, dataset)


def pad_token_id(tokenizer, model_config):
    """The id padding positions get (their labels are -100): the tokenizer's, or without one (pre-tokenized data)
    the model config's pad, else eos (the first, when it lists several), else 0."""
    if tokenizer is not None:
        candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    else:
        candidates = (model_config.pad_token_id, model_config.eos_token_id)
    for candidate in candidates:
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return candidate
    return 0
