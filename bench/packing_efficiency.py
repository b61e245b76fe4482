"""Packing efficiency: real tokens trained per second with data.packing=true against false on a chat set.

The chat set has skewed lengths, as real ones do: most conversations are one short exchange, a few fill nearly
seq_length. Both contenders build their rows through the project's data path (data.format=chat with a ChatML
template, data/datasets.py; rows collated by data/collator.py) and train the same 1-stage model (random weights,
fp32, one process) at the same seq_length and micro-batch size; steps alternate between them. A real token is one
the loss learns: an assistant token, not padding, not the prompt or the template's headers.

  python bench/packing_efficiency.py [--steps 8] [--examples 2000]
"""
import json
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, machine_note, parse_args, run_config, spawn, timed_rounds  # noqa: E402

SEQ_LENGTH, MICRO_BATCH, GAS = 256, 4, 4
MODEL = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=SEQ_LENGTH)
SMOKE_MODEL = dict(MODEL, hidden_size=32, intermediate_size=64, num_hidden_layers=2)  # --smoke's
WORDS = "the a cat dog river garden ball red small found carried home near story count one two three".split()


def chat_set(path, examples, seed=0):
    """90% one short exchange (a few to 30 words each side), 10% several long turns up to about seq_length."""
    rng = random.Random(seed)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."  # noqa: E731
    with open(path, "w") as f:
        for _ in range(examples):
            turns = 1 if rng.random() < 0.9 else rng.randint(2, 3)
            words = (lambda: rng.randint(3, 30)) if turns == 1 else (lambda: rng.randint(10, 18))
            messages = [message for _ in range(turns) for message in (
                {"role": "user", "content": sentence(words())}, {"role": "assistant", "content": sentence(words())})]
            f.write(json.dumps({"messages": messages}) + "\n")


def counting_learned_tokens(batches):
    """(the micro-batches, a list that gets each handed-out micro-batch's learned-token count: the loss's count)."""
    learned = []
    return (learned.append(int((labels[:, 1:] != -100).sum())) or (inputs, labels) for inputs, labels in batches), \
        learned


def worker(rank, model, data_file, cache_dir, steps):
    import deepspeed
    from transformers import LlamaConfig

    from data import build_dataset, build_stage_loader, infinite_micro_batches
    from models.pipeline import build_pipeline_module
    from tests.chat_tokenizers import make_chat_tokenizer
    from training.deepspeed_config import deepspeed_config
    from cluster.distributed import init_distributed, parallel_topology

    init_distributed(timeout_minutes=5)
    tokenizer = make_chat_tokenizer("chatml")
    cfg = run_config(["precision=fp32", "zero_stage=0", f"seq_length={SEQ_LENGTH}", f"micro_batch_size={MICRO_BATCH}",
                      f"gradient_accumulation_steps={GAS}", "lr_scheduler=constant"])
    module = build_pipeline_module(LlamaConfig(vocab_size=len(tokenizer), **model), parallel_topology(1))
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=deepspeed_config(cfg, total_steps=10**6)[0])
    contenders, stats = {}, {}
    for packing in (False, True):
        dataset, built = build_dataset(data_file, tokenizer, {"format": "chat", "packing": packing}, SEQ_LENGTH,
                                       cache_dir=cache_dir)
        loader = build_stage_loader(dataset, reads_data=True, dp_rank=0, dp_size=1, micro_batch_size=MICRO_BATCH,
                                    seq_length=SEQ_LENGTH, pad_id=tokenizer.pad_token_id, seed=0)
        contenders[packing] = counting_learned_tokens(infinite_micro_batches(loader))
        stats[packing] = {"rows": built.examples, "real_token_share": built.real_tokens / built.examples / SEQ_LENGTH}
    steps_of = {packing: lambda batches=batches: engine.train_batch(batches)
                for packing, (batches, _) in contenders.items()}
    for step in steps_of.values():  # warm-up
        step()
    seconds = timed_rounds(steps_of, steps)  # alternating, so that both see the same machine load
    result = {}
    for packing in (False, True):
        learned = contenders[packing][1][GAS:]  # after the warm-up step
        result[str(packing).lower()] = {
            **stats[packing], "learned_tokens_per_step": sum(learned) / steps,
            "median_step_s": statistics.median(seconds[packing]),
            "real_tokens_per_s": sum(learned) / sum(seconds[packing])}
    return result


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--examples", type=int, default=2000)
    args = parse_args(parser, steps=1, examples=50)
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "chat.jsonl")
        chat_set(data_file, args.examples)
        model = SMOKE_MODEL if args.smoke else MODEL
        result = spawn(worker, 1, model, data_file, os.path.join(tmp, "cache"), args.steps)[0]
    for name, row in result.items():
        print(f"packing={name}: {row['rows']} rows of {SEQ_LENGTH}, {100 * row['real_token_share']:.1f}% of row tokens "
              f"real, {row['learned_tokens_per_step']:.0f} learned tokens/step, {row['median_step_s']:.3f} s/step, "
              f"{row['real_tokens_per_s']:.0f} learned tokens/s")
    speedup = result["true"]["real_tokens_per_s"] / result["false"]["real_tokens_per_s"]
    print(f"learned tokens/s, packing true / false: {speedup:.2f}x (model hidden {model['hidden_size']}, "
          f"{model['num_hidden_layers']} layers, seq {SEQ_LENGTH}, {GAS}x{MICRO_BATCH} micro-batches, fp32, "
          f"1 process); {machine_note()}")


if __name__ == "__main__":
    main()
