"""Tests for data/: demo corpus and tokenizer, build_dataset, the collator and the stage-aware loaders."""

import dataclasses
import json
import logging
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from datasets.table import MemoryMappedTable
from transformers import AutoTokenizer

from data import (
    IGNORE_INDEX,
    build_dataset,
    build_dataset_distributed,
    build_stage_loader,
    collate_causal_lm,
    infinite_micro_batches,
    micro_batches_per_epoch,
    train_demo_tokenizer,
    write_demo_corpus,
)
from data.datasets import tokenization_digest
from errors import ConfigError
from tests.distributed import spawn
from tests.helpers import write_jsonl

SENTENCE = "The small cat sees the red ball near the park. 3 plus 4 is 7."


# --- fixtures ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    write_demo_corpus(root / "corpus.txt", num_lines=400, seed=0)
    train_demo_tokenizer(root / "corpus.txt", root / "tokenizer", vocab_size=384)
    return root


@pytest.fixture(scope="session")
def tokenizer(demo_dir):
    return AutoTokenizer.from_pretrained(demo_dir / "tokenizer")


def flatten(rows):
    return [i for row in rows for i in row]


def build(path, tokenizer, seq_length, cache_dir, **cfg):
    return build_dataset(path, tokenizer, cfg, seq_length, cache_dir=cache_dir)


# --- demo corpus and tokenizer ----------------------------------------------------------------------------------------

def test_demo_corpus_is_deterministic(tmp_path):
    first = write_demo_corpus(tmp_path / "a.txt", 50, seed=3).read_text()
    assert first == write_demo_corpus(tmp_path / "b.txt", 50, seed=3).read_text()
    assert first != write_demo_corpus(tmp_path / "c.txt", 50, seed=4).read_text()
    assert len(first.splitlines()) == 50


def test_demo_tokenizer_loads_with_autotokenizer_and_round_trips(demo_dir, tokenizer, tmp_path):
    ids = tokenizer(SENTENCE).input_ids
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (1, 2, 0)
    assert tokenizer.pad_token_id is not None and len(tokenizer) == 384
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == SENTENCE
    # Training is deterministic: the same corpus gives the same tokenizer (tokenizer.model also records its paths).
    train_demo_tokenizer(demo_dir / "corpus.txt", tmp_path, vocab_size=384)
    assert (tmp_path / "tokenizer.json").read_text() == (demo_dir / "tokenizer" / "tokenizer.json").read_text()


# --- build_dataset ----------------------------------------------------------------------------------------------------

def test_text_is_packed_into_exact_blocks(tokenizer, tmp_path):
    documents = ["The dog finds the cup.", "", "Count: 1 2 3 4.", "The bird walks to the river."] * 5
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(documents) + "\n")
    dataset, stats = build(path, tokenizer, 16, tmp_path / "cache", format="text")

    rows = dataset[:]
    stream = [i for d in documents if d for i in tokenizer(d).input_ids + [tokenizer.eos_token_id]]
    assert all(len(row) == 16 for row in rows["input_ids"])
    assert rows["labels"] == rows["input_ids"]
    assert flatten(rows["input_ids"]) == stream[:len(dataset) * 16]
    assert (stats.records, stats.examples, stats.dropped_tokens) == (20, len(stream) // 16, len(stream) % 16)


def test_instruction_masks_prompt_and_keeps_response(tokenizer, tmp_path):
    pairs = [("Does the cat see the hat?", "yes, it does."), ("2 plus 5 is", "7.")]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"q": p, "a": r} for p, r in pairs])
    dataset, _ = build(path, tokenizer, 64, tmp_path / "cache", format="instruction", prompt_field="q",
                       response_field="a")

    for (prompt, response), row in zip(pairs, dataset):
        prompt_ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False).input_ids
        response_ids = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        assert row["input_ids"] == prompt_ids + response_ids
        assert row["labels"] == [IGNORE_INDEX] * len(prompt_ids) + response_ids


@pytest.mark.parametrize("bad_id", [384, -1])
def test_pretokenized_id_outside_vocabulary_names_file_example_and_id(tokenizer, tmp_path, bad_id):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}] * 2 + [{"input_ids": [5, bad_id, 7]}])
    with pytest.raises(ValueError, match=rf"{path}: example 2 holds token id {bad_id}, outside the vocabulary"):
        build(path, tokenizer, 8, tmp_path / "cache", format="pretokenized")
    # A model vocabulary larger than the tokenizer's admits the id.
    if bad_id > 0:
        dataset, _ = build_dataset(path, tokenizer, {"format": "pretokenized"}, 8, tmp_path / "cache", bad_id + 1)
        assert dataset[2]["input_ids"] == [5, bad_id, 7]


def test_malformed_json_line_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "The cat."}\n\n{"text": "The dog."}\n{"text": "The fox.\n{"text": "The hat."}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 4: malformed JSON line"):
        build(path, tokenizer, 8, tmp_path / "cache", format="text")


def test_malformed_json_lines_skipped_and_counted(tokenizer, tmp_path, caplog):
    good = [json.dumps({"text": "The small cat sees the red ball."})] * 6
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(good[:3] + ["{not json", '["a list"]', '{"other": 1}'] + good[3:]) + "\n")
    with caplog.at_level(logging.WARNING, logger="data.datasets"):
        _, stats = build(path, tokenizer, 8, tmp_path / "cache", format="text", bad_lines="skip")
    assert (stats.bad_lines_skipped, stats.records) == (3, 6)
    assert "skipped 3 malformed JSON lines or bad examples (first: [4, 5, 6])" in caplog.text


def test_overlong_truncate_and_split_counts(tokenizer, tmp_path):
    lengths = [3, 10, 25, 1, 8]
    sequences = [list(range(10, 10 + n)) for n in lengths]
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": s} for s in sequences])

    truncated, stats = build(path, tokenizer, 8, tmp_path / "cache", format="pretokenized", overlong="truncate")
    assert (stats.truncated, stats.split, stats.dropped_no_target) == (2, 0, 1)  # the 1-token record predicts nothing
    assert truncated[:]["input_ids"] == [sequences[0], sequences[1][:8], sequences[2][:8], sequences[4]]

    split, stats = build(path, tokenizer, 8, tmp_path / "cache", format="pretokenized", overlong="split")
    assert (stats.truncated, stats.split, stats.dropped_no_target) == (0, 2, 2)  # 25 → 8+8+8+(1), and the 1-token
    assert split[:]["input_ids"] == [sequences[0], sequences[1][:8], sequences[1][8:], sequences[2][:8],
                                     sequences[2][8:16], sequences[2][16:24], sequences[4]]
    assert split[:]["labels"] == split[:]["input_ids"]


def test_split_with_worker_processes_matches_one_process(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "The cat has two hats, which is", "response": f"{i}."}
                                                for i in range(40)])
    one, _ = build(path, tokenizer, 8, tmp_path / "cache", format="instruction", overlong="split")
    two, stats = build(path, tokenizer, 8, tmp_path / "cache", format="instruction", overlong="split", num_proc=2)
    assert len(two.cache_files) == 2 and two[:] == one[:] and stats.split == 40


@pytest.mark.parametrize("content, why", [
    ("The cat.\nThe dog.\n", "fewer than one block of seq_length=64"),
    ("", "the file is empty"),
])
def test_empty_result_names_file_and_reason(tokenizer, tmp_path, content, why):
    path = tmp_path / "short.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{path}: no training examples after tokenization: .*{why}"):
        build(path, tokenizer, 64, tmp_path / "cache", format="text")


def test_prompt_filling_every_position_leaves_nothing_to_learn(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "The big farmer walks to the market.", "response": "ok"}])
    with pytest.raises(ValueError, match=rf"{path}: no training examples .* none of its 1 records holds a token"):
        build(path, tokenizer, 4, tmp_path / "cache", format="instruction")


def test_second_build_memory_maps_the_cache_without_tokenizing(demo_dir, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first, first_stats = build(demo_dir / "corpus.txt", tokenizer, 32, cache, format="text")

    def fail(*args, **kwargs):
        raise AssertionError("the tokenizer ran although the cache holds the result")
    monkeypatch.setattr(type(tokenizer), "__call__", fail)

    second, second_stats = build(demo_dir / "corpus.txt", tokenizer, 32, cache, format="text")
    assert (first_stats.from_cache, second_stats.from_cache) == (False, True)
    assert second.cache_files == first.cache_files and isinstance(second.data, MemoryMappedTable)
    assert second[:] == first[:] and second_stats == dataclasses.replace(first_stats, from_cache=True)
    # A new seq_length re-packs the cached token sequences (one packing window: 400 documents); no tokenizer call.
    other, other_stats = build(demo_dir / "corpus.txt", tokenizer, 48, cache, format="text")
    assert not other_stats.from_cache and other_stats.examples > 0
    assert flatten(other[:]["input_ids"]) == flatten(first[:]["input_ids"])[:len(other) * 48]


def test_cache_key_reads_the_tokenizer_as_content(demo_dir, tokenizer):
    """Equal for the same files loaded again and after a truncating call (state a pickle would carry); different
    for another chat template."""
    before = tokenization_digest(tokenizer)
    tokenizer(SENTENCE * 8, truncation=True, max_length=5)
    reloaded = AutoTokenizer.from_pretrained(demo_dir / "tokenizer")
    assert tokenization_digest(tokenizer) == before == tokenization_digest(reloaded)
    reloaded.chat_template = "{{ messages[0]['content'] }}"
    assert tokenization_digest(reloaded) != before


def _build_on_rank(rank, corpus, tokenizer, cache, out):
    import os
    import sys
    import time
    from datetime import timedelta

    import data.datasets
    import cluster.shared_files
    # two nodes' local rank 0: one writer all the same, global rank 0
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2))  # a barrier waiting for the build would fail
    build, cluster.shared_files.PROGRESS_EVERY_S = data.datasets.build_dataset, 1

    def slow_build(*args, **kwargs):
        time.sleep(5)
        return build(*args, **kwargs)
    if rank == 0:  # a first build longer than the collective timeout: the other rank is in no collective meanwhile
        data.datasets.build_dataset = slow_build
    sys.stdout = open(out / f"rank{rank}.out", "w", buffering=1)
    dataset, stats = build_dataset_distributed(corpus, tokenizer, {"format": "text"}, 32, cache_dir=cache,
                                               limit_minutes=5)
    data.datasets.build_dataset = build
    dist.barrier()  # the process group outlived the build
    (out / f"rank{rank}.json").write_text(json.dumps([stats.from_cache, len(dataset), dataset.cache_files]))
    try:  # rank 0's error reaches the other rank through the store, which waits on no collective
        build_dataset_distributed(corpus.with_suffix(".jsonl"), tokenizer, {"format": "text"}, 32, cache_dir=cache,
                                  limit_minutes=5)
    except (FileNotFoundError, cluster.shared_files.SharedFileError) as error:  # rank 0's own; the other rank's
        (out / f"rank{rank}.error").write_text(str(error))
    try:  # an input the user must fix on rank 0 is one on every rank: not restarted
        build_dataset_distributed(out / "bad.jsonl", tokenizer, {"format": "text"}, 32, cache_dir=cache,
                                  limit_minutes=5)
    except ConfigError as error:
        (out / f"rank{rank}.config_error").write_text(f"{type(error).__name__}: {error}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_build_runs_once_and_other_ranks_load_the_cache(demo_dir, tokenizer, tmp_path):
    """Global rank 0 builds (both ranks are their node's local rank 0) for longer than the process group's
    timeout (2 s) while the other waits on the store, a progress line a second; then that rank reads the cache. A build
    that fails on rank 0 fails on the other rank with rank 0's error, a ConfigError on both where rank 0's is one."""
    (tmp_path / "bad.jsonl").write_text('{"text": "a fine line"}\n{"text": "broken\n')
    spawn(_build_on_rank, 2, demo_dir / "corpus.txt", tokenizer, tmp_path / "cache", tmp_path)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (rank0[0], rank1[0]) == (False, True)
    assert rank0[1:] == rank1[1:]
    progress = (tmp_path / "rank1.out").read_text().splitlines()
    line = f"waiting for rank 0 to build the tokenized cache of {demo_dir / 'corpus.txt'}: 0 of at most 5 minutes"
    assert progress and set(progress) == {line}
    error = f"[Errno 2] No such file or directory: '{demo_dir / 'corpus.jsonl'}'"
    assert (tmp_path / "rank1.error").read_text() == f"rank 0 could not build the tokenized cache of " \
                                                    f"{demo_dir / 'corpus.jsonl'}: FileNotFoundError: {error}"
    refusal = (tmp_path / "rank0.config_error").read_text()
    assert refusal.startswith(f"ConfigError: {tmp_path / 'bad.jsonl'}: line 2"), refusal
    assert (tmp_path / "rank1.config_error").read_text() == (
        f"ConfigError: rank 0 could not build the tokenized cache of {tmp_path / 'bad.jsonl'}: {refusal}")


# --- collator ---------------------------------------------------------------------------------------------------------

def test_collator_pads_right_to_seq_length():
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12],
                                                                  "labels": [8, 9, 10, 11, 12]}]
    (input_ids, attention_mask, position_ids), labels = collate_causal_lm(examples, seq_length=6, pad_id=0)
    for tensor in (input_ids, attention_mask, position_ids, labels):
        assert tensor.shape == (2, 6) and tensor.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 10, 11, 12, 0]]
    assert attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert labels.tolist() == [[-100, 6, 7, -100, -100, -100], [8, 9, 10, 11, 12, -100]]
    assert position_ids.tolist() == [list(range(6))] * 2


# --- stage-aware loader -----------------------------------------------------------------------------------------------

class RecordingDataset(torch.utils.data.Dataset):
    """Example i is the row [i, i]; remembers which indices were read."""

    def __init__(self, size):
        self.size, self.read = size, []

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.read.append(index)
        return {"input_ids": [index, index], "labels": [index, index]}


def loader_for(dataset, dp_rank, dp_size, reads_data=True, drop_last=True, micro_batch_size=2):
    return build_stage_loader(dataset, reads_data=reads_data, dp_rank=dp_rank, dp_size=dp_size,
                              micro_batch_size=micro_batch_size, seq_length=4, pad_id=0, seed=7, drop_last=drop_last)


def indices_of(micro_batches):
    return [i for (input_ids, _, _), _ in micro_batches for i in input_ids[:, 0].tolist()]


@pytest.mark.parametrize("dp_size", [2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_epoch_covers_examples_as_documented_and_stages_agree(dp_size, drop_last):
    size, micro_batch_size = 23, 2
    dataset = RecordingDataset(size)
    expected_len = micro_batches_per_epoch(size, dp_size, micro_batch_size, drop_last)
    used = Counter()
    for rank in range(dp_size):
        first, last = (loader_for(dataset, rank, dp_size, drop_last=drop_last) for _ in range(2))
        middle = loader_for(range(size), rank, dp_size, reads_data=False, drop_last=drop_last)
        assert len(first) == len(middle) == len(last) == expected_len
        first_batches = list(first)
        assert len(first_batches) == expected_len
        assert indices_of(first_batches) == indices_of(last)  # first and last stage read the same examples
        assert list(middle) == [None] * expected_len
        used.update(indices_of(first_batches))

    slots = dp_size * expected_len * micro_batch_size
    if drop_last:  # no example twice; fewer than dp_size * micro_batch_size wait for a later epoch
        assert expected_len == size // dp_size // micro_batch_size
        assert max(used.values()) == 1 and sum(used.values()) == slots
        assert 0 <= size - slots < dp_size * micro_batch_size
    else:  # every example at least once; fewer than dp_size * micro_batch_size slots repeat one
        assert expected_len == math.ceil(math.ceil(size / dp_size) / micro_batch_size)
        assert set(used) == set(range(size)) and sum(used.values()) == slots
        assert 0 <= slots - size < dp_size * micro_batch_size


def test_set_epoch_changes_the_order():
    loader = loader_for(RecordingDataset(40), dp_rank=0, dp_size=2)
    epoch0 = indices_of(loader)
    loader.set_epoch(1)
    epoch1 = indices_of(loader)
    loader.set_epoch(0)
    assert epoch0 != epoch1 and indices_of(loader) == epoch0


def test_resume_yields_exactly_the_unseen_examples_without_reading_the_others():
    full = indices_of(_at_epoch(loader_for(RecordingDataset(40), dp_rank=1, dp_size=2), 3))
    dataset = RecordingDataset(40)
    resumed = loader_for(dataset, dp_rank=1, dp_size=2)
    resumed.set_position(3, consumed_micro_batches=4)
    assert indices_of(resumed) == full[4 * 2:]
    assert sorted(dataset.read) == sorted(full[4 * 2:])


def _at_epoch(loader, epoch):
    loader.set_epoch(epoch)
    return loader


def test_infinite_stream_crosses_epochs_and_resumes_from_its_position():
    loader = loader_for(RecordingDataset(20), dp_rank=0, dp_size=2)  # 5 micro-batches per epoch
    stream = infinite_micro_batches(loader)
    seen = [next(stream) for _ in range(7)]
    assert stream.position == (1, 2)
    assert indices_of(seen[:5]) == indices_of(_at_epoch(loader_for(RecordingDataset(20), 0, 2), 0))
    assert indices_of(seen[5:]) == indices_of(_at_epoch(loader_for(RecordingDataset(20), 0, 2), 1))[:4]

    resumed = infinite_micro_batches(loader_for(RecordingDataset(20), 0, 2), *stream.position)
    assert indices_of(next(resumed) for _ in range(5)) == indices_of(next(stream) for _ in range(5))
    assert resumed.position == stream.position == (2, 2)


def test_too_few_examples_for_one_micro_batch_per_rank():
    with pytest.raises(ValueError, match="5 examples give no micro-batch of 2 to each of 3 data-parallel ranks"):
        loader_for(RecordingDataset(5), dp_rank=0, dp_size=3)


def test_loader_over_built_dataset_gives_pipeline_tuples(demo_dir, tokenizer, tmp_path):
    dataset, _ = build(demo_dir / "corpus.txt", tokenizer, 32, tmp_path / "cache", format="text")
    loader = build_stage_loader(dataset, reads_data=True, dp_rank=0, dp_size=1, micro_batch_size=4, seq_length=32,
                                pad_id=tokenizer.pad_token_id, seed=0)
    (input_ids, attention_mask, position_ids), labels = next(iter(loader))
    assert input_ids.shape == labels.shape == (4, 32) and attention_mask.all() and torch.equal(input_ids, labels)
    assert len(loader) == len(dataset) // 4
