"""Write small lm-evaluation-harness tasks over a text file's lines (the demo's held-out eval.txt), as task YAML
over local JSONL (docs/evaluation.md): what the demo scores before and after training, and what the tests compare
with lm-eval's HFLM.

  python scripts/make_demo_tasks.py --text work/tiny/eval.txt --output_dir work/tiny/tasks --docs 100
writes, in OUTPUT_DIR:
- demo_cloze.yaml (multiple_choice, acc / acc_norm): a line's first words; which of 2 to 4 continuations (the
  line's own next words, or another line's, of other lengths) comes next;
- demo_next_words.yaml (loglikelihood, perplexity / acc): a line's first words -> its next words (the first
  document has an empty context: lm-eval scores it after the BOS token). The next words are the grammar's random
  picks, so no model predicts them all (acc stays near 0, perplexity, of whole continuations, in the millions):
  the tests use it for lm-eval's log-likelihood path, the demo does not show it;
- demo_lines.yaml (loglikelihood_rolling, word_perplexity / byte_perplexity / bits_per_byte): whole lines; what the
  demo shows beside demo_cloze (bits per byte 3.7 untrained, 1.1 after scripts/demo.sh's 60 steps).
"""
import argparse
import json
import os
import random

def metrics(*names):
    """lm-eval's metric_list entries, with the aggregation and direction lm-eval would otherwise warn it assumes."""
    aggregation = {"acc": "mean", "acc_norm": "mean", "perplexity": "perplexity", "word_perplexity":
                   "weighted_perplexity", "byte_perplexity": "weighted_perplexity", "bits_per_byte": "bits_per_byte"}
    return [{"metric": name, "aggregation": aggregation[name], "higher_is_better": name.startswith("acc")}
            for name in names]


TASKS = {
    "demo_cloze": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                   "doc_to_target": "{{answer}}", "metric_list": metrics("acc", "acc_norm")},
    "demo_next_words": {"output_type": "loglikelihood", "doc_to_text": "{{context}}",
                        "doc_to_target": "{{continuation}}", "metric_list": metrics("perplexity", "acc")},
    "demo_lines": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                   "metric_list": metrics("word_perplexity", "byte_perplexity", "bits_per_byte")},
}


def documents(lines, docs, seed):
    """{task: [document]} from lines of at least 6 words."""
    rng = random.Random(seed)
    lines = [line.split() for line in lines if len(line.split()) >= 6][:docs]
    cloze, next_words = [], []
    for index, words in enumerate(lines):
        cut = rng.randint(2, len(words) - 3)
        length = rng.randint(1, min(4, len(words) - cut))
        context, answer = " ".join(words[:cut]), " ".join(words[cut:cut + length])
        others = [other for other in lines if other is not words]
        wrong = [" ".join(other[rng.randint(0, len(other) - 5):][:rng.randint(1, 5)])
                 for other in rng.sample(others, rng.randint(1, 3))]  # ragged: 2-4 choices of 1-5 words
        choices = wrong + [answer]
        rng.shuffle(choices)
        cloze.append({"context": context, "choices": choices, "answer": choices.index(answer)})
        next_words.append({"context": "" if index == 0 else context, "continuation": answer})
    return {"demo_cloze": cloze, "demo_next_words": next_words,
            "demo_lines": [{"text": " ".join(words)} for words in lines]}


def write_tasks(text_path, output_dir, docs=100, seed=0):
    """Write the three tasks' JSONL and YAML into output_dir; returns {task: its YAML path}."""
    with open(text_path) as f:
        lines = f.read().splitlines()
    os.makedirs(output_dir, exist_ok=True)
    paths = {}
    for task, rows in documents(lines, docs, seed).items():
        data = os.path.abspath(os.path.join(output_dir, f"{task}.jsonl"))
        with open(data, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        config = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                  "test_split": "test", **TASKS[task]}
        paths[task] = os.path.join(output_dir, f"{task}.yaml")
        with open(paths[task], "w") as f:
            json.dump(config, f, indent=1)  # JSON is YAML
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="work/tiny/eval.txt")
    parser.add_argument("--output_dir", default="work/tiny/tasks")
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_tasks(args.text, args.output_dir, args.docs, args.seed)
    print(f"wrote {args.output_dir}: {', '.join(os.path.basename(path) for path in paths.values())}")


if __name__ == "__main__":
    main()
