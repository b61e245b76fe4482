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
"""

import bisect
import copy
import dataclasses
import hashlib
import json
import logging
import os
from functools import partial
from itertools import accumulate, chain
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import torch.distributed as dist
from datasets.fingerprint import Hasher

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label value the causal-LM loss skips (torch CrossEntropyLoss ignore_index)
FORMATS = ("pretokenized", "text", "instruction", "chat")
_FORMAT_FIELDS = {"pretokenized": ("input_ids",), "instruction": ("prompt", "response"), "chat": ("messages",)}
_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_MAP_BATCH_SIZE = 1000  # also the packing window for text: each batch's tail shorter than a block is dropped
_TOKEN_FEATURE = datasets.List(datasets.Value("int32"))
_PACKED_FEATURES = datasets.Features({"input_ids": _TOKEN_FEATURE, "labels": _TOKEN_FEATURE, "lengths": _TOKEN_FEATURE})


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
    dropped_tokens: int = 0  # text: tokens of each packing window's tail that fill no whole block
    packed_from: int = 0  # data.packing: examples packed into the `examples` rows (0: packing off)
    real_tokens: int = 0  # tokens in the rows, padding excluded
    from_cache: bool = False


@dataclasses.dataclass(frozen=True)
class _Settings:
    format: str
    text_field: str
    prompt_field: str
    response_field: str
    messages_field: str
    chat_template: str | None
    overlong: str
    bad_lines: str
    packing: bool
    document_isolation: bool
    num_proc: int

    @classmethod
    def from_cfg(cls, data_cfg: Any) -> "_Settings":
        get = data_cfg.get  # dict and OmegaConf DictConfig alike
        settings = cls(
            format=get("format", "text"),
            text_field=get("text_field", "text"),
            prompt_field=get("prompt_field", "prompt"),
            response_field=get("response_field", "response"),
            messages_field=get("messages_field", "messages"),
            chat_template=get("chat_template", None),
            overlong=get("overlong", "truncate"),
            bad_lines=get("bad_lines", "error"),
            packing=bool(get("packing", False)),
            document_isolation=bool(get("document_isolation", False)),
            num_proc=int(get("num_proc", 1) or 1),
        )
        choices = {"format": FORMATS, "overlong": ("truncate", "split"), "bad_lines": ("error", "skip")}
        for name, allowed in choices.items():
            if getattr(settings, name) not in allowed:
                raise ValueError(f"data.{name}={getattr(settings, name)!r}: expected one of {', '.join(allowed)}")
        return settings

    def required_fields(self) -> dict[str, type]:
        """Field → JSON type each record must hold for this format."""
        if self.format == "pretokenized":
            return {"input_ids": list}
        if self.format == "instruction":
            return {self.prompt_field: str, self.response_field: str}
        if self.format == "chat":
            return {self.messages_field: list}
        return {self.text_field: str}

    def format_hint(self, fields) -> str:
        """For records lacking this format's fields: the format whose fields they hold, as advice (or "")."""
        for name, wanted in _FORMAT_FIELDS.items():
            if name != self.format and all(field in fields for field in wanted):
                return f"; they hold {', '.join(repr(f) for f in wanted)}: set data.format={name} to read them"
        return ""


def build_dataset(
    path: str | os.PathLike,
    tokenizer,
    data_cfg: Any,
    seq_length: int,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> tuple[datasets.Dataset, BuildStats]:
    """Tokenize a local file into rows of at most `seq_length` tokens; returns `(dataset, stats)`.

    `path`: .jsonl / .json (JSON lines, or one JSON array), .parquet or .txt (one document per line, format text).
    `data_cfg`: dict-like with `format` (pretokenized | text | instruction | chat), `text_field`, `prompt_field`,
    `response_field`, `messages_field`, `chat_template` (a Jinja file replacing the tokenizer's template),
    `overlong` (truncate | split), `bad_lines` (error | skip), `packing`, `document_isolation`, `num_proc`.
    `vocab_size`: the exclusive upper bound for token ids; defaults to `len(tokenizer)`. Pass the model's vocabulary
    size when it is larger than the tokenizer's (padded embeddings). Every id is checked before anything trains.
    `cache_dir`: where the tokenized Arrow files go; defaults to a folder in the Hugging Face datasets cache.

    The dataset has int columns `input_ids` and `labels` (-100 where no loss is taken), plus `lengths` (the
    documents of each row) with packing or text document isolation, and stays memory-mapped.
    Raises ValueError for malformed JSON lines or chat examples (bad_lines=error: file and 1-based line number),
    token ids outside the vocabulary (file, example index, id) and an empty result (file and why).
    """
    path = Path(path).resolve()
    settings = _Settings.from_cfg(data_cfg)
    if settings.format == "chat":
        tokenizer = _with_chat_template(tokenizer, settings.chat_template)
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    cache_dir = Path(cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "pipeline_tokenized")
    cache_dir.mkdir(parents=True, exist_ok=True)

    records_key = _cache_key(
        _source_identity(path),
        dataclasses.asdict(settings) | dict.fromkeys(("overlong", "num_proc", "packing", "document_isolation")),
        vocab_size, None if settings.format == "pretokenized" else Hasher.hash(tokenizer),
    )
    examples_key = _cache_key(records_key, seq_length, settings.overlong, settings.num_proc, settings.packing,
                              settings.document_isolation)
    stem = f"{path.stem}-{settings.format}"
    manifest = cache_dir / f"{stem}-L{seq_length}-{examples_key}.json"
    if manifest.exists():
        return _load_cached(manifest)

    stats = BuildStats(source=str(path), format=settings.format, seq_length=seq_length)
    raw = _load_raw(path, settings, cache_dir, stats, tokenizer)
    records = _tokenize_records(raw, tokenizer, settings, cache_dir / f"{stem}-records-{records_key}.arrow", path)
    _check_token_ids(records, vocab_size, path)
    examples = _cut_records(records, settings, seq_length, cache_dir / f"{stem}-L{seq_length}-{examples_key}.arrow")
    _count(records, examples, settings, seq_length, stats)
    if stats.examples == 0:
        raise _no_examples(path, _why_empty(stats, settings))
    if settings.packing and settings.format != "text":
        stats.packed_from = examples.num_rows
        examples = _cached_map(examples, partial(_pack_examples, seq_length=seq_length), _PACKED_FEATURES,
                               settings.num_proc, cache_dir / f"{stem}-L{seq_length}-{examples_key}-packed.arrow",
                               f"packing into rows of {seq_length}")
        stats.examples = examples.num_rows
    stats.real_tokens = _sum(pc.list_value_length(examples.data.column("input_ids")))
    _log_stats(stats)
    _write_manifest(manifest, examples, stats)
    return examples, stats


def build_dataset_distributed(*args, **kwargs) -> tuple[datasets.Dataset, BuildStats]:
    """`build_dataset`, run by local rank 0 of each node first while the node's other ranks wait, then load its cache.

    Without an initialized torch.distributed process group this is plain `build_dataset`. If local rank 0 fails it
    still releases the barrier, so the other ranks rebuild and fail with the same message instead of hanging.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return build_dataset(*args, **kwargs)
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        try:
            return build_dataset(*args, **kwargs)
        finally:
            dist.barrier()
    dist.barrier()
    return build_dataset(*args, **kwargs)


# --- cache ---------------------------------------------------------------------------------------------------------

def _source_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


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
    # Write-then-rename: a rank that sees the manifest always sees a complete one, even if two nodes build at once.
    partial_file = manifest.with_suffix(f".{os.getpid()}.tmp")
    partial_file.write_text(json.dumps(content, indent=1))
    os.replace(partial_file, manifest)


# --- reading the source ----------------------------------------------------------------------------------------------

def _load_raw(path: Path, settings: _Settings, cache_dir: Path, stats: BuildStats, tokenizer) -> datasets.Dataset:
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {', '.join(_LOADERS)}")
    if loader == "text" and settings.format != "text":
        raise ValueError(f"{path}: a .txt file holds plain text; it needs data.format=text, not {settings.format}")
    if path.stat().st_size == 0:
        raise _no_examples(path, "the file is empty")
    source = path
    if loader == "json" and not _is_json_array(path):
        check = partial(_chat_problem, tokenizer=tokenizer, field=settings.messages_field) \
            if settings.format == "chat" else None
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
        raise ValueError(f"{path}: records lack field(s) {missing} of data.format={settings.format}"
                         f"{settings.format_hint(raw.column_names) or f'; they have {raw.column_names}'}")
    stats.records = raw.num_rows
    return raw


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _scan_json_lines(path: Path, settings: _Settings, check=None) -> tuple[int, list[int]]:
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
                raise ValueError(f"{path}: line {line_number} {problem}")
            if problem is None:
                good += 1
                continue
            if settings.bad_lines == "error":
                raise ValueError(f"{path}: line {line_number}: {problem}; fix it or set data.bad_lines=skip")
            bad.append(line_number)
    return good, bad


def _json_line_problem(line: bytes, settings: _Settings, check) -> str | None:
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
            return f"malformed JSON line (field {field!r} missing or not a {kind.__name__})"
    return check(record) if check else None


_WRONG_FORMAT = "lacks"


def _copy_without_lines(path: Path, skip: set[int], out: Path) -> Path:
    with path.open("rb") as src, out.open("wb") as dst:
        dst.writelines(line for number, line in enumerate(src, start=1) if number not in skip)
    return out


# --- pass 1: records → full token sequences --------------------------------------------------------------------------

def _tokenize_records(raw: datasets.Dataset, tokenizer, settings: _Settings, cache_file: Path,
                      path: Path) -> datasets.Dataset:
    if settings.format == "pretokenized":
        return raw  # already ids; pass 2 reads them straight from the source's Arrow table
    if settings.format == "chat":
        function = partial(_tokenize_chats, tokenizer=tokenizer, field=settings.messages_field, path=path)
        features = datasets.Features({"input_ids": _TOKEN_FEATURE, "labels": _TOKEN_FEATURE,
                                      "turn_ends": _TOKEN_FEATURE})
        return _cached_map(raw, function, features, settings.num_proc, cache_file, "rendering chats", indices=True)
    if settings.format == "text":
        text_field = settings.text_field if settings.text_field in raw.column_names else "text"
        function = partial(_tokenize_documents, tokenizer=tokenizer, text_field=text_field)
        features = datasets.Features({"input_ids": _TOKEN_FEATURE})
    else:
        function = partial(_tokenize_instructions, tokenizer=tokenizer,
                           prompt_field=settings.prompt_field, response_field=settings.response_field)
        features = datasets.Features({"input_ids": _TOKEN_FEATURE, "labels": _TOKEN_FEATURE})
    return _cached_map(raw, function, features, settings.num_proc, cache_file, "tokenizing")


def _special_ids(tokenizer) -> tuple[list[int], list[int]]:
    as_list = lambda token_id: [] if token_id is None else [token_id]  # noqa: E731
    return as_list(tokenizer.bos_token_id), as_list(tokenizer.eos_token_id)


def _tokenize_documents(batch, *, tokenizer, text_field: str) -> dict:
    """Each document → bos + tokens + eos; empty documents (blank lines) → no tokens."""
    bos, eos = _special_ids(tokenizer)
    documents = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
    return {"input_ids": [bos + ids + eos if ids else [] for ids in documents]}


def _tokenize_instructions(batch, *, tokenizer, prompt_field: str, response_field: str) -> dict:
    """bos + prompt (labels -100) followed by response + eos (labels = ids): the loss covers the response only."""
    bos, eos = _special_ids(tokenizer)
    prompts = tokenizer(batch[prompt_field], add_special_tokens=False)["input_ids"]
    responses = tokenizer(batch[response_field], add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for prompt, response in zip(prompts, responses):
        prompt, response = bos + prompt, response + eos
        input_ids.append(prompt + response)
        labels.append([IGNORE_INDEX] * len(prompt) + response)
    return {"input_ids": input_ids, "labels": labels}


def _with_chat_template(tokenizer, template_file: str | None):
    """The tokenizer with `template_file`'s Jinja template (a copy: the caller's is left alone), or the tokenizer
    itself when it ships a template; an error naming data.chat_template when neither has one."""
    if template_file:
        if not Path(template_file).is_file():
            raise ValueError(f"data.chat_template '{template_file}' does not exist; give the path of a Jinja file")
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = Path(template_file).read_text()
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"data.format=chat: the tokenizer ({getattr(tokenizer, 'name_or_path', '') or 'given'}) has "
                         "no chat template (an instruct checkpoint ships one in tokenizer_config.json or "
                         "chat_template.jinja, which convert2ckpt.py copies); supply one from a Jinja file with "
                         "data.chat_template=PATH")
    return tokenizer


def _chat_problem(record: dict, *, tokenizer, field: str) -> str | None:
    """Why a chat record cannot train (or None): no messages, a malformed message, no assistant turn to learn,
    an assistant turn first (nothing to condition it on), or a template that refuses the conversation."""
    messages = record[field]
    if not messages:
        return f"bad chat example (empty {field!r} list)"
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return f"bad chat example (message {index} is not a {{'role': str, 'content': str}} object)"
    roles = [message["role"] for message in messages]
    if "assistant" not in roles:
        return "bad chat example (no assistant turn: nothing to train on)"
    if roles[0] == "assistant":
        return "bad chat example (it starts with an assistant turn: no prompt before it)"
    try:
        tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as error:  # jinja2's TemplateError from the template's raise_exception, or a broken template
        return f"bad chat example (the chat template rejects it: {error})"
    return None


def _tokenize_chats(batch, indices, *, tokenizer, field: str, path: Path) -> dict:
    """Each conversation rendered with the tokenizer's chat template; labels only on what assistant turns add.

    Assistant turn i adds the tokens of render(messages[:i+1]) beyond render(messages[:i], add_generation_prompt):
    its content and the template's end-of-turn marker, not its header. Both renders must be token prefixes of the
    whole conversation's tokens (checked: a template that rewrites earlier turns cannot be trained this way).
    `turn_ends`: the token offset where each assistant turn ends, where overlong=split may cut.
    """
    input_ids, labels, turn_ends = [], [], []
    for index, messages in zip(indices, batch[field]):
        problem = _chat_problem({field: messages}, tokenizer=tokenizer, field=field)
        if problem:
            raise ValueError(f"{path}: example {index}: {problem}; fix it (a JSON-lines file can also skip it with "
                             "data.bad_lines=skip)")
        turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        texts = [tokenizer.apply_chat_template(messages, tokenize=False)]
        for i in turns:
            texts += [tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True),
                      tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)]
        full, *prefixes = tokenizer(texts, add_special_tokens=False)["input_ids"]
        targets, ends = [IGNORE_INDEX] * len(full), []
        for i, prompt, upto in zip(turns, prefixes[0::2], prefixes[1::2]):
            if full[:len(upto)] != upto or upto[:len(prompt)] != prompt:
                raise ValueError(
                    f"{path}: example {index}: the chat template's render of the conversation up to message {i} "
                    "is not a token prefix of the whole conversation's, so the assistant's tokens cannot be "
                    "located (templates that rewrite earlier turns, e.g. drop past reasoning, do this); supply a "
                    "template without it with data.chat_template=PATH")
            targets[len(prompt):len(upto)] = full[len(prompt):len(upto)]
            ends.append(len(upto))
        input_ids.append(full)
        labels.append(targets)
        turn_ends.append(ends)
    return {"input_ids": input_ids, "labels": labels, "turn_ends": turn_ends}


def _check_token_ids(records: datasets.Dataset, vocab_size: int, path: Path) -> None:
    """Every id in [0, vocab_size), checked column-wise in Arrow; on failure name the first offending example."""
    column = records.data.column("input_ids")
    if not (pa.types.is_list(column.type) and pa.types.is_integer(column.type.value_type)):
        raise ValueError(f"{path}: input_ids must be lists of integers, found {column.type}")
    ids = pc.list_flatten(column)
    if len(ids) == 0:
        return
    bounds = pc.min_max(ids)
    if bounds["min"].as_py() >= 0 and bounds["max"].as_py() < vocab_size:
        return
    first_bad = pc.index(pc.or_(pc.less(ids, 0), pc.greater_equal(ids, vocab_size)), True).as_py()
    example = pc.list_parent_indices(column)[first_bad].as_py()
    raise ValueError(f"{path}: example {example} holds token id {ids[first_bad].as_py()}, "
                     f"outside the vocabulary [0, {vocab_size})")


# --- pass 2: token sequences → training rows of at most seq_length -----------------------------------------------

def _cut_records(records: datasets.Dataset, settings: _Settings, seq_length: int, cache_file: Path) -> datasets.Dataset:
    features = datasets.Features({"input_ids": _TOKEN_FEATURE, "labels": _TOKEN_FEATURE})
    if settings.format == "text":
        function = partial(_pack_blocks, seq_length=seq_length, isolate=settings.document_isolation)
        features = _PACKED_FEATURES if settings.document_isolation else features
    else:
        function = partial(_cut_sequences, seq_length=seq_length, split=settings.overlong == "split")
    return _cached_map(records, function, features, settings.num_proc, cache_file, f"cutting to {seq_length}")


def _pack_blocks(batch, *, seq_length: int, isolate: bool) -> dict:
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


def _pack_examples(batch, *, seq_length: int) -> dict:
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


def _cut_sequences(batch, *, seq_length: int, split: bool) -> dict:
    """Truncate each sequence to seq_length, or split it into pieces of at most seq_length (chat: at the ends of
    assistant turns, `_turn_pieces`); keep pieces with a target.

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
            pieces = _turn_pieces(len(ids), turn_ends, seq_length)[0]
        for start, end in pieces:
            piece_labels = targets[start:end]
            if any(label != IGNORE_INDEX for label in piece_labels[1:]):
                input_ids.append(ids[start:end])
                labels.append(piece_labels)
    return {"input_ids": input_ids, "labels": labels}


def _turn_pieces(length: int, turn_ends: list[int], seq_length: int) -> tuple[list[tuple[int, int]], int]:
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

def _count(records: datasets.Dataset, examples: datasets.Dataset, settings: _Settings, seq_length: int,
           stats: BuildStats) -> None:
    """Fill the cut/drop counts from the record lengths, column-wise in Arrow (no second pass over the tokens)."""
    lengths = pc.list_value_length(records.data.column("input_ids"))
    stats.examples = examples.num_rows
    if settings.format == "text":
        stats.dropped_tokens = _sum(lengths) - examples.num_rows * seq_length
        return
    overlong = _sum(pc.greater(lengths, seq_length))
    if settings.overlong == "split" and settings.format == "chat":
        stats.split, pieces = overlong, 0
        for length, turn_ends in zip(lengths.to_pylist(), records.data.column("turn_ends").to_pylist()):
            cut, truncated = _turn_pieces(length, turn_ends, seq_length)
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


def _no_examples(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: no training examples after tokenization: {why}")


def _why_empty(stats: BuildStats, settings: _Settings) -> str:
    if stats.records == 0:
        return "the file holds no records"
    if settings.format == "text":
        return (f"its {stats.records} documents hold {stats.dropped_tokens} tokens, fewer than one block of "
                f"seq_length={stats.seq_length} in each packing window of {_MAP_BATCH_SIZE} documents")
    return (f"none of its {stats.records} records holds a token to predict within seq_length={stats.seq_length} "
            f"(empty sequences, or prompts that fill every position)")


def _log_stats(stats: BuildStats) -> None:
    lost = stats.bad_lines_skipped or stats.truncated or stats.dropped_no_target
    packed = f"packed from {stats.packed_from} examples, " if stats.packed_from else ""
    logger.log(logging.WARNING if lost else logging.INFO,
               "%s: %d records → %d rows of ≤%d tokens (%s%.1f%% of their tokens real; bad lines skipped %d, "
               "truncated %d, split %d, dropped without target %d, packing tail tokens dropped %d)",
               stats.source, stats.records, stats.examples, stats.seq_length, packed,
               100 * stats.real_tokens / max(1, stats.examples * stats.seq_length), stats.bad_lines_skipped,
               stats.truncated, stats.split, stats.dropped_no_target, stats.dropped_tokens)
