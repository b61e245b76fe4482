"""Tokenize text files once into Megatron-format token shards (PREFIX.bin + PREFIX.idx) for data.format=indexed.

  python prepare_data.py --input 'corpus/*.jsonl' --tokenizer_name_or_path checkpoints/llama-7b-ds \\
      --output_prefix data/web --workers 8

Each document becomes bos + its tokens + eos (the end-of-document token), as the `text` format tokenizes it; the
token dtype is the smallest that holds the vocabulary (uint16 below 65,500 tokens, else int32, as Megatron-LM's
preprocess_data.py chooses), so the shards train under Megatron-LM too and Megatron's train here. Inputs: .jsonl /
.json (one JSON object per line, the text in --text_field), .parquet (that column), .txt (one document per line).

Memory stays bounded: inputs are read in batches of --batch_size documents, at most 2 × --workers batches in flight.
Each input is written to its own part (PREFIX.parts/), renamed into place only when whole; the parts are then
merged into PREFIX.bin/.idx, written under temporary names and renamed, PREFIX.json (the tokenizer, the counts,
the inputs) last. Interrupted, it leaves no half-written shard; run again, it skips the inputs whose parts are
done, and does nothing when PREFIX.json already lists the same inputs and tokenizer. Run with inputs added, it
extends PREFIX (tokenizing only the added ones when they come after the prepared ones). Shards at PREFIX that
PREFIX.json does not describe (Megatron's, another tokenizer's) or that hold documents of an input no longer given
(or changed since) are refused unless --overwrite.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data.tokenize_shards import PrepareError, prepare_shards  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files or glob patterns (quote them)")
    parser.add_argument("--tokenizer_name_or_path", required=True)
    parser.add_argument("--output_prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--text_field", default="text", help="the field holding each document (jsonl, parquet)")
    parser.add_argument("--batch_size", type=int, default=1000, help="documents per tokenizing task")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace PREFIX.bin/.idx that PREFIX.json does not describe, or whose "
                             "documents these inputs would not all hold again")
    args = parser.parse_args(argv)
    try:
        summary = prepare_shards(args.input, args.tokenizer_name_or_path, args.output_prefix, workers=args.workers,
                                 text_field=args.text_field, batch_size=args.batch_size, overwrite=args.overwrite)
    except PrepareError as error:
        raise SystemExit(f"prepare_data.py: {error}") from None
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
