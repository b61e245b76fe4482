"""In-loop lm-eval scoring (eval_tasks, evaluation/lm_eval_tasks.py) against the training forward pass on the same
engine, and against lm-eval's HFLM with transformers on the same model's Hugging Face directory (what evaluate_lm.py
runs on an export): requests/s and tokens/s, on the CPU, 1 process, 1 stage, fp32, 1 thread.

The tasks are the demo's (scripts/make_demo_tasks.py: a multiple-choice, a log-likelihood and a rolling
log-likelihood task) over a generated corpus, tokenized with a SentencePiece tokenizer trained on it; the model has
random weights (throughput does not depend on them). Rounds interleave the three contenders; medians are printed.
Tokens: the requests' own tokens (context + continuation, cut to seq_length + 1) per second; the in-loop rows are
padded to seq_length, so its padded tokens/s is printed too, beside the forward pass's (every row full).

    python bench/lm_eval_throughput.py [--rounds 3] [--docs 100] [--seq 128]
"""
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_parser, machine_note, parse_args, random_micro_batches, run_config,  # noqa: E402
                    single_rank_env, timed_rounds)

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=100, help="documents per task")
    parser.add_argument("--seq", type=int, default=128, help="seq_length (and HFLM's max_length)")
    parser.add_argument("--micro-batch", type=int, default=8, help="micro_batch_size, and HFLM's batch_size")
    parser.add_argument("--corpus-lines", type=int, default=2000, help="the generated corpus the tasks come from")
    args = parse_args(parser, rounds=1, docs=4, seq=32, micro_batch=2, corpus_lines=300)
    os.environ.update(single_rank_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
    import torch
    from lm_eval.evaluator import evaluate as lm_eval_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from data.corpus import train_demo_tokenizer, write_demo_corpus
    from scripts.make_demo_tasks import write_tasks
    from cluster.distributed import init_distributed
    from evaluation.lm_eval_tasks import LmEvalTasks, PipelineLM, run_task
    from training.loop import build_engine
    from training.run_spec import plan_spec
    torch.set_num_threads(1)

    work = tempfile.mkdtemp(prefix="lm_eval_bench-")
    corpus = write_demo_corpus(os.path.join(work, "text.txt"), args.corpus_lines, seed=0)
    tokenizer = train_demo_tokenizer(corpus, os.path.join(work, "hf"), 384)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(work, "hf"))
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=args.seq, **MODEL,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(os.path.join(work, "hf"))
    tasks = list(write_tasks(corpus, os.path.join(work, "tasks"), args.docs).values())

    cfg = run_config([f"seq_length={args.seq}", f"micro_batch_size={args.micro_batch}", "precision=fp32",
                      "zero_stage=0", "gradient_accumulation_steps=4", f"output_dir={work}/run",
                      f"eval_tasks=[{','.join(tasks)}]"])
    init_distributed(timeout_minutes=10)
    engine, _ = build_engine(plan_spec(cfg, 1, config), 1, layer_loader=None)
    in_loop = LmEvalTasks(cfg, tokenizer, log=lambda line: None)
    counter = PipelineLM(tokenizer, args.seq)  # the requests and their tokens, counted once
    for task, task_dict in in_loop.tasks:
        run_task(counter, task, task_dict)
    requests, request_tokens = counter.requests, counter.tokens
    rows = -(-requests // args.micro_batch) * args.micro_batch
    batches = random_micro_batches(config.vocab_size, args.seq, args.micro_batch)
    hflm = HFLM(pretrained=os.path.join(work, "hf"), device="cpu", batch_size=args.micro_batch,
                max_length=args.seq, dtype="float32")
    task_dict = TaskManager(include_defaults=False).load(tasks)  # loaded once, as the in-loop tasks are

    forward_steps = rows // args.micro_batch // cfg.gradient_accumulation_steps + 1
    forward_rows = forward_steps * cfg.gradient_accumulation_steps * args.micro_batch

    def forward():
        for _ in range(forward_steps):
            engine.eval_batch(batches, reduce_output=None, bcast_loss=False)
    timings = timed_rounds({"in-loop eval_tasks": lambda: in_loop.evaluate(engine, cfg, pad_id=0, reads_data=True),
                            "training forward (eval_batch)": forward,
                            "lm_eval HFLM": lambda: lm_eval_evaluate(hflm, task_dict, bootstrap_iters=0)},
                           args.rounds)
    timings["training forward (eval_batch)"] = [seconds / forward_rows * rows  # the rows the loop scores
                                                for seconds in timings["training forward (eval_batch)"]]

    print(f"{len(tasks)} tasks x {args.docs} documents: {requests} requests (rolling windows included), "
          f"{request_tokens} request tokens; seq_length {args.seq}, micro-batch {args.micro_batch}; model "
          f"{sum(p.numel() for p in engine.module.parameters()) / 1e6:.1f}M parameters, fp32, 1 thread")
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        padded = rows * args.seq / median
        line = f"  {name:31s} {median:6.2f} s  {requests / median:7.1f} requests/s"
        if name == "training forward (eval_batch)":
            line += f"  {padded:8.0f} tokens/s (full rows; the same {rows} rows of {args.seq})"
        else:
            line += f"  {request_tokens / median:8.0f} request tokens/s"
            if name == "in-loop eval_tasks":
                line += f"  {padded:8.0f} padded tokens/s"
        print(line + f"  (rounds {', '.join(f'{s:.2f}' for s in seconds)})")
    print(machine_note())


if __name__ == "__main__":
    main()
