"""The data files a run names, checked from its config before anything is built: they exist, and token shards were
written for the run's model and tokenizer, with an index that can be built where it goes. Each failure is a
ConfigError naming the key and the file."""
import os

from transformers import AutoTokenizer

from data.indexed import CorpusIndex
from data.shard_files import ShardError, check_sources, parse_sources, read_shard_header, tokenizer_fingerprint
from errors import ConfigError


def check_data_files(cfg):
    """The data files a run reads exist (token shards: each corpus's header reads), before any model or process
    is touched: a missing file is named here, not after a tokenization or a start-up on every rank."""
    if cfg.eval_only:
        if not cfg.eval_file and not cfg.eval_tasks:
            raise ConfigError("eval_only=true needs eval_file or eval_tasks.")
    elif not cfg.train_file:
        raise ConfigError("train_file is not set; pass train_file=PATH (jsonl, json, parquet or txt; with "
                          "data.format=indexed a shard PREFIX or a list of {path: PREFIX, weight: W}).")
    for key in ("train_file", "eval_file"):
        path = cfg[key]
        if not path or (key == "train_file" and cfg.eval_only):
            continue
        if cfg.data.format == "indexed":
            try:
                for source in parse_sources(path, key):
                    read_shard_header(source.prefix)
            except ShardError as error:
                raise ConfigError(f"{key}: {error}") from None
        elif not isinstance(path, str):
            raise ConfigError(f"{key} is a list; only data.format=indexed reads several corpora (a list of "
                              f"{{path: PREFIX, weight: W}}); name one file.")
        elif not os.path.isfile(path):
            raise ConfigError(f"{key} '{path}' does not exist.")


def check_shards_fit_model(cfg, vocab_size, tokenizer_path):
    """data.format=indexed: every corpus written for this model's vocabulary and tokenizer (as its PREFIX.json
    records), holding at least one sample, and its sample index writable where it goes (or built already)."""
    fingerprint = None
    if tokenizer_path:
        fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_path))
    for key in ("train_file", "eval_file"):
        if cfg[key] and not (key == "train_file" and cfg.eval_only):
            try:
                headers = check_sources(parse_sources(cfg[key], key), key, vocab_size, fingerprint, cfg.seq_length)
                for header in headers:
                    CorpusIndex(header, cfg.seed, cfg.seq_length, cfg.data.index_dir).check_writable()
            except ShardError as error:
                raise ConfigError(f"{key}: {error}") from None
