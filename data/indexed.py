"""Megatron-format token shards (`PREFIX.bin` + `PREFIX.idx`) as training samples, one corpus or a weighted blend.

A corpus's epoch e is its documents in an order shuffled by (seed, e), cut into samples of exactly seq_length + 1
tokens across document boundaries, each starting at the previous one's last token (Megatron's GPTDataset: a sample's
seq_length inputs and the token after them, so every token of the epoch but the first is predicted once; the last
partial sample of the epoch is dropped), and those samples in an order shuffled by (seed, e). The three arrays
(document order, sample cut, sample order) of each epoch are built once, by global rank 0 (the others wait on the
store, not in a collective: cluster/shared_files.py), with megatron-core's
`build_sample_idx`, and cached as .npy files beside the shards (PREFIX.index/, or under data.index_dir); every
reading rank memory-maps them, so neither start-up nor a step reads more than its own samples. The k-th sample a
run draws from a corpus is sample k mod n of its epoch k // n (n samples an epoch): a corpus that runs out goes on
with its next, reshuffled, epoch.

A blend of corpora follows Megatron's rule (megatron-core `build_blending_indices`): global sample g comes from the
corpus whose count lags its weight × g most, so every prefix of the run holds each corpus within one sample of its
share. The blend is a function of the global sample number only: any layout that reads samples [a, b) of it reads
the same tokens. Who builds what: `prepare_indices` (rank 0); who reads: `open_blend` (the data-reading ranks).
"""
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from checkpoints.files import atomic_write, write_text_atomic
from cluster.shared_files import built_by_rank_zero

from .shard_files import (HEADER_BYTES, ShardError, ShardHeader, megatron_datasets, read_shard_header,
                          vouched_by_metadata)

# --- one corpus's epochs ---------------------------------------------------------------------------------------------

def samples_per_epoch(header: ShardHeader, seq_length: int) -> int:
    """Samples of seq_length + 1 tokens in one epoch of the corpus; each starts at the previous one's last token."""
    return (header.tokens - 1) // seq_length


class CorpusIndex:
    """The cached arrays of one corpus for (seed, seq_length): per epoch its document order, sample cut and sample
    order, in PREFIX.index/s{seed}-L{seq_length}-{shards' identity}/, or with index_dir (shards on read-only
    storage) in index_dir/NAME-{digest of the prefix's path}.index/... ."""

    def __init__(self, header: ShardHeader, seed: int, seq_length: int, index_dir=None):
        self.header, self.seed, self.seq_length = header, seed, seq_length
        root = Path(f"{header.prefix}.index")
        if index_dir:
            digest = hashlib.sha256(os.path.abspath(header.prefix).encode()).hexdigest()[:8]
            root = Path(index_dir) / f"{os.path.basename(header.prefix)}-{digest}.index"
        self.directory = root / f"s{seed}-L{seq_length}-{header.identity}"
        self.samples_per_epoch = samples_per_epoch(header, seq_length)
        self._epochs = {}

    def files(self, epoch: int) -> dict[str, Path]:
        return {name: self.directory / f"epoch{epoch}-{name}.npy" for name in ("documents", "cut", "order")}

    def check_writable(self) -> None:
        """Before anything starts: the index can be written where it goes, unless its first epoch is there already
        (an earlier run built it; read-only storage serves)."""
        if self.files(0)["order"].exists():
            return
        existing = next(path for path in (self.directory, *self.directory.parents) if path.exists())
        if not os.access(existing, os.W_OK):
            raise ShardError(f"{self.header.prefix}: its sample index goes to {self.directory}, but {existing} is "
                             f"not writable (read-only storage?); set data.index_dir to a directory that every "
                             f"node can write and read")

    def build(self, epochs: int) -> list[Path]:
        """Write the arrays of epochs [0, epochs) not yet on disk (atomically: readers never see half); returns the
        files a reader of those epochs opens."""
        build_sample_idx = megatron_datasets()[1].build_sample_idx
        sizes = None
        for epoch in range(epochs):
            files = self.files(epoch)
            if all(path.exists() for path in files.values()):
                continue
            if sizes is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                sizes = sequence_lengths(self.header)
                self._check_stats(sizes)
            rng = np.random.default_rng([self.seed, epoch])
            documents = rng.permutation(len(sizes)).astype(np.int32)
            cut = build_sample_idx(sizes, documents, self.seq_length, 1, self.header.tokens,
                                   drop_last_partial_sequence=True, add_extra_token_to_sequence=True)
            order = rng.permutation(len(cut) - 1).astype(np.int32 if len(cut) < 2**31 else np.int64)
            for name, array in (("documents", documents), ("cut", cut), ("order", order)):
                save_array(files[name], array)
        stats = [self.stats_file] if self.stats_file.exists() else []
        return [path for epoch in range(epochs) for path in self.files(epoch).values()] + stats

    @property
    def stats_file(self) -> Path:
        return self.directory.parent / f"stats-{self.header.identity}.json"

    def _check_stats(self, sizes) -> None:
        """The largest token id, scanned once per shards and cached: shards from elsewhere record no vocabulary.
        Skipped where prepare_data.py's PREFIX.json vouches for the shards (its tokenizer bounds their ids, and
        check_sources compares its vocabulary with the model's): a first start then reads no .bin."""
        stats_file = self.stats_file
        if stats_file.exists() or vouched_by_metadata(self.header):
            return
        largest, smallest = -1, np.iinfo(np.int64).max
        with open(self.header.prefix + ".bin", "rb") as f:  # read, not memory-mapped: the scan's pages stay no RSS
            while len(chunk := np.fromfile(f, dtype=self.header.dtype, count=1 << 24)):
                largest, smallest = max(largest, int(chunk.max())), min(smallest, int(chunk.min()))
        write_text_atomic(stats_file, json.dumps({"max_token_id": largest, "min_token_id": smallest,
                                                  "documents": int(len(sizes))}))

    def check_token_range(self, vocab_size: int) -> None:
        stats_file = self.stats_file
        if not stats_file.exists():
            return  # vouched for by PREFIX.json, or built by an older run that checked it already
        stats = json.loads(stats_file.read_text())
        if stats["min_token_id"] < 0 or stats["max_token_id"] >= vocab_size:
            raise ShardError(f"{self.header.prefix}.bin holds token ids in [{stats['min_token_id']}, "
                             f"{stats['max_token_id']}], outside the model's vocabulary [0, {vocab_size}); prepare "
                             f"it with the model's tokenizer")

    def epoch(self, epoch: int):
        """(document order, sample cut, sample order) of `epoch`, memory-mapped."""
        if epoch not in self._epochs:
            files = self.files(epoch)
            missing = [str(p) for p in files.values() if not p.exists()]
            if missing:
                raise FileNotFoundError(f"{missing[0]}: the index of epoch {epoch} was not built (prepare_indices "
                                        f"builds every epoch a run reaches before it starts)")
            self._epochs[epoch] = tuple(np.load(files[name], mmap_mode="r") for name in ("documents", "cut", "order"))
        return self._epochs[epoch]


def save_array(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array))


def sequence_lengths(header: ShardHeader) -> np.ndarray:
    """Every document's length in tokens (int32, memory-mapped from the .idx)."""
    return np.memmap(header.prefix + ".idx", dtype=np.int32, mode="r", offset=HEADER_BYTES, shape=(header.sequences,))


class IndexedCorpus:
    """The samples of one corpus: `sample(k)` is the k-th sample a run draws from it, `cut_sample(e, s)` sample s of
    epoch e in cut order. Rows are {"input_ids": seq_length tokens, "labels": those and the next} and, with document
    isolation, "lengths" (the document pieces of the seq_length + 1 tokens, as the text format's packed blocks list
    them)."""

    def __init__(self, index: CorpusIndex, isolate: bool):
        self.index, self.isolate = index, isolate
        self.shards = megatron_datasets()[0].IndexedDataset(index.header.prefix)  # memory-mapped
        self.samples_per_epoch = index.samples_per_epoch

    def sample(self, k: int) -> dict:
        epoch, position = divmod(int(k), self.samples_per_epoch)
        return self.cut_sample(epoch, int(self.index.epoch(epoch)[2][position]))

    def cut_sample(self, epoch: int, s: int) -> dict:
        documents, cut, _ = self.index.epoch(epoch)
        (first, start), (last, end) = cut[s], cut[s + 1]
        pieces = []
        for position in range(int(first), int(last) + 1):  # the cut's end offset is the sample's last token
            offset = int(start) if position == first else 0
            length = int(end) + 1 - offset if position == last else None  # None: to the document's end
            piece = self.shards.get(int(documents[position]), offset, length)
            if len(piece):  # an empty document (Megatron's builder writes them) is no piece of the row
                pieces.append(piece)
        tokens = np.concatenate(pieces).astype(np.int64)
        row = {"input_ids": tokens[:-1], "labels": tokens}
        if self.isolate:
            row["lengths"] = [len(piece) for piece in pieces]
        return row


# --- the blend -------------------------------------------------------------------------------------------------------

def blend_counts(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(corpus of each global sample, its number within that corpus) for samples [0, size): Megatron's rule."""
    build_blending_indices = megatron_datasets()[1].build_blending_indices
    corpus = np.zeros(size, dtype=np.int16)
    within = np.zeros(size, dtype=np.int64)
    build_blending_indices(corpus, within, np.asarray(weights, dtype=np.float64), len(weights), size, False)
    return corpus, within


class Blend:
    """Global sample g of a run → a row, from one corpus or several by weight; `epochs(consumed)` says how far each
    corpus is after `consumed` samples."""

    def __init__(self, sources, corpora, corpus_of=None, number_in_corpus=None):
        self.sources, self.corpora = sources, corpora
        self.corpus_of, self.number_in_corpus = corpus_of, number_in_corpus  # None: a single corpus
        self._counted, self._counts = 0, np.zeros(len(corpora), dtype=np.int64)

    def __getitem__(self, g: int) -> dict:
        if self.corpus_of is None:
            return self.corpora[0].sample(g)
        return self.corpora[int(self.corpus_of[g])].sample(int(self.number_in_corpus[g]))

    def samples_drawn(self, consumed: int) -> np.ndarray:
        """Samples each corpus gave to the first `consumed` of the run (counted on from the last call)."""
        if self.corpus_of is None:
            return np.array([consumed])
        if consumed < self._counted:
            self._counted, self._counts = 0, np.zeros_like(self._counts)
        self._counts += np.bincount(self.corpus_of[self._counted:consumed], minlength=len(self.corpora))
        self._counted = consumed
        return self._counts.copy()

    def epochs(self, consumed: int) -> dict[str, float]:
        """{"epoch/NAME": epochs of corpus NAME read so far}: 1.25 is a quarter into its second epoch."""
        drawn = self.samples_drawn(consumed)
        return {f"epoch/{source.name}": round(float(count) / corpus.samples_per_epoch, 4)
                for source, corpus, count in zip(self.sources, self.corpora, drawn)}


def blend_files(directory, sources) -> dict[str, Path]:
    key = hashlib.sha256(json.dumps([[os.path.abspath(s.prefix), s.weight] for s in sources]).encode()).hexdigest()
    return {name: Path(directory) / f"blend-{key[:16]}-{name}.npy" for name in ("corpus", "within")}


def prepare_indices(sources, headers, *, seed: int, seq_length: int, total_samples: int, blend_dir,
                    vocab_size: int, index_dir=None) -> list[Path]:
    """Build what `total_samples` of the run need and is not cached yet: the blend (when several corpora) and each
    corpus's epochs up to the last one it reaches. One rank calls this; the others wait, then `open_blend`. Returns
    the files `open_blend` reads."""
    indices = [CorpusIndex(header, seed, seq_length, index_dir) for header in headers]
    needed = []
    if len(sources) == 1:
        drawn = [total_samples]
    else:
        files = blend_files(blend_dir, sources)
        cached = np.load(files["corpus"], mmap_mode="r") if files["corpus"].exists() else None
        if cached is None or len(cached) < total_samples:  # the blend's prefix never changes: a longer one serves
            Path(blend_dir).mkdir(parents=True, exist_ok=True)
            for name, array in zip(("corpus", "within"), blend_counts([s.weight for s in sources], total_samples)):
                save_array(files[name], array)
            cached = np.load(files["corpus"], mmap_mode="r")
        drawn = np.bincount(cached[:total_samples], minlength=len(sources))
        needed += files.values()
    for index, count in zip(indices, drawn):
        needed += index.build(max(1, math.ceil(int(count) / index.samples_per_epoch)))
        index.check_token_range(vocab_size)
    return needed


def open_blend(sources, headers, *, seed: int, seq_length: int, isolate: bool, blend_dir, vocab_size: int,
               index_dir=None) -> Blend:
    """The run's samples, memory-mapped from what `prepare_indices` built."""
    corpora = []
    for header in headers:
        index = CorpusIndex(header, seed, seq_length, index_dir)
        index.check_token_range(vocab_size)
        corpora.append(IndexedCorpus(index, isolate))
    if len(sources) == 1:
        return Blend(sources, corpora)
    files = blend_files(blend_dir, sources)
    return Blend(sources, corpora, *(np.load(files[name], mmap_mode="r") for name in ("corpus", "within")))


class WholeCorpora:
    """Every sample of epoch 0 of each corpus once, corpus after corpus (evaluation), as a sized dataset."""

    def __init__(self, corpora):
        self.corpora = corpora
        self.starts = np.cumsum([0] + [c.samples_per_epoch for c in corpora])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> dict:
        c = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.corpora[c].sample(i - int(self.starts[c]))


# --- in a run --------------------------------------------------------------------------------------------------------

def training_blend(sources, *, reads_data: bool, seed: int, seq_length: int, isolate: bool, blend_dir,
                   vocab_size: int, total_samples: int, build_limit_minutes: float, index_dir=None) -> Blend | None:
    """The run's training samples on a data-reading rank (None elsewhere: middle stages open no shard), after rank
    0 has built the indices the run's `total_samples` reach (the others wait at most build_limit_minutes for it,
    outside any collective: cluster/shared_files.py)."""
    headers = [read_shard_header(source.prefix) for source in sources]
    built_by_rank_zero(lambda: prepare_indices(sources, headers, seed=seed, seq_length=seq_length,
                                               total_samples=total_samples, blend_dir=blend_dir,
                                               vocab_size=vocab_size, index_dir=index_dir),
                       f"the sample index of {', '.join(s.prefix for s in sources)}", build_limit_minutes)
    for header in headers:  # every rank, so that all stop alike on token ids outside the vocabulary
        CorpusIndex(header, seed, seq_length, index_dir).check_token_range(vocab_size)
    if not reads_data:
        return None
    return open_blend(sources, headers, seed=seed, seq_length=seq_length, isolate=isolate, blend_dir=blend_dir,
                      vocab_size=vocab_size, index_dir=index_dir)


def evaluation_samples(sources, *, reads_data: bool, seed: int, seq_length: int, isolate: bool,
                       vocab_size: int, build_limit_minutes: float, index_dir=None) -> tuple[WholeCorpora | None, int]:
    """(each evaluation corpus's epoch-0 samples once, on a data-reading rank; their count, on every rank)."""
    headers = [read_shard_header(source.prefix) for source in sources]
    indices = [CorpusIndex(header, seed, seq_length, index_dir) for header in headers]
    built_by_rank_zero(lambda: [path for index in indices for path in index.build(1)],
                       f"the sample index of {', '.join(s.prefix for s in sources)}", build_limit_minutes)
    for index in indices:
        index.check_token_range(vocab_size)
    count = sum(index.samples_per_epoch for index in indices)
    if not reads_data:
        return None, count
    return WholeCorpora([IndexedCorpus(index, isolate) for index in indices]), count
