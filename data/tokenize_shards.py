"""Text files → Megatron-format token shards (PREFIX.bin + PREFIX.idx + PREFIX.json): what prepare_data.py runs.

Documents are streamed in batches through the tokenizer (this process, or a pool of spawned workers with at most
2 × workers batches in flight), each becoming bos + tokens + eos as the `text` format makes them
(data/formats.py). Each input is written to its own part under PREFIX.parts/, renamed into place only when whole;
the parts are merged by megatron-core's IndexedDatasetBuilder under temporary names, renamed, and PREFIX.json
(tokenizer, counts, inputs) is written last. A re-run keeps the finished parts and does nothing when PREFIX.json
already lists the same inputs and tokenizer; given inputs added to those, it tokenizes only the added ones when they
come after the prepared ones (all of them otherwise). Shards at PREFIX that it would lose documents of (another
tool's, or prepared from an input now missing or changed) it replaces only when told to (overwrite).
"""
import glob
import hashlib
import json
import os
import shutil
from collections import deque
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from checkpoints.files import TMP_SUFFIX, atomic_path, write_text_atomic
from data.formats import DataSettings, record_tokenizer
from data.shard_files import (METADATA_SUFFIX, ShardError, megatron_datasets, read_metadata, read_shard_header,
                              tokenizer_fingerprint, vouched_by_metadata)

READERS = (".jsonl", ".json", ".parquet", ".txt")


class PrepareError(ValueError):
    """Inputs or a tokenizer that cannot be prepared; the message names the file and what to do."""

_worker_tokenize = None


def prepare_shards(patterns, tokenizer_name_or_path, output_prefix, *, workers=1, text_field="text",
                   batch_size=1000, overwrite=False):
    """Tokenize the inputs `patterns` name into PREFIX.bin/.idx/.json; returns PREFIX.json's content. Shards already
    at PREFIX are extended when these inputs add to those PREFIX.json records, replaced otherwise only with
    overwrite."""
    inputs = expand_inputs(patterns)
    if workers < 1 or batch_size < 1:
        raise PrepareError(f"--workers={workers} and --batch_size={batch_size} must be at least 1")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name_or_path)
    if tokenizer.eos_token_id is None:
        raise PrepareError(f"{tokenizer_name_or_path}: the tokenizer has no eos token to end each document with")
    identity = {"tokenizer": {"name_or_path": str(tokenizer_name_or_path), "vocab_size": len(tokenizer),
                              "fingerprint": tokenizer_fingerprint(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                              "eos_token_id": tokenizer.eos_token_id},
                "text_field": text_field, "inputs": [file_identity(path) for path in inputs]}
    prefix = Path(output_prefix)
    parts_dir = prefix.with_name(prefix.name + ".parts")
    prepared = prepared_inputs(prefix, identity)
    if prepared == identity["inputs"]:
        return read_metadata(prefix)
    if not overwrite:
        refuse_to_lose_documents(prefix, parts_dir, prepared, identity["inputs"])
    # inputs added after those prepared: the shards at PREFIX are the first part, only the added ones are tokenized
    reused = prepared if prepared and identity["inputs"][:len(prepared)] == prepared else []
    dtype = megatron_datasets()[0].DType.optimal_dtype(len(tokenizer))
    parts_dir.mkdir(parents=True, exist_ok=True)
    for leftover in [*parts_dir.glob(f".*{TMP_SUFFIX}"), *prefix.parent.glob(f".{prefix.name}.*{TMP_SUFFIX}")]:
        leftover.unlink()  # what an interrupted run was writing
    parts = [prefix] if reused else []
    with TokenizingPool(workers, tokenizer_name_or_path, text_field) as tokenize_batches:
        for number, path in enumerate(inputs[len(reused):], start=len(reused)):
            part = parts_dir / f"{number:05d}-{part_key(identity, path)}"
            if not shards_exist(part):
                write_part(path, part, dtype, text_field, batch_size, tokenize_batches)
            parts.append(part)
    summary = merge_parts(parts, prefix, dtype, identity)
    shutil.rmtree(parts_dir)
    return summary


def expand_inputs(patterns):
    inputs = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) or ([pattern] if os.path.isfile(pattern) else [])
        if not matches:
            raise PrepareError(f"--input {pattern!r} matches no file")
        inputs += [m for m in matches if m not in inputs]
    unsupported = [path for path in inputs if Path(path).suffix.lower() not in READERS]
    if unsupported:
        raise PrepareError(f"{unsupported[0]}: unsupported file type; inputs are {', '.join(READERS)}")
    return inputs


def file_identity(path):
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def part_key(identity, path):
    content = json.dumps([identity["tokenizer"], identity["text_field"], file_identity(path)], sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def prepared_inputs(prefix, identity):
    """The inputs whose documents PREFIX.bin/.idx hold, in order, when PREFIX.json vouches for them (it counts their
    documents and tokens) and records this tokenizer and text field; None for shards it does not describe that way
    (Megatron's, another tokenizer's, damaged) or no shards."""
    try:
        vouched = vouched_by_metadata(read_shard_header(prefix))
    except ShardError:
        return None
    metadata = read_metadata(prefix)
    if not vouched or any(metadata.get(key) != identity[key] for key in ("tokenizer", "text_field")):
        return None
    return metadata["inputs"]


def refuse_to_lose_documents(prefix, parts_dir, prepared, inputs):
    """Shards at PREFIX are replaced without --overwrite only when these inputs hold all their documents again
    (inputs added), or when this tool's own merge was interrupted (PREFIX.parts/ left, PREFIX.json removed)."""
    existing = [path for path in (f"{prefix}.bin", f"{prefix}.idx") if os.path.exists(path)]
    metadata_file = f"{prefix}{METADATA_SUFFIX}"
    if not existing or (parts_dir.is_dir() and not os.path.exists(metadata_file)):
        return
    if prepared is None:
        raise PrepareError(f"{' and '.join(existing)} exist already, and {metadata_file} does not describe them as "
                           f"prepared here with this tokenizer and --text_field (another tool wrote them, or another "
                           f"tokenizer); pass --overwrite to replace them, or choose another --output_prefix")
    lost = [entry["path"] for entry in prepared if entry not in inputs]
    if lost:
        raise PrepareError(f"{prefix}.bin/.idx hold the documents of {lost[0]}, which is not among these inputs or "
                           f"has changed since it was prepared (size or mtime); pass --overwrite to prepare "
                           f"{prefix} from these inputs alone, or choose another --output_prefix")


def shards_exist(prefix):
    return all(os.path.isfile(f"{prefix}{suffix}") for suffix in (".bin", ".idx"))


# --- reading ---------------------------------------------------------------------------------------------------------

def read_batches(path, text_field, batch_size):
    """Batches of at most batch_size document texts from one input, streamed."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        source = pq.ParquetFile(path)
        if text_field not in source.schema_arrow.names:
            raise PrepareError(f"{path}: no column {text_field!r} (it has {source.schema_arrow.names}); "
                             f"set --text_field")
        for batch in source.iter_batches(batch_size=batch_size, columns=[text_field]):
            yield [text or "" for text in batch.column(0).to_pylist()]
        return
    batch = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if suffix == ".txt":
                batch.append(line.rstrip("\n"))
            elif line.strip():
                batch.append(json_text(line, text_field, path, line_number))
            if len(batch) == batch_size:
                yield batch
                batch = []
    if batch:
        yield batch


def json_text(line, text_field, path, line_number):
    try:
        record = json.loads(line)
    except ValueError as error:
        raise PrepareError(f"{path}: line {line_number} is not valid JSON ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise PrepareError(f"{path}: line {line_number} has no string field {text_field!r}; set --text_field")
    return record[text_field]


# --- tokenizing ------------------------------------------------------------------------------------------------------

def document_tokenizer(tokenizer_name_or_path, text_field):
    """texts → token lists, each bos + tokens + eos: the text format's own function (data/formats.py)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name_or_path)
    settings = DataSettings.from_cfg({"format": "text", "text_field": text_field})
    function = record_tokenizer(settings, tokenizer, [text_field], Path(tokenizer_name_or_path))[0]
    return lambda texts: function({text_field: texts})["input_ids"]


def _init_worker(tokenizer_name_or_path, text_field, threads):
    global _worker_tokenize
    if not threads:  # a fast tokenizer encodes a batch on every core; N workers on N cores take one each instead
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenize = document_tokenizer(tokenizer_name_or_path, text_field)


def _tokenize_in_worker(texts):
    return [np.asarray(ids, dtype=np.int32) for ids in _worker_tokenize(texts)]


class TokenizingPool:
    """A function mapping an iterator of text batches to their token lists in order: in this process for one
    worker, else in a process pool with at most 2 × workers batches in flight (bounded memory)."""

    def __init__(self, workers, tokenizer_name_or_path, text_field):
        self.workers, self.args = workers, (tokenizer_name_or_path, text_field)
        self.pool = None

    def __enter__(self):
        if self.workers == 1:
            _init_worker(*self.args, threads=True)
            return lambda batches: map(_tokenize_in_worker, batches)
        self.pool = get_context("spawn").Pool(self.workers, initializer=_init_worker, initargs=(*self.args, False))
        return self.ordered

    def ordered(self, batches):
        in_flight = deque()
        for batch in batches:
            in_flight.append(self.pool.apply_async(_tokenize_in_worker, (batch,)))
            if len(in_flight) >= 2 * self.workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


# --- writing ---------------------------------------------------------------------------------------------------------

def write_part(path, part, dtype, text_field, batch_size, tokenize_batches):
    """One input's documents → part.bin/.idx, renamed into place only when both are whole."""
    with atomic_path(f"{part}.idx") as idx_tmp, atomic_path(f"{part}.bin") as bin_tmp:  # the .idx renamed last
        builder = megatron_datasets()[0].IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        for documents in tokenize_batches(read_batches(path, text_field, batch_size)):
            for ids in documents:
                if len(ids):  # an empty document (blank line) has no tokens, not even bos/eos
                    builder.add_document(ids, [len(ids)])
        builder.finalize(idx_tmp)


def merge_parts(parts, prefix, dtype, identity):
    """The parts, in input order, → PREFIX.bin/.idx (megatron-core's builder concatenates them), then PREFIX.json."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    metadata_file = prefix.with_name(prefix.name + ".json")
    with atomic_path(f"{prefix}.idx") as idx_tmp, atomic_path(f"{prefix}.bin") as bin_tmp:
        builder = megatron_datasets()[0].IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        for part in parts:
            builder.add_index(str(part))
        builder.finalize(idx_tmp)
        documents = len(builder.document_indices) - 1
        if documents == 0:
            raise PrepareError(f"the inputs {[i['path'] for i in identity['inputs']]} hold no document with text")
        metadata_file.unlink(missing_ok=True)  # from here to its rewrite PREFIX.json does not vouch for the shards
    header = read_shard_header(prefix)
    summary = {**identity, "dtype": np.dtype(dtype).name, "documents": documents, "tokens": header.tokens}
    write_text_atomic(metadata_file, json.dumps(summary, indent=1))
    return summary
