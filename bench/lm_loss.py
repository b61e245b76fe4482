"""The last stage's LM head and loss, forward and backward, at LLaMA 3's vocabulary: memory and speed of each way.

  - logits: the head's full logits, then the cross-entropy in fp32 (loss_impl=logits; the project before issue 28)
  - chunked: the head and loss a chunk of tokens at a time (loss_impl=chunked, loss_chunk_tokens; models/loss.py)
  - chunked+compile: the same with each chunk's elementwise steps (exp, log-sum-exp, softmax) through torch.compile
  - cce: Apple's cut-cross-entropy package (`pip install cut-cross-entropy`), its CPU path (impl=torch_compile)

Memory: the peak RSS rise of one forward + backward over the inputs and weight already in memory, each way in a
fresh process (freed memory stays with the allocator). Speed: tokens/s, median of interleaved rounds in one process.
--whole-step: the peak RSS of a whole 1-stage training step (above the RSS before the model existed) of a small
model with that vocabulary, the trainer's engine with each head against transformers' own loop (bench/layer_overhead.py
builds both), each in a fresh process after one warm-up step.

  python bench/lm_loss.py [--tokens 4096] [--hidden 256] [--vocab 128256] [--chunks 1024 4096] [--rounds 5]
  python bench/lm_loss.py --whole-step
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (MIB, bench_parser, machine_note, parse_args, peak_rss_bytes, peak_rss_rise,  # noqa: E402
                    reset_peak_rss, rss_bytes, spawn, timed_rounds)

VOCAB = 128256  # LLaMA 3's


def loss_function(way, chunk_tokens):
    """(hidden (tokens, H), weight, next-token labels) -> mean loss, one of the ways above."""
    import torch

    from models import loss

    if way == "cce":
        from cut_cross_entropy import linear_cross_entropy
        return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, impl="torch_compile")
    if way == "chunked+compile":
        for name in ("exp_minus_row_max", "group_log_sum_exp", "softmax_minus_target"):
            setattr(loss, name, torch.compile(getattr(loss, name), dynamic=False))
    compute = loss.CausalLMLoss(chunk_tokens=0 if way == "logits" else chunk_tokens)
    # CausalLMLoss shifts labels; give it the labels one position later so both see the same targets.
    shifted = lambda labels: torch.nn.functional.pad(labels, (1, 0), value=-100)[None, :-1]  # noqa: E731
    if way == "logits":
        return lambda hidden, weight, labels: compute(torch.nn.functional.linear(hidden, weight), shifted(labels))
    return lambda hidden, weight, labels: compute((hidden, weight), shifted(labels))


def inputs(tokens, hidden_size, vocab, dtype_name):
    import torch
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype_name)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size ** -0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::7] = -100
    return hidden, weight, labels


def step(function, hidden, weight, labels):
    hidden.grad = weight.grad = None
    function(hidden, weight, labels).backward()


def measure_memory(rank, way, chunk_tokens, tokens, hidden_size, vocab, dtype_name):
    function = loss_function(way, chunk_tokens)
    hidden, weight, labels = inputs(tokens, hidden_size, vocab, dtype_name)
    step(function, hidden, weight, labels)  # warm-up (compilation), then gradients freed
    hidden.grad = weight.grad = None
    return peak_rss_rise(lambda: step(function, hidden, weight, labels))


def measure_speed(rank, ways, tokens, hidden_size, vocab, dtype_name, rounds):
    hidden, weight, labels = inputs(tokens, hidden_size, vocab, dtype_name)
    functions = {label: loss_function(way, chunk) for label, (way, chunk) in ways.items()}
    losses = {}
    for label, function in functions.items():  # warm-up, and every way's loss for the record
        step(function, hidden, weight, labels)
        losses[label] = float(function(hidden, weight, labels))
    times = timed_rounds({label: lambda f=function: step(f, hidden, weight, labels)
                          for label, function in functions.items()}, rounds)
    return {"times": times, "losses": losses}


WHOLE_STEP_MODEL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
WHOLE_STEP_SHAPE = dict(seq_length=1024, micro_batch=4, micro_batches=2)  # 4096 tokens per micro-batch
SMOKE_WHOLE_STEP = (dict(WHOLE_STEP_MODEL, hidden_size=32, intermediate_size=64),
                    dict(seq_length=32, micro_batch=2, micro_batches=2))  # with --smoke's vocabulary


def whole_step_memory(rank, contender, fields, shape):
    from transformers import LlamaConfig

    from layer_overhead import pipeline_step, transformers_step
    from cluster.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    before_model = rss_bytes()
    config = LlamaConfig(**fields)
    step = (transformers_step(config, **shape) if contender == "transformers"
            else pipeline_step(config, False, loss_impl=contender, **shape))
    step()  # optimizer state allocated
    reset_peak_rss()
    step()
    return peak_rss_bytes() - before_model


def compare_whole_steps(fields, shape):
    peaks = {contender: spawn(whole_step_memory, 1, contender, fields, shape)[0]
             for contender in ("transformers", "logits", "chunked")}
    print(f"whole 1-stage training step, vocab {fields['vocab_size']}, hidden {fields['hidden_size']}, "
          f"{fields['num_hidden_layers']} layers, {shape}, fp32, 1 thread: peak RSS above the pre-model RSS")
    for contender, peak in peaks.items():
        name = contender if contender == "transformers" else f"trainer, loss_impl={contender}"
        print(f"  {name:<28} {peak / MIB:>7.0f} MiB  {peak / peaks['transformers']:.3f}x transformers")


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile ways")
    parser.add_argument("--whole-step", action="store_true", help="whole training steps against transformers")
    # the smoke size: the ways without torch.compile (its compilation alone takes minutes of CPU), then whole steps
    args = parse_args(parser, tokens=64, hidden=16, vocab=1024, chunks=[16], rounds=1, no_compile=True)
    if args.whole_step or args.smoke:
        fields, shape = SMOKE_WHOLE_STEP if args.smoke else (WHOLE_STEP_MODEL, WHOLE_STEP_SHAPE)
        compare_whole_steps(dict(fields, vocab_size=args.vocab), shape)
        if args.whole_step:
            print(machine_note())
            return
    ways = {"logits": ("logits", 0)}
    ways.update({f"chunked {c}": ("chunked", c) for c in args.chunks})
    if not args.no_compile:
        ways.update({f"chunked+compile {c}": ("chunked+compile", c) for c in args.chunks})
        try:
            import cut_cross_entropy  # noqa: F401
            ways["cce (torch_compile)"] = ("cce", 0)
        except ImportError:
            print("cut-cross-entropy is not installed: pip install cut-cross-entropy to compare it")
    print(f"LM head + loss, forward + backward: vocab {args.vocab}, {args.tokens} tokens, hidden {args.hidden}, "
          f"1 thread")
    for dtype in args.dtypes:
        peaks = {label: spawn(measure_memory, 1, way, chunk, args.tokens, args.hidden, args.vocab, dtype)[0]
                 for label, (way, chunk) in ways.items()}
        result = spawn(measure_speed, 1, ways, args.tokens, args.hidden, args.vocab, dtype, args.rounds)[0]
        rates = {label: args.tokens / statistics.median(values) for label, values in result["times"].items()}
        print(f"\n{dtype}: {'way':<26} {'peak rise':>10} {'÷ logits':>9} {'tokens/s':>10} {'÷ logits':>9}  "
              f"{'per round':>13}  loss")
        for label in ways:
            spread = [base / t for base, t in zip(result["times"]["logits"], result["times"][label])]
            print(f"{'':>{len(dtype) + 1}} {label:<26} {peaks[label] / MIB:>7.0f} MiB "
                  f"{peaks[label] / peaks['logits']:>8.3f}x "
                  f"{rates[label]:>10.0f} {rates[label] / rates['logits']:>8.3f}x  "
                  f"{min(spread):.3f}-{max(spread):.3f}  {result['losses'][label]:.6f}")
    print(machine_note())


if __name__ == "__main__":
    main()
