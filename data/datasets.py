"""Local training files → a tokenized, memory-mapped Hugging Face `Dataset` of `input_ids` / `labels` rows.

Building runs in cached `Dataset.map` passes, the pattern of transformers' `run_clm` example:
  1. records: one row per source record holding its full token sequence (`input_ids`, plus `labels` for
     instruction and chat data, and the assistant turns' ends for chat). It depends on the file and the tokenizer,
     not on `seq_length`, so changing the sequence length only re-runs the later passes.
  2. examples: rows of at most `seq_length` tokens: text is packed into blocks of exactly `seq_length`; pretokenized,
     instruction and chat records longer than that are truncated or split (`data.overlong`; chat at turn ends).
  3. with `data.packing`: examples packed into rows of at most `seq_length` tokens (best fit, no example split),
     each row listing its documents' `lengths` so that the collator isolates them (data/collator.py).
The cache files live in `cache_dir` under names derived from the source file's path, size and mtime, the tokenizer,
the data settings and `seq_length`. A JSON manifest written last lists them with the build statistics; when it exists
a call memory-maps the cached Arrow files directly and neither reads the source nor calls the tokenizer.
What each format turns a record into is data/formats.py's; cutting and packing rows, data/packing.py's.
"""

import dataclasses
import hashlib
import json
import logging
import os
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import torch.distributed as dist

from checkpoints.files import write_text_atomic
from cluster.shared_files import VISIBLE_WITHIN_S, built_by_rank_zero, wait_for_files
from errors import ConfigError

from .formats import (PREFERENCE_FIELDS, TOKEN_FEATURE, DataSettings, chat_problem, preference_problem,
                      record_tokenizer, with_chat_template)
from .packing import (PACKED_FEATURES, PAIR_ROW_FEATURES, cut_pairs, cut_sequences, pack_blocks, pack_examples,
                      turn_pieces)

logger = logging.getLogger(__name__)

_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_MAP_BATCH_SIZE = 1000  # also the packing window for text: each batch's tail shorter than a block is dropped


@dataclasses.dataclass
class BuildStats:
    """What `build_dataset` read, cut and dropped; returned beside the dataset and stored with the cache."""

    source: str
    format: str
    seq_length: int
    records: int = 0  # records read from the file (skipped bad lines excluded)
    examples: int = 0  # rows in the built dataset
    bad_lines_skipped: int = 0  # malformed JSON lines skipped (bad_lines=skip)
    truncated: int = 0  # records longer than seq_length cut to their first seq_length tokens (overlong=truncate)
    split: int = 0  # records longer than seq_length cut into several rows (overlong=split)
    dropped_no_target: int = 0  # records or split pieces dropped because no token in them has a label to predict
    dropped_pairs: int = 0  # preference: pairs whose responses are empty or the same after truncation (bad_lines=skip)
    dropped_tokens: int = 0  # text: tokens of each packing window's tail that fill no whole block
    packed_from: int = 0  # data.packing: examples packed into the `examples` rows (0: packing off)
    real_tokens: int = 0  # tokens in the rows, padding excluded
    from_cache: bool = False


def build_dataset(
    path: str | os.PathLike,
    tokenizer,
    data_cfg: Any,
    seq_length: int,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    cached_only: bool = False,
) -> tuple[datasets.Dataset, BuildStats]:
    """Tokenize a local file into rows of at most `seq_length` tokens; returns `(dataset, stats)`.

    `path`: .jsonl / .json (JSON lines, or one JSON array), .parquet or .txt (one document per line, format text).
    `data_cfg`: dict-like with `format` (pretokenized | text | instruction | chat), `text_field`, `prompt_field`,
    `response_field`, `messages_field`, `chat_template` (a Jinja file replacing the tokenizer's template),
    `overlong` (truncate | split), `bad_lines` (error | skip), `packing`, `document_isolation`, `num_proc`.
    `vocab_size`: the exclusive upper bound for token ids; defaults to `len(tokenizer)`. Pass the model's vocabulary
    size when it is larger than the tokenizer's (padded embeddings). Every id is checked before anything trains.
    `cache_dir`: where the tokenized Arrow files go; defaults to a folder in the Hugging Face datasets cache.
    `cached_only`: read the cache another rank built (waiting, bounded, for it to show on this node), never build.

    The dataset has int columns `input_ids` and `labels` (-100 where no loss is taken), plus `lengths` (the
    documents of each row) with packing or text document isolation, and stays memory-mapped.
    Raises ConfigError for malformed JSON lines or chat examples (bad_lines=error: file and 1-based line number),
    token ids outside the vocabulary (file, example index, id) and an empty result (file and why).
    """
    path = Path(path).resolve()
    settings = DataSettings.from_cfg(data_cfg)
    if settings.format == "chat" or (settings.format == "preference" and settings.chat_template):
        tokenizer = with_chat_template(tokenizer, settings.chat_template)
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    cache_dir = Path(cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "pipeline_tokenized")
    cache_dir.mkdir(parents=True, exist_ok=True)

    records_key = _cache_key(
        _source_identity(path),
        dataclasses.asdict(settings) | dict.fromkeys(("overlong", "num_proc", "packing", "document_isolation")),
        vocab_size, None if settings.format == "pretokenized" else tokenization_digest(tokenizer),
    )
    examples_key = _cache_key(records_key, seq_length, settings.overlong, settings.num_proc, settings.packing,
                              settings.document_isolation)
    stem = f"{path.stem}-{settings.format}"
    manifest = cache_dir / f"{stem}-L{seq_length}-{examples_key}.json"
    if cached_only:
        wait_for_files([manifest], VISIBLE_WITHIN_S)
    if manifest.exists():
        return _load_cached(manifest)

    stats = BuildStats(source=str(path), format=settings.format, seq_length=seq_length)
    raw = _load_raw(path, settings, cache_dir, stats, tokenizer)
    records = _tokenize_records(raw, tokenizer, settings, cache_dir / f"{stem}-records-{records_key}.arrow", path)
    _check_token_ids(records, vocab_size, path)
    examples = _cut_records(records, settings, seq_length, cache_dir / f"{stem}-L{seq_length}-{examples_key}.arrow",
                            path)
    _count(records, examples, settings, seq_length, stats)
    if stats.examples == 0:
        raise _no_examples(path, _why_empty(stats, settings))
    if settings.packing and settings.format != "text":
        stats.packed_from = examples.num_rows
        examples = _cached_map(examples, partial(pack_examples, seq_length=seq_length), PACKED_FEATURES,
                               settings.num_proc, cache_dir / f"{stem}-L{seq_length}-{examples_key}-packed.arrow",
                               f"packing into rows of {seq_length}")
        stats.examples = examples.num_rows
    stats.real_tokens = sum(_sum(pc.list_value_length(examples.data.column(name)))
                            for name in examples.column_names if name.endswith("input_ids"))
    _log_stats(stats)
    _write_manifest(manifest, examples, stats)
    return examples, stats


def build_dataset_distributed(*args, limit_minutes: float, **kwargs) -> tuple[datasets.Dataset, BuildStats]:
    """`build_dataset` on global rank 0 while the others wait for it outside any collective, at most limit_minutes
    (cluster/shared_files.py), then read its cache; rank 0's error is raised on every rank. Without an initialized
    torch.distributed process group this is plain `build_dataset`."""
    if not (dist.is_available() and dist.is_initialized()):
        return build_dataset(*args, **kwargs)
    built = []

    def build():
        built.append(build_dataset(*args, **kwargs))
        return []  # the others' build_dataset(cached_only=True) waits for the manifest to show

    built_by_rank_zero(build, f"the tokenized cache of {args[0]}", limit_minutes)
    return built[0] if built else build_dataset(*args, **kwargs, cached_only=True)


# --- cache ---------------------------------------------------------------------------------------------------------

def _source_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def tokenization_digest(tokenizer) -> str:
    """What turns text into ids, read as content, so that every process and node computes the same key: a fast
    tokenizer's pipeline (less the truncation and padding a call leaves behind), or a slow one's vocabulary file,
    and the special tokens, bos/eos flags and chat template. (A pickle of the object, datasets' Hasher, differed
    between a forked and a fresh process.)"""
    if tokenizer.is_fast:
        pipeline = json.loads(tokenizer.backend_tokenizer.to_str())
        pipeline.pop("truncation", None)
        pipeline.pop("padding", None)
    else:
        pipeline = hashlib.sha256(Path(tokenizer.vocab_file).read_bytes()).hexdigest()
    flags = {name: getattr(tokenizer, name, None) for name in ("add_bos_token", "add_eos_token")}
    return _cache_key(type(tokenizer).__name__, pipeline, tokenizer.special_tokens_map, flags,
                      tokenizer.chat_template)


def _cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _load_cached(manifest: Path) -> tuple[datasets.Dataset, BuildStats]:
    content = json.loads(manifest.read_text())
    parts = [datasets.Dataset.from_file(name) for name in content["cache_files"]]
    stats = BuildStats(**content["stats"] | {"from_cache": True})
    logger.info("%s: loaded %d cached examples from %s", stats.source, stats.examples, manifest.parent)
    return (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)), stats


def _write_manifest(manifest: Path, examples: datasets.Dataset, stats: BuildStats) -> None:
    content = {"cache_files": [f["filename"] for f in examples.cache_files], "stats": dataclasses.asdict(stats)}
    write_text_atomic(manifest, json.dumps(content, indent=1))  # a rank that sees the manifest sees all of it


# --- reading the source ----------------------------------------------------------------------------------------------

def _load_raw(path: Path, settings: DataSettings, cache_dir: Path, stats: BuildStats, tokenizer) -> datasets.Dataset:
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ConfigError(f"{path}: unsupported file type {path.suffix!r}; expected one of {', '.join(_LOADERS)}")
    if loader == "text" and settings.format != "text":
        raise ConfigError(f"{path}: a .txt file holds plain text; it needs data.format=text, not {settings.format}")
    if path.stat().st_size == 0:
        raise _no_examples(path, "the file is empty")
    source = path
    if loader == "json" and not _is_json_array(path):
        check = {"chat": partial(chat_problem, tokenizer=tokenizer, field=settings.messages_field),
                 "preference": preference_problem}.get(settings.format)
        good, bad = _scan_json_lines(path, settings, check)
        if good == 0:
            raise _no_examples(path, f"no well-formed records ({len(bad)} malformed lines skipped)")
        if bad:
            stats.bad_lines_skipped = len(bad)
            logger.warning("%s: skipped %d malformed JSON lines or bad examples (first: %s)", path, len(bad), bad[:5])
            # The datasets json reader cannot skip lines, so it reads a copy without them.
            source = _copy_without_lines(path, set(bad), cache_dir / f"{path.stem}.{os.getpid()}.clean.jsonl")
    try:
        raw = datasets.load_dataset(loader, data_files=str(source), split="train", cache_dir=str(cache_dir / "raw"))
    finally:
        if source != path:
            source.unlink()
    missing = [] if loader == "text" else [f for f in settings.required_fields() if f not in raw.column_names]
    if missing:
        raise ConfigError(f"{path}: records lack field(s) {missing} of data.format={settings.format}"
                          f"{settings.format_hint(raw.column_names) or f'; they have {raw.column_names}'}")
    stats.records = raw.num_rows
    return raw


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _scan_json_lines(path: Path, settings: DataSettings, check=None) -> tuple[int, list[int]]:
    """(well-formed record count, 1-based numbers of bad lines); with bad_lines=error raise at the first bad line.
    A line is bad when it is not a JSON object with the format's fields, or when `check(record)` names a problem.
    Streams the file: one line in memory at a time."""
    good, bad = 0, []
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines are layout, not records
            problem = _json_line_problem(line, settings, check)
            if problem and problem.startswith(_WRONG_FORMAT):  # the whole file is another format: skipping is no fix
                raise ConfigError(f"{path}: line {line_number} {problem}")
            if problem is None:
                good += 1
                continue
            if settings.bad_lines == "error":
                raise ConfigError(f"{path}: line {line_number}: {problem}; fix it or set data.bad_lines=skip")
            bad.append(line_number)
    return good, bad


def _json_line_problem(line: bytes, settings: DataSettings, check) -> str | None:
    try:
        record = json.loads(line)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        return f"malformed JSON line (not valid JSON: {error})"
    if not isinstance(record, dict):
        return "malformed JSON line (not a JSON object)"
    for field, kind in settings.required_fields().items():
        if not isinstance(record.get(field), kind):
            hint = settings.format_hint(record)
            if hint and field not in record:
                return f"{_WRONG_FORMAT} {field!r}, the field data.format={settings.format} reads{hint}"
            kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            return f"malformed JSON line (field {field!r} missing or not a {kinds})"
    return check(record) if check else None


_WRONG_FORMAT = "lacks"


def _copy_without_lines(path: Path, skip: set[int], out: Path) -> Path:
    with path.open("rb") as src, out.open("wb") as dst:
        dst.writelines(line for number, line in enumerate(src, start=1) if number not in skip)
    return out


# --- pass 1: records → full token sequences --------------------------------------------------------------------------

def _tokenize_records(raw: datasets.Dataset, tokenizer, settings: DataSettings, cache_file: Path,
                      path: Path) -> datasets.Dataset:
    tokenize = record_tokenizer(settings, tokenizer, raw.column_names, path)
    if tokenize is None:
        return raw  # already ids; pass 2 reads them straight from the source's Arrow table
    function, features, desc, indices = tokenize
    return _cached_map(raw, function, features, settings.num_proc, cache_file, desc, indices=indices)


def _check_token_ids(records: datasets.Dataset, vocab_size: int, path: Path) -> None:
    """Every id in [0, vocab_size), checked column-wise in Arrow; on failure name the first offending example."""
    names = [f"{part}_ids" for part in PREFERENCE_FIELDS] if "chosen_ids" in records.column_names else ["input_ids"]
    for name in names:
        _check_column_ids(records.data.column(name), vocab_size, path)


def _check_column_ids(column, vocab_size: int, path: Path) -> None:
    if not (pa.types.is_list(column.type) and pa.types.is_integer(column.type.value_type)):
        raise ConfigError(f"{path}: input_ids must be lists of integers, found {column.type}")
    ids = pc.list_flatten(column)
    if len(ids) == 0:
        return
    bounds = pc.min_max(ids)
    if bounds["min"].as_py() >= 0 and bounds["max"].as_py() < vocab_size:
        return
    first_bad = pc.index(pc.or_(pc.less(ids, 0), pc.greater_equal(ids, vocab_size)), True).as_py()
    example = pc.list_parent_indices(column)[first_bad].as_py()
    raise ConfigError(f"{path}: example {example} holds token id {ids[first_bad].as_py()}, "
                      f"outside the vocabulary [0, {vocab_size})")


# --- pass 2: token sequences → training rows of at most seq_length -----------------------------------------------

def _cut_records(records: datasets.Dataset, settings: DataSettings, seq_length: int, cache_file: Path,
                 path: Path) -> datasets.Dataset:
    features = datasets.Features({"input_ids": TOKEN_FEATURE, "labels": TOKEN_FEATURE})
    if settings.format == "preference":
        function = partial(cut_pairs, seq_length=seq_length, skip=settings.bad_lines == "skip", path=path)
        return _cached_map(records, function, PAIR_ROW_FEATURES, settings.num_proc, cache_file,
                           f"cutting pairs to {seq_length}", indices=True)
    if settings.format == "text":
        function = partial(pack_blocks, seq_length=seq_length, isolate=settings.document_isolation)
        features = PACKED_FEATURES if settings.document_isolation else features
    else:
        function = partial(cut_sequences, seq_length=seq_length, split=settings.overlong == "split")
    return _cached_map(records, function, features, settings.num_proc, cache_file, f"cutting to {seq_length}")


def _cached_map(dataset, function, features, num_proc: int, cache_file: Path, desc: str,
                indices: bool = False) -> datasets.Dataset:
    return dataset.map(
        function, batched=True, batch_size=_MAP_BATCH_SIZE, remove_columns=dataset.column_names, features=features,
        with_indices=indices,
        num_proc=num_proc if num_proc > 1 else None, cache_file_name=str(cache_file),
        new_fingerprint=cache_file.stem,  # the file name already keys everything the result depends on
        desc=desc,
    )


# --- statistics ------------------------------------------------------------------------------------------------------

def _count(records: datasets.Dataset, examples: datasets.Dataset, settings: DataSettings, seq_length: int,
           stats: BuildStats) -> None:
    """Fill the cut/drop counts from the record lengths, column-wise in Arrow (no second pass over the tokens)."""
    stats.examples = examples.num_rows
    if settings.format == "preference":
        prompt = pc.list_value_length(records.data.column("prompt_ids"))
        longest = pc.max_element_wise(*(pc.list_value_length(records.data.column(f"{side}_ids"))
                                        for side in ("chosen", "rejected")))
        stats.truncated = _sum(pc.greater(pc.add(prompt, longest), seq_length))
        stats.dropped_pairs = records.num_rows - examples.num_rows
        return
    lengths = pc.list_value_length(records.data.column("input_ids"))
    if settings.format == "text":
        stats.dropped_tokens = _sum(lengths) - examples.num_rows * seq_length
        return
    overlong = _sum(pc.greater(lengths, seq_length))
    if settings.overlong == "split" and settings.format == "chat":
        stats.split, pieces = overlong, 0
        for length, turn_ends in zip(lengths.to_pylist(), records.data.column("turn_ends").to_pylist()):
            cut, truncated = turn_pieces(length, turn_ends, seq_length)
            pieces, stats.truncated = pieces + len(cut), stats.truncated + truncated
    elif settings.overlong == "split":
        stats.split = overlong
        pieces = _sum(pc.max_element_wise(pc.divide(pc.add(lengths, seq_length - 1), seq_length), 1))
    else:
        stats.truncated = overlong
        pieces = records.num_rows
    stats.dropped_no_target = pieces - examples.num_rows


def _sum(values) -> int:
    return pc.sum(values).as_py() or 0  # Arrow's sum of nothing is null


def _no_examples(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path}: no training examples after tokenization: {why}")


def _why_empty(stats: BuildStats, settings: DataSettings) -> str:
    if stats.records == 0:
        return "the file holds no records"
    if settings.format == "text":
        return (f"its {stats.records} documents hold {stats.dropped_tokens} tokens, fewer than one block of "
                f"seq_length={stats.seq_length} in each packing window of {_MAP_BATCH_SIZE} documents")
    return (f"none of its {stats.records} records holds a token to predict within seq_length={stats.seq_length} "
            f"(empty sequences, or prompts that fill every position)")


def _log_stats(stats: BuildStats) -> None:
    lost = stats.bad_lines_skipped or stats.truncated or stats.dropped_no_target or stats.dropped_pairs
    packed = f"packed from {stats.packed_from} examples, " if stats.packed_from else ""
    if stats.format == "preference":
        logger.log(logging.WARNING if lost else logging.INFO,
                   "%s: %d records → %d pairs of ≤%d tokens per response (bad lines skipped %d, pairs truncated %d "
                   "(TRL's keep_start: prompt + response cut to seq_length), pairs dropped with an empty or the same "
                   "response after truncation %d)", stats.source, stats.records, stats.examples, stats.seq_length,
                   stats.bad_lines_skipped, stats.truncated, stats.dropped_pairs)
        return
    logger.log(logging.WARNING if lost else logging.INFO,
               "%s: %d records → %d rows of ≤%d tokens (%s%.1f%% of their tokens real; bad lines skipped %d, "
               "truncated %d, split %d, dropped without target %d, packing tail tokens dropped %d)",
               stats.source, stats.records, stats.examples, stats.seq_length, packed,
               100 * stats.real_tokens / max(1, stats.examples * stats.seq_length), stats.bad_lines_skipped,
               stats.truncated, stats.split, stats.dropped_no_target, stats.dropped_tokens)
