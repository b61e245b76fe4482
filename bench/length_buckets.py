"""Length buckets: real (non-padding) tokens trained per second with data.length_buckets, against every row padded
to seq_length and against data.packing, on a ragged chat set, through a pipeline.

The chat set is bench/packing_efficiency.py's (90% one short exchange, a few conversations near seq_length, ChatML
template). Each contender builds its rows through the project's data path (data/datasets.py, data/loader.py with
or without buckets, data/collator.py) and trains its own copy of one model (random weights, fp32, `--stages`
pipeline stages of one process each, 1F1B) step by step as the trainer does (training/token_mean.py step_totals,
engines/sequence_length.py: a bucketed step of another length than the last re-sizes the pipeline's buffers); the
contenders' steps alternate, so that all see the same machine load. A real token is one of a row's own tokens (not
padding); a learned one, one the loss learns (an assistant token).

  python bench/length_buckets.py [--stages 2] [--steps 12] [--examples 2000] [--buckets 64 96 128 192]
"""
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, in_rounds, machine_note, parse_args, run_config, spawn, timed  # noqa: E402
from packing_efficiency import GAS, MICRO_BATCH, MODEL, SEQ_LENGTH, SMOKE_MODEL, chat_set  # noqa: E402

CONTENDERS = ("padded", "buckets", "packing")


def counted(stream, counts):
    """The stream's micro-batches; counts gets each one's (real tokens, learned tokens, width)."""
    for batch in stream:
        (_, document_ids, _), labels = batch
        counts.append((int((document_ids != 0).sum()), int((labels[:, 1:] != -100).sum()), document_ids.shape[1]))
        yield batch


def worker(rank, model, data_file, cache_dir, stages, steps, buckets):
    import deepspeed
    import torch
    from transformers import LlamaConfig

    from cluster.distributed import init_distributed, parallel_topology
    from data import build_dataset_distributed, build_stage_loader, infinite_micro_batches
    from data.length_buckets import LengthBuckets, bucket_bounds, row_lengths
    from engines.sequence_length import use_sequence_length
    from models.pipeline import build_pipeline_module
    from tests.chat_tokenizers import make_chat_tokenizer
    from training.deepspeed_config import deepspeed_config
    from training.token_mean import step_micro_batches, step_totals, token_mean_micro_batches

    init_distributed(timeout_minutes=5)
    tokenizer = make_chat_tokenizer("chatml")
    cfg = run_config(["precision=fp32", "zero_stage=0", f"seq_length={SEQ_LENGTH}", f"micro_batch_size={MICRO_BATCH}",
                      f"gradient_accumulation_steps={GAS}", "lr_scheduler=constant", f"num_stages={stages}"])
    runs, stats = {}, {}
    for name in CONTENDERS:
        torch.manual_seed(0)  # the same weights for each
        module = build_pipeline_module(LlamaConfig(vocab_size=len(tokenizer), **model), parallel_topology(stages),
                                       row_layout="packed" if name == "packing" else "padded")
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                               config=deepspeed_config(cfg, total_steps=10**6)[0])
        data = {"format": "chat", "packing": name == "packing"}
        dataset, built = build_dataset_distributed(data_file, tokenizer, data, SEQ_LENGTH, cache_dir=cache_dir,
                                                   limit_minutes=5)
        grouped = (LengthBuckets(bucket_bounds(buckets, SEQ_LENGTH), row_lengths(dataset), MICRO_BATCH * GAS, seed=0)
                   if name == "buckets" else None)
        loader = build_stage_loader(dataset, reads_data=True, dp_rank=0, dp_size=1, micro_batch_size=MICRO_BATCH,
                                    seq_length=SEQ_LENGTH, pad_id=tokenizer.pad_token_id, seed=0, buckets=grouped)
        counts = []
        runs[name] = (engine, counted(infinite_micro_batches(loader), counts), counts)
        stats[name] = {"rows": built.examples}

    def step(name):
        engine, stream, _ = runs[name]
        micro_batches = step_micro_batches(engine, stream, GAS)
        totals = step_totals(engine, micro_batches)
        use_sequence_length(engine, totals.width)
        engine.train_batch(iter(token_mean_micro_batches(engine, micro_batches, totals.units)))

    for name in CONTENDERS:  # warm-up
        step(name)
    seconds = in_rounds({name: lambda name=name: timed(lambda: step(name)) for name in CONTENDERS}, steps)
    result = {}
    for name in CONTENDERS:
        counts = runs[name][2][GAS:]  # after the warm-up step
        real, learned, positions = (sum(c[i] * (MICRO_BATCH if i == 2 else 1) for c in counts) for i in range(3))
        widths = [c[2] for c in counts[::GAS]]
        result[name] = {**stats[name], "real_share": real / positions, "real_tokens_per_s": real / sum(seconds[name]),
                        "learned_tokens_per_s": learned / sum(seconds[name]), "median_step_s":
                        statistics.median(seconds[name]), "mean_width": statistics.mean(widths),
                        "widths": sorted(set(widths))}
    return result


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--buckets", type=int, nargs="+", default=[64, 96, 128, 192])
    args = parse_args(parser, steps=1, examples=50)
    model = SMOKE_MODEL if args.smoke else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "chat.jsonl")
        chat_set(data_file, args.examples)
        result = spawn(worker, args.stages, model, data_file, os.path.join(tmp, "cache"), args.stages, args.steps,
                       args.buckets)[0]
    for name, row in result.items():
        print(f"{name}: {row['rows']} rows, steps {row['mean_width']:.0f} positions wide on average (widths "
              f"{row['widths']}), {100 * row['real_share']:.1f}% of the positions real, {row['median_step_s']:.3f} "
              f"s/step, {row['real_tokens_per_s']:.0f} real tokens/s, {row['learned_tokens_per_s']:.0f} learned "
              f"tokens/s")
    padded = result["padded"]["real_tokens_per_s"]
    print(f"real tokens/s against padding to seq_length: buckets {args.buckets} "
          f"{result['buckets']['real_tokens_per_s'] / padded:.2f}x, packing "
          f"{result['packing']['real_tokens_per_s'] / padded:.2f}x (model hidden {model['hidden_size']}, "
          f"{model['num_hidden_layers']} layers, seq {SEQ_LENGTH}, {GAS}x{MICRO_BATCH} micro-batches, fp32, "
          f"{args.stages} stage(s) of one process, 1F1B); {machine_note()}")


if __name__ == "__main__":
    main()
