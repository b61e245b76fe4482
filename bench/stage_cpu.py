"""The CPU seconds of one micro-batch's forward and backward through a 1-stage pipeline module (the model's layers
and the chunked head and loss, no engine or optimizer), SmolLM2-135M's shape with random weights, fp32, one thread;
alternating this tree's code with a commit's (--against: its tree written out by `git archive`, each side run in a
fresh interpreter of its own tree), the order reversed every other round. CPU seconds of the one thread, which a
shared host's load changes less than wall time; each process times --reps forwards and backwards after one.

  python bench/stage_cpu.py [--rounds 6] [--reps 3] [--against COMMIT]
"""
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0)
SMOKE = dict(SMOLLM2, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
SEQ_LENGTH, ROWS = 256, 2


def measure(tree, reps, smoke):
    """This process's CPU seconds of each of `reps` forwards and backwards, after one, on `tree`'s code (nothing of
    this tree imported before it)."""
    sys.path.insert(0, tree)
    import time

    import torch
    from transformers import LlamaConfig

    from cluster.distributed import init_distributed, parallel_topology
    from data.collator import collate_causal_lm
    from models.pipeline import build_pipeline_module

    torch.set_num_threads(1)
    init_distributed(timeout_minutes=5)
    config = LlamaConfig(**(SMOKE if smoke else SMOLLM2))
    torch.manual_seed(0)
    module = build_pipeline_module(config, parallel_topology(1), loss_chunk_tokens=1024, row_layout="padded")
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(3, config.vocab_size, (SEQ_LENGTH,), generator=generator).tolist() for _ in range(ROWS))]
    inputs, labels = collate_causal_lm(rows, SEQ_LENGTH, pad_id=0)
    times = []
    for _ in range(reps + 1):
        start = time.thread_time()
        module.loss_fn(module(inputs), labels).backward()
        times.append(time.thread_time() - start)
    print("CPU s", *(f"{t:.4f}" for t in times[1:]))


def side(tree, reps, smoke):
    """[CPU seconds of each rep] of a fresh interpreter on `tree`'s code."""
    from common import run_python, single_rank_env
    args = [os.path.abspath(__file__), "--measure", tree, "--reps", reps] + (["--smoke"] if smoke else [])
    result, _, _ = run_python(args, env=single_rank_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    line = next(line for line in result.stdout.splitlines() if line.startswith("CPU s "))
    return [float(value) for value in line.split()[2:]]


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import bench_parser, machine_note, parse_args
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--against", default=None, help="a commit whose tree to alternate with")
    args = parse_args(parser, rounds=1, reps=1)
    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as other:
        if args.against:
            archive = subprocess.run(["git", "archive", args.against], cwd=ROOT, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", other], input=archive.stdout, check=True)
            trees[args.against] = other
        results = {name: [] for name in trees}
        for round_index in range(args.rounds):
            for name, tree in list(trees.items())[::1 if round_index % 2 == 0 else -1]:
                results[name].append(side(tree, args.reps, args.smoke))
    for name, rounds in results.items():
        medians = [statistics.median(reps) for reps in rounds]
        print(f"{name}: CPU s per micro-batch median {statistics.median(medians):.3f} (rounds "
              f"{min(medians):.3f}-{max(medians):.3f})")
    if args.against:
        ratios = [statistics.median(mine) / statistics.median(theirs)
                  for mine, theirs in zip(results["this tree"], results[args.against])]
        print(f"this tree / {args.against}: {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-"
              f"{max(ratios):.3f})")
    print(machine_note())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:  # one side: --measure TREE --reps N [--smoke]
        measure(sys.argv[2], int(sys.argv[4]), "--smoke" in sys.argv)
    else:
        main()
