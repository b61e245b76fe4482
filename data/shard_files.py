"""Megatron-format token shards on disk (`PREFIX.bin` + `PREFIX.idx`, and prepare_data.py's `PREFIX.json`), and the
corpora a config names: the files read and checked before anything starts (headers, metadata, tokenizer, weights).
What a run draws from them: data/indexed.py."""
import dataclasses
import hashlib
import json
import math
import os
import struct
import warnings
from pathlib import Path

import numpy as np

from errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron's .idx magic, then version 1 (<Q), dtype code (<B), 2 counts (<Q)
HEADER_BYTES = 34
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
TOKEN_DTYPES = (np.uint8, np.uint16, np.int32, np.int64)
METADATA_SUFFIX = ".json"  # PREFIX.json: what prepare_data.py records beside the shards (tokenizer, counts)
INDEX_VERSION = 2  # bump when the cached arrays' meaning changes


def megatron_datasets():
    """megatron-core's (indexed_dataset, helpers) modules. Imported on first use (its package import takes ~2-3 s)
    and quietly: the package warns that Transformer Engine and Apex are missing, which its dataset code never uses."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers, indexed_dataset
    return indexed_dataset, helpers


class ShardError(ConfigError):
    """Shards that cannot train; the message names the file and what to do."""


# --- the files -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """What PREFIX.idx says about its PREFIX.bin, read without megatron-core (an independent check of its reader)."""
    prefix: str
    dtype: type
    sequences: int  # Megatron's sequences; each is one document here, as in its GPTDataset
    tokens: int
    identity: str  # changes whenever the shards are rewritten: keys the cached indices


def read_shard_header(prefix) -> ShardHeader:
    """The header of PREFIX.idx, checked against PREFIX.bin: both present, the .idx whole, the .bin exactly as long
    as the .idx's last sequence ends, at least one token. Reads 34 bytes and the last pointer and length."""
    prefix = str(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ShardError(f"{path} does not exist: a corpus is a PREFIX naming PREFIX.bin and PREFIX.idx (write "
                             f"them with python prepare_data.py --output_prefix PREFIX ...)")
    idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != INDEX_HEADER or struct.unpack("<Q", head[9:17])[0] != 1:
        raise ShardError(f"{idx_path} is not a Megatron indexed-dataset index (version 1); prepare the corpus again")
    code, sequences, documents = struct.unpack("<B", head[17:18])[0], *struct.unpack("<QQ", head[18:34])
    expected = HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if code not in DTYPE_CODES or idx_size != expected:
        raise ShardError(f"{idx_path} is truncated or damaged ({idx_size} bytes, its header promises {expected}); "
                         f"prepare the corpus again")
    dtype = DTYPE_CODES[code]
    if sequences == 0:
        raise ShardError(f"{prefix}: the corpus is empty (no documents); check the inputs it was prepared from")
    index = np.memmap(idx_path, mode="r")
    last_length = int(index[HEADER_BYTES + 4 * (sequences - 1):][:4].view(np.int32)[0])
    pointers_at = HEADER_BYTES + 4 * sequences
    last_pointer = int(index[pointers_at + 8 * (sequences - 1):][:8].view(np.int64)[0])
    del index
    itemsize = np.dtype(dtype).itemsize
    indexed_bytes = last_pointer + last_length * itemsize
    if bin_size != indexed_bytes:
        raise ShardError(f"{bin_path} holds {bin_size} bytes but {idx_path} indexes {indexed_bytes}: the .bin is "
                         f"truncated or the .idx belongs to another .bin; prepare the corpus again")
    stat = os.stat(bin_path)
    identity = hashlib.sha256(f"{idx_size}:{os.stat(idx_path).st_mtime_ns}:{bin_size}:{stat.st_mtime_ns}:"
                              f"{INDEX_VERSION}".encode()).hexdigest()[:12]
    return ShardHeader(prefix, dtype, sequences, bin_size // itemsize, identity)


def read_metadata(prefix) -> dict:
    """PREFIX.json written by prepare_data.py ({} for shards made elsewhere, e.g. Megatron's preprocess_data.py)."""
    path = Path(str(prefix) + METADATA_SUFFIX)
    return json.loads(path.read_text()) if path.is_file() else {}


def vouched_by_metadata(header: ShardHeader) -> bool:
    """Whether prepare_data.py's PREFIX.json describes these very shards (their documents and tokens): then its
    tokenizer's vocabulary bounds every id in them, and no scan of the .bin need find the largest."""
    metadata = read_metadata(header.prefix)
    return (bool(metadata.get("tokenizer", {}).get("vocab_size")) and metadata.get("documents") == header.sequences
            and metadata.get("tokens") == header.tokens)


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what turns text into ids (the vocabulary and bos/eos): equal for the same tokenizer however it
    was loaded (slow or fast, from another directory)."""
    content = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.bos_token_id, tokenizer.eos_token_id])
    return hashlib.sha256(content.encode()).hexdigest()[:16]


# --- which corpora ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    prefix: str
    weight: float

    @property
    def name(self) -> str:
        return os.path.basename(self.prefix)


def parse_sources(value, key: str) -> list[Source]:
    """`train_file` / `eval_file` of data.format=indexed: one PREFIX, or a list of {path, weight} entries (weights
    positive numbers, normalised to sum 1), or a list of prefixes (equal weights: evaluation reads each whole)."""
    if isinstance(value, str):
        return [Source(value, 1.0)]
    entries = list(value or [])
    if not entries:
        raise ShardError(f"{key} is empty: name a shard PREFIX or a list of {{path: PREFIX, weight: W}} entries")
    sources = []
    for entry in entries:
        if isinstance(entry, str):
            path, weight = entry, 1.0
        else:
            entry = dict(entry)
            if set(entry) != {"path", "weight"}:
                raise ShardError(f"{key}: entry {entry} must be {{path: PREFIX, weight: W}}")
            path, weight = entry["path"], entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            raise ShardError(f"{key}: the weight of {path} is {weight!r}; every weight must be a positive number "
                             f"(drop a corpus from the list rather than give it weight 0)")
        sources.append(Source(str(path), float(weight)))
    prefixes = [s.prefix for s in sources]
    if len(set(prefixes)) != len(prefixes):
        raise ShardError(f"{key} names a corpus twice ({prefixes}); give each once with the sum of its weights")
    total = sum(s.weight for s in sources)
    return [dataclasses.replace(s, weight=s.weight / total) for s in sources]


def check_sources(sources, key: str, vocab_size: int, fingerprint: str | None, seq_length: int) -> list[ShardHeader]:
    """Each corpus's shards whole, written for this model's vocabulary and tokenizer (when its metadata says), and
    holding at least one sample; before anything is started. Returns the headers."""
    headers = []
    for source in sources:
        header = read_shard_header(source.prefix)
        metadata = read_metadata(source.prefix)
        recorded = metadata.get("tokenizer", {})
        if recorded.get("vocab_size") and recorded["vocab_size"] > vocab_size:
            raise ShardError(f"{source.prefix}: prepared with a vocabulary of {recorded['vocab_size']} tokens, more "
                             f"than the model's {vocab_size}; prepare it with the model's tokenizer")
        if fingerprint and recorded.get("fingerprint") and recorded["fingerprint"] != fingerprint:
            raise ShardError(f"{source.prefix}: prepared with tokenizer {recorded.get('name_or_path')!r} "
                             f"(fingerprint {recorded['fingerprint']}), which differs from this run's (fingerprint "
                             f"{fingerprint}); prepare it again with the run's tokenizer (python prepare_data.py "
                             f"--tokenizer_name_or_path ...), or set tokenizer_name_or_path to the one it was "
                             f"prepared with")
        if header.dtype not in TOKEN_DTYPES:
            raise ShardError(f"{source.prefix}.idx: its dtype {np.dtype(header.dtype).name} holds no token ids "
                             f"(expected one of {', '.join(np.dtype(t).name for t in TOKEN_DTYPES)})")
        if header.tokens < seq_length + 1:
            raise ShardError(f"{source.prefix}: {header.tokens} tokens, fewer than one sample of seq_length="
                             f"{seq_length} (+ 1, the last input's label); add data or lower seq_length ({key})")
        headers.append(header)
    return headers
