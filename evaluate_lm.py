"""lm-evaluation-harness on a checkpoint: export it to Hugging Face format (checkpoints/ds_to_hf.py), score it with
lm-eval's HFLM through its Python API, and append the results to OUTPUT_DIR/lm_eval.jsonl keyed by the checkpoint's
step, beside the run's metrics.jsonl (docs/evaluation.md). Needs `pip install -r requirements-eval.txt`.

  python evaluate_lm.py --ckpt_dir outputs/run --tag global_step200 --tasks hellaswag,arc_easy --limit 500
  python evaluate_lm.py --ckpt_dir outputs/run --tasks tasks/my_task.yaml --max_length 2048   # a local task file
  offline (cluster nodes): HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1, built-in tasks' datasets already in the cache
"""
import argparse
import os
import shutil
import sys
import tempfile


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_dir", required=True,
                        help="a training run's output_dir (or any checkpoint directory holding 'latest')")
    parser.add_argument("--tag", help="checkpoint tag to score (default: the one 'latest' names)")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task, group or tag names and task YAML files")
    parser.add_argument("--include_path", action="append", default=[],
                        help="a directory of task YAML files whose task names --tasks may use (repeatable)")
    parser.add_argument("--limit", type=int, help="score the first N documents of each task")
    parser.add_argument("--num_fewshot", type=int)
    parser.add_argument("--max_length", type=int,
                        help="HFLM's max_length (default: the model's); the run's seq_length scores requests as the "
                             "training loop's eval_tasks do")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    parser.add_argument("--dtype", default="auto", help="HFLM's dtype: auto (the checkpoint's), float32, bfloat16")
    parser.add_argument("--bootstrap_iters", type=int, default=100000, help="lm-eval's, for standard errors; 0: none")
    parser.add_argument("--output_dir", help="where lm_eval.jsonl and the samples go (default: --ckpt_dir)")
    parser.add_argument("--hf_dir", help="keep the Hugging Face export here (default: a temporary directory)")
    parser.add_argument("--log_level", default="info", choices=["info", "debug"],
                        help="debug: lm-eval's, datasets' and transformers' own progress bars and log lines too")
    return parser.parse_args(argv)


def checkpoint_step(tag_dir):
    """The training step a checkpoint holds: its tag's N (global_stepN; a converted model is global_step0)."""
    from checkpoints.tag_dirs import TAG_PATTERN
    match = TAG_PATTERN.match(os.path.basename(os.path.normpath(tag_dir)))
    if match is None:
        raise ValueError(f"{tag_dir} is not a checkpoint tag directory (global_stepN)")
    return int(match.group(1))


def main(argv=None):
    args = parse_args(argv)
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from checkpoints.ds_to_hf import convert_ds_to_hf, lora_record, resolve_tag_dir
    from cluster.console import quiet_libraries
    from evaluation.lm_eval_tasks import QuietHFLM, is_task_file, quiet_lm_eval, task_metrics, write_results

    quiet_libraries(args.log_level)  # one line per result, not the libraries' bars
    if args.log_level != "debug":
        quiet_lm_eval()
    try:
        tag_dir = resolve_tag_dir(args.ckpt_dir, args.tag)
        step = checkpoint_step(tag_dir)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"evaluate_lm: error: {error}")
    tasks = [task for task in args.tasks.split(",") if task]
    manager = TaskManager(include_path=args.include_path or None,
                          include_defaults=not all(is_task_file(task) for task in tasks))
    for task in tasks:  # before the export, which takes minutes on a large model
        if not (os.path.isfile(task) if is_task_file(task) else task in manager.all_tasks):
            sys.exit(f"evaluate_lm: error: {task!r} is neither a task, group or tag of lm-eval (`lm_eval ls tasks`; "
                     f"--include_path adds a directory of task files) nor an existing task YAML file.")
    scratch = None if args.hf_dir else tempfile.mkdtemp(prefix="lm_eval-export-")
    hf_dir = args.hf_dir or os.path.join(scratch, "hf")
    try:
        convert_ds_to_hf(args.ckpt_dir, hf_dir, os.path.basename(tag_dir), overwrite=bool(args.hf_dir),
                         merge_lora=lora_record(tag_dir) is not None)
        model_class = HFLM if args.log_level == "debug" else QuietHFLM
        lm = model_class(pretrained=hf_dir, device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                         batch_size=args.batch_size, max_length=args.max_length, dtype=args.dtype)
        results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=args.limit,
                                  num_fewshot=args.num_fewshot, bootstrap_iters=args.bootstrap_iters,
                                  log_samples=True)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print(make_table(results))
    output_dir = args.output_dir or args.ckpt_dir
    write_results(output_dir, step, "hf_export", task_metrics(results), results["samples"])
    print(f"step {step}: results appended to {os.path.join(output_dir, 'lm_eval.jsonl')}")


if __name__ == "__main__":
    main()
