"""Token shards (data.format=indexed, issue 43): what tokenizing once costs, what start-up costs at 10^9 tokens, and
how closely a blend follows its weights.

1. Tokenizer throughput (tokens/s, wall time including start-up) on the same generated text: prepare_data.py
   with 1 and 2 workers (--workers) against today's path, build_dataset's cached `datasets.map` passes (data.format=text,
   data.num_proc 1 and 2; they also pack blocks, a small share of their time).
2. Time to first step (launch to step 1's metrics line) and peak RSS: `trainer_pipe.py` (1 process, the tiny model, max_steps=1) on a synthetic corpus
   of 10^9 tokens in 10^6 documents against one of 10^7 tokens in 10^4 documents, both written straight with
   numpy and megatron-core's index writer (not tokenized). Each runs twice: first the index is built (a one-time
   scan of the tokens for their range, document order, sample cut and order), then --repeats times memory-mapped
   from the cache, alternating between the corpora (other sessions share the machine: read the spread).
3. The blend's proportions after 100, 10,000 and 1,000,000 samples for weights 0.5 / 0.3 / 0.2, and the largest
   distance over every prefix from weight × samples.
4. (--parts first-start) A first start, no index yet and no page of the corpus cached, on one corpus of --big-tokens
   (1.4e10: 26 GiB, more than this machine's memory): without PREFIX.json (the .bin scanned for the token range),
   with the PREFIX.json prepare_data.py writes (no scan), then from the cached index.

  python bench/indexed_data.py [--big-tokens 1e9] [--workdir DIR]   # in a temporary folder under DIR, deleted after
  python bench/indexed_data.py --parts first-start --big-tokens 1.4e10
"""
import json
import os
import shutil
import tempfile
import time

import numpy as np

from common import MIB, bench_parser, demo_model, parse_args, run_python, single_rank_env


def tokenizer_throughput(workdir, lines, workers):
    from transformers import AutoTokenizer

    import data.tokenize_shards as tokenize_shards
    from data.corpus import train_demo_tokenizer, write_demo_corpus
    from data.datasets import build_dataset
    corpus = write_demo_corpus(os.path.join(workdir, "corpus.txt"), lines, seed=0)
    tokenizer_dir = os.path.join(workdir, "tokenizer")
    train_demo_tokenizer(corpus, tokenizer_dir, 384)
    results = {}
    for count in workers:
        start = time.perf_counter()
        summary = tokenize_shards.prepare_shards([str(corpus)], tokenizer_dir, os.path.join(workdir, f"w{count}"),
                                                 workers=count)
        results[f"prepare_data --workers {count}"] = (summary["tokens"], time.perf_counter() - start)
    for num_proc in workers:
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        _, stats = build_dataset(corpus, tokenizer, {"format": "text", "num_proc": num_proc}, 512,
                                 cache_dir=os.path.join(workdir, f"cache{num_proc}"))
        results[f"datasets.map num_proc={num_proc}"] = (stats.examples * 512 + stats.dropped_tokens,
                                                        time.perf_counter() - start)
    for name, (tokens, seconds) in results.items():
        print(f"  {name:28s} {tokens:>10,d} tokens in {seconds:6.1f} s: {tokens / seconds:>10,.0f} tokens/s")


def write_synthetic(prefix, tokens, documents, vocab_size, seed=0):
    """A corpus of `documents` documents (lengths uniform around the mean) totalling `tokens` random ids, written
    in chunks (bounded memory) with megatron-core's index writer."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter
    rng = np.random.default_rng(seed)
    mean = tokens // documents
    lengths = rng.integers(1, 2 * mean, documents).astype(np.int64)
    lengths = np.maximum(1, lengths * tokens // lengths.sum())
    lengths[:tokens - lengths.sum()] += 1  # the rounding's remainder, one token each
    assert lengths.sum() == tokens
    with open(prefix + ".bin", "wb") as f:
        for start in range(0, tokens, 1 << 26):
            rng.integers(3, vocab_size, min(1 << 26, tokens - start), dtype=np.uint16).tofile(f)
    with _IndexWriter(prefix + ".idx", np.uint16) as writer:
        writer.write(lengths.astype(np.int32).tolist(), None, list(range(documents + 1)))


def first_step(workdir, model_dir, prefix, label):
    """(seconds from launch until step 1's metrics line is written, peak RSS MiB, that line) of a 1-process run."""
    output = os.path.join(workdir, "run-" + label)
    start = time.time()
    _, peak, _ = run_python(["trainer_pipe.py", "-cp", "conf", "-cn", "tiny", f"model_name_or_path={model_dir}",
                             f"train_file={prefix}", "eval_file=null", "data.format=indexed", f"output_dir={output}",
                             "num_stages=1", "max_steps=1", "save_steps=0", "export_hf=false",
                             "overwrite_output_dir=true", "micro_batch_size=2", "gradient_accumulation_steps=2",
                             "logging_steps=1", "save_total_limit=1"],
                            single_rank_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"))
    metrics = os.path.join(output, "metrics.jsonl")
    seconds = os.path.getmtime(metrics) - start
    with open(metrics) as f:
        record = json.loads(f.readline())
    shutil.rmtree(output)
    return seconds, peak / MIB, record


def tiny_model(workdir, smoke):
    """The converted tiny model's directory (vocabulary 384)."""
    return demo_model(os.path.join(workdir, "model"), train_lines=300 if smoke else 2000)


def start_up(workdir, small_tokens, big_tokens, repeats, smoke):
    """Both corpora written first; each trained once building its index, then the cached runs alternate between
    them (other sessions' load drifts alike over both)."""
    model = tiny_model(workdir, smoke)
    corpora = {"small": (small_tokens, small_tokens // 1000), "big": (big_tokens, big_tokens // 1000)}
    for label, (tokens, documents) in corpora.items():
        start = time.perf_counter()
        write_synthetic(os.path.join(workdir, label), tokens, documents, 384)
        size = os.path.getsize(os.path.join(workdir, label + ".bin")) / 2**30
        print(f"  {label}: {tokens:.0e} tokens in {documents:.0e} documents ({size:.2f} GiB) written in "
              f"{time.perf_counter() - start:.0f} s")
    runs = {label: [] for label in corpora}
    for attempt in ["index built"] + ["index cached"] * repeats:
        for label in corpora:
            seconds, rss, record = first_step(workdir, os.path.join(model, "ds"), os.path.join(workdir, label), label)
            runs[label].append((seconds, rss))
            print(f"  {label:5s} {attempt:12s}: launch to step 1 logged {seconds:5.1f} s, peak RSS {rss:6.0f} MiB "
                  f"(loss {record['loss']:.3f}, epoch/{label} {record[f'epoch/{label}']})")
    for label in corpora:
        cached = sorted(runs[label][1:])
        print(f"  {label:5s} cached, median of {repeats}: {cached[len(cached) // 2][0]:.1f} s, peak RSS "
              f"{sorted(r for _, r in cached)[len(cached) // 2]:.0f} MiB; index built: {runs[label][0][0]:.1f} s, "
              f"{runs[label][0][1]:.0f} MiB")
    for label in corpora:  # the disk: 2 GiB for 10^9 tokens
        os.remove(os.path.join(workdir, label + ".bin"))


def uncached(path):
    """Drop path's pages from the page cache (this file only: the machine is shared)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def first_start(workdir, tokens, smoke):
    """Launch to step 1 of a first start (no index yet) on one corpus of `tokens` tokens, none of it in the page
    cache: written as Megatron's tools write it (no PREFIX.json: rank 0 scans the .bin for the token range), then,
    the index removed, with the PREFIX.json prepare_data.py writes (it counts the shards: no scan), then cached."""
    model = tiny_model(workdir, smoke)
    prefix = os.path.join(workdir, "first")
    start = time.perf_counter()
    write_synthetic(prefix, tokens, tokens // 1000, 384)
    size = os.path.getsize(prefix + ".bin") / 2**30
    print(f"  {tokens:.1e} tokens in {tokens // 1000:.1e} documents ({size:.1f} GiB; this machine has "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB of memory) written in "
          f"{time.perf_counter() - start:.0f} s")
    for label in ("no PREFIX.json", "PREFIX.json", "index cached"):
        if label == "PREFIX.json":
            shutil.rmtree(prefix + ".index")
            with open(prefix + ".json", "w") as f:
                json.dump({"tokenizer": {"vocab_size": 384}, "documents": tokens // 1000, "tokens": tokens}, f)
        for suffix in (".bin", ".idx"):
            uncached(prefix + suffix)
        seconds, rss, record = first_step(workdir, os.path.join(model, "ds"), prefix, "first")
        print(f"  {label:14s}: launch to step 1 logged {seconds:6.1f} s, peak RSS {rss:6.0f} MiB "
              f"(loss {record['loss']:.3f})")
    os.remove(prefix + ".bin")


def blend_proportions():
    from data.indexed import blend_counts
    weights = np.array([0.5, 0.3, 0.2])
    corpus, _ = blend_counts(weights, 1_000_000)
    counts = np.stack([np.cumsum(corpus == c) for c in range(3)], axis=1)
    for n in (100, 10_000, 1_000_000):
        shares = counts[n - 1] / n
        print(f"  after {n:>9,d} samples: {' / '.join(f'{s:.6f}' for s in shares)} (weights 0.5 / 0.3 / 0.2; "
              f"counts {counts[n - 1].tolist()})")
    distance = np.abs(counts - np.arange(1, len(corpus) + 1)[:, None] * weights).max()
    print(f"  largest |count - weight x samples| over every prefix of 1,000,000: {distance:.3f} samples")


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--big-tokens", type=float, default=1e9)
    parser.add_argument("--small-tokens", type=float, default=1e7, help="part 2's small corpus")
    parser.add_argument("--lines", type=int, default=60_000, help="generated documents to tokenize (part 1)")
    parser.add_argument("--workdir", default=None, help="where the temporary folder goes (default: the system's)")
    parser.add_argument("--repeats", type=int, default=5, help="runs from the cached index (part 2)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="part 1's worker processes (prepare_data --workers, data.num_proc)")
    parser.add_argument("--parts", nargs="+", default=["tokenizer", "start-up", "blend"])
    args = parse_args(parser, big_tokens=4e5, small_tokens=2e5, lines=200, repeats=1, workers=[1])
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="indexed_bench.") as workdir:
        if "tokenizer" in args.parts:
            print("1. tokenizer throughput (wall time from start, tokenizer load included)")
            tokenizer_throughput(workdir, args.lines, args.workers)
        if "start-up" in args.parts:
            print("2. time to first step and peak RSS, 1 process, tiny model, seq_length 128")
            start_up(workdir, int(args.small_tokens), int(args.big_tokens), args.repeats, args.smoke)
        if "first-start" in args.parts:
            print("4. a first start on a corpus larger than the page cache (--big-tokens), 1 process, tiny model")
            first_start(workdir, int(args.big_tokens), args.smoke)
        if "blend" in args.parts:
            print("3. blend proportions")
            blend_proportions()
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")

if __name__ == "__main__":
    main()
