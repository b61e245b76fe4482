"""Token shards (data/shard_files.py, data/indexed.py, prepare_data.py): Megatron's format both ways, samples of seq_length + 1 tokens cut
from the shuffled documents, epochs, the blend's proportions, exact positions across layouts and global batches, and
bad shards refused before training."""
import json
import os
import shutil
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

import data.tokenize_shards as tokenize_shards
from data.indexed import Blend, CorpusIndex, IndexedCorpus, blend_counts, open_blend, prepare_indices
from data.shard_files import (ShardError, check_sources, megatron_datasets, parse_sources, read_shard_header,
                              tokenizer_fingerprint)
from data.loader import blend_micro_batches
from tests import test_reliability

SEQ = 16
small_disk = test_reliability.small_disk  # a fixture


@pytest.fixture(scope="module")
def corpus(demo_model, tmp_path_factory):
    """The demo model's eval text (40 documents) as jsonl, parquet and txt inputs, prepared into shards with its
    tokenizer."""
    root = tmp_path_factory.mktemp("shards")
    lines = open(demo_model["eval"]).read().splitlines()
    with open(root / "a.jsonl", "w") as f:
        for line in lines[:16]:
            f.write(json.dumps({"text": line, "id": 7}) + "\n")
    pq.write_table(pa.table({"text": lines[16:24]}), root / "b.parquet")
    (root / "c.txt").write_text("\n".join(lines[24:]) + "\n\n")  # a blank line: no document
    inputs = [str(root / name) for name in ("a.jsonl", "b.parquet", "c.txt")]
    summary = tokenize_shards.prepare_shards(inputs, demo_model["hf"], str(root / "out" / "web"))
    tokenizer = AutoTokenizer.from_pretrained(demo_model["hf"])
    documents = [[tokenizer.bos_token_id, *tokenizer(line, add_special_tokens=False)["input_ids"],
                  tokenizer.eos_token_id] for line in lines]
    return {"prefix": str(root / "out" / "web"), "summary": summary, "inputs": inputs, "documents": documents,
            "root": root, "tokenizer": tokenizer, "hf": demo_model["hf"]}


def test_prepared_shards_read_back_with_megatron_and_independently(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    shards = IndexedDataset(corpus["prefix"])
    assert [shards[i].tolist() for i in range(len(shards))] == corpus["documents"]
    assert shards.index.dtype == np.uint16  # 384 tokens: the smallest dtype holding the vocabulary
    # An independent reading of the bytes: header, lengths, pointers, tokens.
    idx = open(corpus["prefix"] + ".idx", "rb").read()
    count = struct.unpack("<Q", idx[18:26])[0]
    lengths = np.frombuffer(idx, np.int32, count, 34)
    pointers = np.frombuffer(idx, np.int64, count, 34 + 4 * count)
    tokens = np.fromfile(corpus["prefix"] + ".bin", np.uint16)
    assert [tokens[p // 2:p // 2 + n].tolist() for p, n in zip(pointers, lengths)] == corpus["documents"]
    header = read_shard_header(corpus["prefix"])
    assert (header.sequences, header.tokens) == (len(corpus["documents"]), sum(map(len, corpus["documents"])))
    assert corpus["summary"]["tokenizer"]["fingerprint"] == tokenizer_fingerprint(corpus["tokenizer"])
    assert not os.path.exists(corpus["prefix"] + ".parts")


def cut_stream(documents, seq_length):
    """Megatron's samples, read independently: sample s is tokens [s·L, s·L + L] of the documents' stream (each
    starts at the previous one's last token), with the lengths of the document pieces it holds."""
    stream = np.concatenate(documents)
    ends = np.cumsum([len(d) for d in documents])
    samples = []
    for start in range(0, len(stream) - seq_length, seq_length):
        edges = [start, *(int(e) for e in ends if start < e < start + seq_length + 1), start + seq_length + 1]
        samples.append((stream[start:start + seq_length + 1].tolist(), [b - a for a, b in zip(edges, edges[1:])]))
    return samples


def test_samples_are_seq_length_plus_one_tokens_of_the_shuffled_documents(corpus):
    index = CorpusIndex(read_shard_header(corpus["prefix"]), seed=3, seq_length=SEQ)
    index.build(2)
    samples = IndexedCorpus(index, isolate=True)
    for epoch in range(2):
        order = index.epoch(epoch)[0]
        expected = cut_stream([corpus["documents"][d] for d in order], SEQ)
        cut = [samples.cut_sample(epoch, s) for s in range(samples.samples_per_epoch)]
        assert [(row["labels"].tolist(), row["lengths"]) for row in cut] == expected
        assert all(row["input_ids"].tolist() == row["labels"].tolist()[:-1] for row in cut)
    assert samples.samples_per_epoch == (read_shard_header(corpus["prefix"]).tokens - 1) // SEQ
    # The k-th sample drawn: epoch k // n, in an order of its own; the next epoch reshuffles documents and order.
    n = samples.samples_per_epoch
    drawn = [samples.sample(k)["input_ids"].tolist() for k in range(2 * n)]
    for epoch in range(2):
        assert sorted(drawn[epoch * n:(epoch + 1) * n]) == sorted(
            samples.cut_sample(epoch, s)["input_ids"].tolist() for s in range(n))
    assert drawn[:n] != [samples.cut_sample(0, s)["input_ids"].tolist() for s in range(n)]
    assert index.epoch(0)[0].tolist() != index.epoch(1)[0].tolist()


def test_the_last_input_learns_the_token_after_it_unless_a_document_starts_there():
    """A sample's seq_length + 1 labels: the loss, whole or split over a context group, scores every input
    position against the next token, the last one too; with document isolation not where a document starts."""
    import torch

    from data.collator import collate_causal_lm
    from models.context_parallel import ContextParallel
    from models import IGNORE_INDEX
    from models.loss import CausalLMLoss, next_token_labels, split_micro_batch
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8, 9], "lengths": [2, 3]},  # a document from 7 on
            {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4, 5], "lengths": [4, 1]}]  # one starting after it
    inputs, labels = collate_causal_lm(rows, seq_length=4, pad_id=0)
    assert labels.shape == (2, 5) and inputs[0].tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    assert next_token_labels(labels, positions=4).reshape(2, 4).tolist() == [[6, IGNORE_INDEX, 8, 9],
                                                                             [2, 3, 4, IGNORE_INDEX]]
    assert inputs[1].tolist() == [[1, 1, 2, 2], [1, 1, 1, 1]]
    logits = torch.randn(2, 4, 12)
    scored = next_token_labels(labels, positions=4)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 12), scored, ignore_index=IGNORE_INDEX)
    assert torch.equal(CausalLMLoss(seq_length=4)(logits, labels), expected)
    (_, split_labels) = split_micro_batch(ContextParallel(size=2, rank=1), (inputs, labels))
    assert split_labels.tolist() == [[IGNORE_INDEX, 8], [3, 4]]  # chunks 1 and 2 of 4: positions 1 and 2


def test_a_corpus_written_by_megatrons_builder_trains_here(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1000, rng.integers(1, 40)).astype(np.int32) for _ in range(50)]
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(str(tmp_path / "m.idx"))
    sources = parse_sources(str(tmp_path / "m"), "train_file")
    headers = check_sources(sources, "train_file", 1000, "any fingerprint: Megatron records none", SEQ)
    prepare_indices(sources, headers, seed=0, seq_length=SEQ, total_samples=10, blend_dir=tmp_path, vocab_size=1000)
    blend = open_blend(sources, headers, seed=0, seq_length=SEQ, isolate=False, blend_dir=tmp_path, vocab_size=1000)
    n = blend.corpora[0].samples_per_epoch
    assert n == (sum(map(len, documents)) - 1) // SEQ
    order = blend.corpora[0].index.epoch(0)[0]
    expected = [tokens for tokens, _ in cut_stream([documents[d] for d in order], SEQ)]
    assert [blend.corpora[0].cut_sample(0, s)["labels"].tolist() for s in range(n)] == expected
    assert sorted(blend[k]["labels"].tolist() for k in range(n)) == sorted(expected)
    # Its token ids were never checked against a vocabulary: the index build scans them once.
    low, high = int(min(d.min() for d in documents)), int(max(d.max() for d in documents))
    with pytest.raises(ShardError, match=rf"m\.bin holds token ids in \[{low}, {high}\], outside the model's "
                                         rf"vocabulary \[0, 500\); prepare it with the model's tokenizer"):
        open_blend(sources, headers, seed=0, seq_length=SEQ, isolate=False, blend_dir=tmp_path, vocab_size=500)


def test_shards_their_prefix_json_vouches_for_are_not_scanned(corpus, tmp_path, monkeypatch):
    """prepare_data.py's PREFIX.json, when it counts these very shards' documents and tokens, bounds their ids (its
    tokenizer's vocabulary, checked against the model's at start): a first start reads no .bin. Shards whose counts
    it does not match (rewritten by another tool) are scanned."""
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(corpus["prefix"] + suffix, tmp_path / f"web{suffix}")
    sources = parse_sources(str(tmp_path / "web"), "train_file")
    headers = check_sources(sources, "train_file", 384, None, SEQ)
    real_fromfile = np.fromfile

    def no_scan(*args, **kwargs):
        raise AssertionError("the .bin was scanned")
    monkeypatch.setattr(np, "fromfile", no_scan)
    built = prepare_indices(sources, headers, seed=0, seq_length=SEQ, total_samples=10, blend_dir=tmp_path,
                            vocab_size=384)
    index = CorpusIndex(headers[0], seed=0, seq_length=SEQ)
    assert built == list(index.files(0).values()) and not index.stats_file.exists()
    metadata = json.loads((tmp_path / "web.json").read_text())
    (tmp_path / "web.json").write_text(json.dumps({**metadata, "tokens": metadata["tokens"] - 1}))
    shutil.rmtree(tmp_path / "web.index")
    monkeypatch.setattr(np, "fromfile", real_fromfile)
    built = prepare_indices(sources, headers, seed=0, seq_length=SEQ, total_samples=10, blend_dir=tmp_path,
                            vocab_size=384)
    assert built == [*index.files(0).values(), index.stats_file]
    assert json.loads(index.stats_file.read_text())["max_token_id"] < 384


def test_blend_is_within_one_sample_of_the_weights_at_every_prefix():
    weights = [0.5, 0.3, 0.2]
    corpus, within = blend_counts(weights, 10_000)
    counts = np.stack([np.cumsum(corpus == c) for c in range(3)], axis=1)
    drawn = np.arange(1, 10_001)[:, None] * np.array(weights)
    assert np.abs(counts - drawn).max() <= 1
    for c in range(3):  # each corpus's samples in order, none skipped
        assert within[corpus == c].tolist() == list(range(int((corpus == c).sum())))


def test_resume_on_another_layout_reads_exactly_the_next_samples():
    """2 data-parallel ranks x 2 per micro-batch x 2 micro-batches for 3 steps, then 3 ranks x 1 x 2 (the global
    batch 8 -> 6) from the 24 consumed: each step takes the next global batch, nothing repeated or skipped."""
    samples = type("Numbered", (), {"__getitem__": lambda self, g: {"input_ids": [g + 1], "labels": [g + 1]}})()

    def steps(dp_size, micro, accumulation, start, count):
        streams = [blend_micro_batches(samples, reads_data=True, dp_rank=r, dp_size=dp_size, micro_batch_size=micro,
                                       seq_length=1, pad_id=0, start_sample=start) for r in range(dp_size)]
        taken = []
        for _ in range(count):
            step = [next(s)[0][0][:, 0] - 1 for _ in range(accumulation) for s in streams]
            taken.append(sorted(int(g) for batch in step for g in batch))
        return taken
    first = steps(2, 2, 2, 0, 3)
    resumed = steps(3, 1, 2, 24, 2)
    assert first + resumed == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), list(range(24, 30)),
                               list(range(30, 36))]
    middle = blend_micro_batches(None, reads_data=False, dp_rank=0, dp_size=1, micro_batch_size=1, seq_length=1,
                                 pad_id=0, start_sample=0)
    assert next(middle) is None  # a middle stage reads nothing


def test_epochs_metric_names_each_corpus_and_its_epoch(tmp_path):
    corpora = [type("C", (), {"samples_per_epoch": n})() for n in (10, 4)]
    sources = parse_sources([{"path": "a/web", "weight": 3}, {"path": "b/code", "weight": 1}], "train_file")
    blend = Blend(sources, corpora, *blend_counts([s.weight for s in sources], 100))
    assert blend.epochs(40) == {"epoch/web": 3.0, "epoch/code": 2.5}
    assert blend.epochs(20) == {"epoch/web": 1.5, "epoch/code": 1.25}  # counting again from the start


@pytest.mark.parametrize("entry,message", [
    ({"path": "x", "weight": 0}, "the weight of x is 0; every weight must be a positive number"),
    ({"path": "x", "weight": -1.5}, "the weight of x is -1.5"),
    ({"path": "x", "weight": float("nan")}, "the weight of x is nan"),
    ({"path": "x", "weight": "half"}, "the weight of x is 'half'"),
    ({"path": "x"}, "must be {path: PREFIX, weight: W}"),
])
def test_bad_weights_are_refused(entry, message):
    with pytest.raises(ShardError, match=f"train_file: .*{message.replace('{', '.').replace('}', '.')}"):
        parse_sources([{"path": "y", "weight": 1}, entry], "train_file")


def test_bad_shards_name_the_file_and_what_to_do(corpus, tmp_path):
    prefix = str(tmp_path / "web")
    with pytest.raises(ShardError, match=f"{prefix}.idx does not exist"):
        read_shard_header(prefix)
    for suffix in (".bin", ".idx", ".json"):
        (tmp_path / f"web{suffix}").write_bytes(open(corpus["prefix"] + suffix, "rb").read())
    bin_file = tmp_path / "web.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    with pytest.raises(ShardError, match=r"web\.bin holds \d+ bytes but .*web\.idx indexes \d+: the .bin is "
                                         r"truncated or the .idx belongs to another .bin"):
        read_shard_header(prefix)
    (tmp_path / "web.idx").write_bytes((tmp_path / "web.idx").read_bytes()[:-8])
    with pytest.raises(ShardError, match="web.idx is truncated or damaged"):
        read_shard_header(prefix)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    IndexedDatasetBuilder(str(tmp_path / "empty.bin"), dtype=np.uint16).finalize(str(tmp_path / "empty.idx"))
    with pytest.raises(ShardError, match=f"{tmp_path}/empty: the corpus is empty"):
        read_shard_header(tmp_path / "empty")
    sources = parse_sources(corpus["prefix"], "train_file")
    with pytest.raises(ShardError, match=r"prepared with tokenizer .* which differs from this run's"):
        check_sources(sources, "train_file", 384, "0123456789abcdef", SEQ)
    with pytest.raises(ShardError, match="prepared with a vocabulary of 384 tokens, more than the model's 256"):
        check_sources(sources, "train_file", 256, None, SEQ)
    with pytest.raises(ShardError, match=r"tokens, fewer than one sample of seq_length=100000"):
        check_sources(sources, "train_file", 384, None, 100_000)


def test_prepare_data_replaces_shards_it_did_not_write_only_when_told(corpus, tmp_path, monkeypatch):
    """Shards at --output_prefix that PREFIX.json does not describe (Megatron's, without one; or beside the
    PREFIX.json of other shards) are refused, named, before any tokenizing, and left as they were; --overwrite
    replaces them."""
    import prepare_data
    from tests.test_checkpointing import disk_state
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(str(tmp_path / "web.bin"), dtype=np.int32)
    builder.add_document(np.arange(5, dtype=np.int32), [5])
    builder.finalize(str(tmp_path / "web.idx"))
    prefix = tmp_path / "web"
    command = ["--input", corpus["inputs"][0], "--tokenizer_name_or_path", corpus["hf"], "--output_prefix", str(prefix)]
    real_write_part = tokenize_shards.write_part
    monkeypatch.setattr(tokenize_shards, "write_part", None)  # nothing is tokenized
    for metadata in (None, {**corpus["summary"], "inputs": []}):  # Megatron's shards; shards of other inputs
        if metadata:
            (tmp_path / "web.json").write_text(json.dumps(metadata))
        before = disk_state(tmp_path)
        with pytest.raises(SystemExit) as refusal:
            prepare_data.main(command)
        assert str(refusal.value) == (
            f"prepare_data.py: {prefix}.bin and {prefix}.idx exist already, and {prefix}.json does not describe them "
            f"as prepared here with this tokenizer and --text_field (another tool wrote them, or another tokenizer); "
            f"pass --overwrite to replace them, or choose another --output_prefix")
        assert disk_state(tmp_path) == before
    monkeypatch.setattr(tokenize_shards, "write_part", real_write_part)
    prepare_data.main(command + ["--overwrite"])
    assert read_shard_header(prefix).sequences == 16 and json.loads((tmp_path / "web.json").read_text())["inputs"]


def test_prepare_data_adds_inputs_to_a_prepared_prefix(corpus, tmp_path, monkeypatch):
    """Inputs added to those a prefix was prepared from extend it without --overwrite, into the very shards one run
    over all of them writes: after the prepared ones, only the added ones are tokenized; between them, all are.
    Interrupted while tokenizing, the shards stay as they were; interrupted between the two renames, a re-run
    finishes. An input dropped is refused, named, before any tokenizing, leaving the shards as they were."""
    import prepare_data
    from tests.test_checkpointing import disk_state
    a, b, c = corpus["inputs"]
    real_write_part, real_replace = tokenize_shards.write_part, os.replace
    tokenized, interrupt = [], {"part": None, "rename": None}

    def write_part(path, *args):
        if path == interrupt["part"]:
            raise KeyboardInterrupt
        tokenized.append(path)
        real_write_part(path, *args)

    def replace(source, target):
        if str(target) == interrupt["rename"]:
            raise KeyboardInterrupt
        real_replace(source, target)
    monkeypatch.setattr(tokenize_shards, "write_part", write_part)
    monkeypatch.setattr(os, "replace", replace)

    def prepare(name, *inputs):
        tokenized.clear()
        tokenize_shards.prepare_shards(list(inputs), corpus["hf"], str(tmp_path / name))
        return list(tokenized)

    def same_as_one_run(name):
        return all(open(tmp_path / f"{name}{suffix}", "rb").read() == open(corpus["prefix"] + suffix, "rb").read()
                   for suffix in (".bin", ".idx"))

    assert prepare("web", a) == [a]
    shards = {suffix: open(tmp_path / f"web{suffix}", "rb").read() for suffix in (".bin", ".idx", ".json")}
    interrupt["part"] = c
    with pytest.raises(KeyboardInterrupt):
        prepare("web", a, b, c)
    assert {suffix: open(tmp_path / f"web{suffix}", "rb").read() for suffix in shards} == shards
    interrupt["part"] = None
    assert prepare("web", a, b, c) == [c] and same_as_one_run("web")  # b's part was kept, a's documents reused
    before = disk_state(tmp_path)
    with pytest.raises(SystemExit) as refusal:
        prepare_data.main(["--input", a, b, "--tokenizer_name_or_path", corpus["hf"],
                           "--output_prefix", str(tmp_path / "web")])
    assert str(refusal.value) == (
        f"prepare_data.py: {tmp_path}/web.bin/.idx hold the documents of {c}, which is not among these inputs or has "
        f"changed since it was prepared (size or mtime); pass --overwrite to prepare {tmp_path}/web from these inputs "
        f"alone, or choose another --output_prefix")
    assert disk_state(tmp_path) == before and tokenized == [c]
    assert prepare("between", a, c) == [a, c]
    assert prepare("between", a, b, c) == [a, b, c] and same_as_one_run("between")
    assert prepare("renamed", a) == [a]
    interrupt["rename"] = str(tmp_path / "renamed.idx")  # the .bin is renamed first: a new .bin beside the old .idx
    with pytest.raises(KeyboardInterrupt):
        prepare("renamed", a, b, c)
    assert not (tmp_path / "renamed.json").exists()
    interrupt["rename"] = None
    assert prepare("renamed", a, b, c) == [a] and same_as_one_run("renamed")  # b's and c's parts were kept


@pytest.mark.slow  # spawns 2 tokenizing processes
def test_empty_inputs_interrupted_runs_and_two_workers(corpus, tmp_path, monkeypatch):
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(tokenize_shards.PrepareError, match="hold no document with text"):
        tokenize_shards.prepare_shards([str(tmp_path / "blank.txt")], corpus["hf"], str(tmp_path / "empty"))
    assert not list(tmp_path.glob("empty.bin*"))
    inputs = corpus["inputs"]
    real_write_part, written = tokenize_shards.write_part, []

    def write_then_fail_on_the_second(path, *args):
        if len(written) == 1:
            raise KeyboardInterrupt
        written.append(path)
        real_write_part(path, *args)
    monkeypatch.setattr(tokenize_shards, "write_part", write_then_fail_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        tokenize_shards.prepare_shards(inputs, corpus["hf"], str(tmp_path / "web"))
    assert not list(tmp_path.glob("web.*[bx]"))  # no final shard, half-written or not
    written.append(None)  # from here on every part is written, by 2 tokenizing processes
    # forked from the rank zygote, whose libraries are imported (a spawned one imports torch and transformers again,
    # ~5 CPU s); each still imports data.tokenize_shards afresh and gets its work pickled, as a spawned one does
    from tests.rank_zygote import context
    monkeypatch.setattr(tokenize_shards, "get_context", lambda method: context())
    tokenize_shards.prepare_shards(inputs, corpus["hf"], str(tmp_path / "web"), workers=2, batch_size=7)
    assert written == [inputs[0], None, inputs[1], inputs[2]]  # the first input's part was kept, not redone
    for suffix in (".bin", ".idx"):
        assert open(tmp_path / f"web{suffix}", "rb").read() == open(corpus["prefix"] + suffix, "rb").read()
    monkeypatch.setattr(tokenize_shards, "write_part", None)  # done: a third run tokenizes nothing
    tokenize_shards.prepare_shards(inputs, corpus["hf"], str(tmp_path / "web"))


@pytest.fixture(scope="module")
def mixture_runs(demo_model, tmp_path_factory):
    """6 steps on 2 stages of a 0.5/0.5 mixture of the demo corpus (prepared here) and a 20-document one written
    as Megatron's preprocess_data.py writes it (its builder, int32, no PREFIX.json; it runs out and starts its
    second epoch), saving at step 3; then steps 4-6 resumed from it on 1 process, once with another micro-batch
    size and the same global batch (8), once with the global batch 8 -> 4."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tests.launch import check_ok, demo_overrides, launch_trainer
    root = tmp_path_factory.mktemp("mixture")
    for name, source in (("web", demo_model["train"]), ("eval", demo_model["eval"])):
        tokenize_shards.prepare_shards([source], demo_model["hf"], str(root / name))
    tokenizer = AutoTokenizer.from_pretrained(demo_model["hf"])
    builder = IndexedDatasetBuilder(str(root / "small.bin"), dtype=np.int32)
    for line in open(demo_model["eval"]).readlines()[:20]:
        ids = [tokenizer.bos_token_id, *tokenizer(line.strip(), add_special_tokens=False)["input_ids"],
               tokenizer.eos_token_id]
        builder.add_document(np.array(ids), [len(ids)])
    builder.finalize(str(root / "small.idx"))
    mixture = f"[{{path: {root / 'web'}, weight: 1}}, {{path: {root / 'small'}, weight: 1}}]"
    settings = dict(train_file=mixture, eval_file=str(root / "eval"), **{"data.format": "indexed"},
                    max_steps=6, logging_steps=1, save_steps=3, export_hf="false", eval_steps=0)
    first = root / "first"
    check_ok(launch_trainer(2, demo_overrides(demo_model, first, **settings)))
    resumed = root / "resumed"
    result = check_ok(launch_trainer(1, demo_overrides(demo_model, resumed, **settings, num_stages=1,
                                                       micro_batch_size=1, gradient_accumulation_steps=8,
                                                       resume=str(first / "global_step3"))))
    smaller = root / "smaller_batch"
    smaller_result = check_ok(launch_trainer(1, demo_overrides(demo_model, smaller, **settings, num_stages=1,
                                                               micro_batch_size=2, gradient_accumulation_steps=2,
                                                               resume=str(first / "global_step3"))))
    return {"root": root, "first": first, "resumed": resumed, "resume_output": result.stdout,
            "smaller": smaller, "smaller_output": smaller_result.stdout}


@pytest.mark.slow
def test_mixture_trains_and_resumes_on_another_layout_exactly(demo_model, mixture_runs):
    from tests.launch import per_step_losses, read_metrics
    first, resumed = per_step_losses(mixture_runs["first"]), per_step_losses(mixture_runs["resumed"])
    assert len(first) == 6 and resumed == pytest.approx(first[3:], abs=1e-5, rel=0)
    assert "the data position is kept in samples (24 consumed)" in mixture_runs["resume_output"]
    # Metrics: each corpus's epochs after the step's samples, the small one past its first epoch by step 6.
    root = mixture_runs["root"]
    sizes = [(read_shard_header(root / name).tokens - 1) // 64 for name in ("web", "small")]
    corpus_of, _ = blend_counts([0.5, 0.5], 48)
    for step in (3, 6):
        record = next(r for r in read_metrics(mixture_runs["resumed"] if step > 3 else mixture_runs["first"])
                      if r.get("step") == step and "loss" in r)
        drawn = [int((corpus_of[:8 * step] == c).sum()) for c in range(2)]
        assert record["epoch/web"] == round(drawn[0] / sizes[0], 4)
        assert record["epoch/small"] == round(drawn[1] / sizes[1], 4)
    assert record["epoch/small"] > 1
    assert "eval_loss" in read_metrics(mixture_runs["resumed"])[-1]


def transformers_token_mean(model_dir, blend, samples):
    """transformers' next-token loss of `model_dir` over the blend's `samples` (seq_length inputs, seq_length + 1
    labels each), the mean over their tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    labels = torch.as_tensor(np.stack([blend[g]["labels"] for g in samples]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=labels[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)).item()


def mixture_blend(mixture_runs):
    """The samples mixture_runs read, as the trainer opened them."""
    root = mixture_runs["root"]
    sources = parse_sources([{"path": str(root / "web"), "weight": 1}, {"path": str(root / "small"), "weight": 1}],
                            "train_file")
    headers = [read_shard_header(s.prefix) for s in sources]
    return open_blend(sources, headers, seed=42, seq_length=64, isolate=False,
                      blend_dir=mixture_runs["first"] / "data_index", vocab_size=384)


@pytest.mark.slow
def test_first_step_loss_equals_transformers_on_the_samples_read_from_shards(demo_model, mixture_runs):
    """Step 1 (before any update) is the token mean over its 8 samples, each 64 inputs scored against the 65
    tokens' next ones, which transformers' logits give alike."""
    from tests.launch import per_step_losses
    expected = transformers_token_mean(demo_model["hf"], mixture_blend(mixture_runs), range(8))
    assert per_step_losses(mixture_runs["first"])[0] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_a_resume_with_a_smaller_global_batch_reads_the_next_samples(mixture_runs, tmp_path):
    """Resumed from step 3 (24 samples consumed) with the global batch 8 -> 4: step 4 is samples 24-27, its loss
    transformers' on them with the step-3 weights; the metrics count the corpora's epochs from there."""
    from checkpoints.ds_to_hf import convert_ds_to_hf
    from tests.launch import per_step_losses, read_metrics
    assert "global_batch_size 8 -> 4" in mixture_runs["smaller_output"]
    assert "the data position is kept in samples (24 consumed)" in mixture_runs["smaller_output"]
    step3 = convert_ds_to_hf(mixture_runs["first"], tmp_path / "hf", tag="global_step3")
    losses = per_step_losses(mixture_runs["smaller"])
    assert len(losses) == 3
    expected = transformers_token_mean(step3, mixture_blend(mixture_runs), range(24, 28))
    assert losses[0] == pytest.approx(expected, abs=1e-5)
    corpus_of, _ = blend_counts([0.5, 0.5], 36)
    sizes = [(read_shard_header(mixture_runs["root"] / name).tokens - 1) // 64 for name in ("web", "small")]
    record = next(r for r in read_metrics(mixture_runs["smaller"]) if r.get("step") == 6 and "loss" in r)
    assert record["epoch/small"] == round(int((corpus_of == 1).sum()) / sizes[1], 4)


def test_read_only_shards_build_their_index_in_index_dir(demo_model, corpus, small_disk, tmp_path):
    """Shards on a read-only filesystem: the run is refused before it starts, naming where the index would go and
    data.index_dir; with index_dir the index is built there, and the samples are those built beside the shards."""
    from tests.helpers import compose_config
    from tests.launch import demo_overrides
    from errors import ConfigError
    from training.run_spec import run_spec
    disk = small_disk(16 * 2**20)
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(corpus["prefix"] + suffix, disk / f"web{suffix}")
    small_disk(16 * 2**20, read_only=True)

    def spec(**overrides):
        return run_spec(compose_config(demo_overrides(demo_model, tmp_path / "run", **{
            "train_file": disk / "web", "eval_file": "null", "data.format": "indexed", **overrides})), 2)
    with pytest.raises(ConfigError, match=rf"train_file: {disk}/web: its sample index goes to {disk}/web\.index/s42-"
                                          rf"L64-\w+, but {disk} is not writable \(read-only storage\?\); set "
                                          rf"data\.index_dir to a directory that every node can write and read"):
        spec()
    assert spec(**{"data.index_dir": tmp_path / "indices"})
    index = CorpusIndex(read_shard_header(disk / "web"), seed=42, seq_length=SEQ, index_dir=tmp_path / "indices")
    index.build(1)
    assert index.directory.parent.parent == tmp_path / "indices" and not os.path.exists(f"{disk}/web.index")
    beside = CorpusIndex(read_shard_header(corpus["prefix"]), seed=42, seq_length=SEQ)
    beside.build(1)
    read_only, writable = IndexedCorpus(index, isolate=True), IndexedCorpus(beside, isolate=True)
    for s in range(index.samples_per_epoch):
        assert read_only.cut_sample(0, s)["labels"].tolist() == writable.cut_sample(0, s)["labels"].tolist()
    # megatron-core's reader keeps itself, and its .idx map, in an lru_cache on a method: release the disk
    megatron_datasets()[0]._IndexReader.__getitem__.cache_clear()


def test_run_refuses_bad_shards_before_starting(demo_model, corpus, tmp_path):
    """run_spec (every rank, before any process group): a missing prefix, a list given to a file format, shards
    prepared with another tokenizer."""
    from data.corpus import train_demo_tokenizer
    from tests.helpers import compose_config
    from tests.launch import demo_overrides
    from errors import ConfigError
    from training.run_spec import run_spec
    other = train_demo_tokenizer(demo_model["eval"], tmp_path / "other_tokenizer", 320)
    tokenize_shards.prepare_shards([demo_model["eval"]], str(tmp_path / "other_tokenizer"), str(tmp_path / "other"))

    def spec(**overrides):
        return run_spec(compose_config(demo_overrides(demo_model, tmp_path / "run", **overrides)), 2)
    assert spec(train_file=corpus["prefix"], eval_file=corpus["prefix"], **{"data.format": "indexed"})
    with pytest.raises(ConfigError, match=f"train_file: {tmp_path}/nope.idx does not exist: a corpus is a PREFIX"):
        spec(train_file=f"[{{path: {corpus['prefix']}, weight: 2}}, {{path: {tmp_path / 'nope'}, weight: 1}}]",
             **{"data.format": "indexed"})
    with pytest.raises(ConfigError, match="train_file is a list; only data.format=indexed reads several corpora"):
        spec(train_file=f"[{corpus['prefix']}]")
    with pytest.raises(ConfigError, match=rf"eval_file: {tmp_path}/other: prepared with tokenizer "
                                          rf"'{tmp_path}/other_tokenizer' \(fingerprint "
                                          rf"{tokenizer_fingerprint(other)}\), which differs from this run's"):
        spec(train_file=corpus["prefix"], eval_file=str(tmp_path / "other"), **{"data.format": "indexed"})
