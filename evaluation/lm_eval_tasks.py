"""lm-evaluation-harness tasks (`eval_tasks`) scored through the pipeline engine during training, as lm-eval's HFLM
scores them on the exported model (docs/evaluation.md).

lm-eval does everything but the forward pass: it loads the tasks (TaskManager), builds their requests, tokenizes
them (HFLM's own tok_encode, _encode_pair, empty-context prefix and rolling windows: PipelineLM is an HFLM without a
transformers model), and computes the metrics. Each (context, continuation) becomes one row, cut from the left to
seq_length + 1 tokens as HFLM's _loglikelihood_tokens cuts it to max_length + 1; the rows are split over the
data-parallel replicas, and the last stage sums each continuation's log-probabilities from the chunked head
(models/loss.py ContinuationScores). Every rank runs lm-eval's evaluation whole and receives every score, so every
rank computes the same metrics; rank 0 logs them.

lm-eval is an optional extra (requirements-eval.txt): this module is imported only when eval_tasks is set.
"""
import contextlib
import functools
import json
import logging
import os
import sys
from pathlib import Path

import lm_eval.api.task
import lm_eval.tasks
import torch
from lm_eval.api.model import LM
from lm_eval.evaluator import evaluate as lm_eval_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from checkpoints.files import write_text_atomic
from data.formats import IGNORE_INDEX
from models.loss import ContinuationScores
from errors import ConfigError
from evaluation.eval_set import score_examples
from evaluation.eval_task import EvalTask
from evaluation.lm_eval_log import LM_EVAL_FILE, LM_EVAL_PLOT_FILE, plot_lm_eval

SAMPLES_DIR = "lm_eval_samples"  # per request: its arguments, log-likelihoods and metrics
SCORED_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")
EXPORT_COMMAND = "python evaluate_lm.py --ckpt_dir OUTPUT_DIR --tag global_stepN --tasks"



def load_tasks(eval_tasks, output_dir):
    """[(EvalTask, lm-eval's task dict)], or a ConfigError naming the task and what to change. Names need lm-eval's
    task index (slow to build: lm-eval reads every task's YAML); task files alone are loaded without it."""
    files = [task.spec for task in eval_tasks if is_task_file(task.spec)]
    for path in files:
        if not os.path.isfile(path):
            raise ConfigError(f"eval_tasks: task file {path} does not exist; give an existing task YAML or the name "
                              f"of an lm-eval task.")
    unwritten = names_written_in_no_lm_eval_task([task.spec for task in eval_tasks if not is_task_file(task.spec)])
    if unwritten:
        raise unknown_task(unwritten[0])
    manager = TaskManager(include_defaults=len(files) < len(eval_tasks))
    loaded = []
    for task in eval_tasks:
        try:
            task_dict = manager.load([task.spec])
        except Exception as error:  # lm-eval's: a KeyError for a name, anything from YAML, Jinja or datasets
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            if is_task_file(task.spec):
                raise ConfigError(f"eval_tasks: task file {task.spec} does not load ({reason}); fix it (lm-eval's "
                                  f"task YAML format, docs/evaluation.md).") from None
            if task.spec not in manager.all_tasks:
                raise unknown_task(task.spec) from None
            raise ConfigError(f"eval_tasks: {task.spec} does not load ({reason}); offline, its dataset must be in the "
                              f"Hugging Face datasets cache first (docs/evaluation.md, Offline).") from None
        for name, lm_task in task_dict["tasks"].items():
            if lm_task.OUTPUT_TYPE not in SCORED_TYPES:
                raise ConfigError(
                    f"eval_tasks: {name} is a {lm_task.OUTPUT_TYPE} task; the training loop scores log-likelihood "
                    f"and multiple-choice tasks only. Score it on a checkpoint's export instead: "
                    f"{EXPORT_COMMAND.replace('OUTPUT_DIR', output_dir)} {task.spec}")
        loaded.append((task, task_dict))
    return loaded


def is_task_file(spec):
    return spec.endswith((".yaml", ".yml"))


def names_written_in_no_lm_eval_task(names):
    """The names (in order) that no task YAML of lm-eval's contains, its files read once for all of them: every task,
    group and tag name of its index is written in one (its task, group or tag key), so a name in none is not one,
    known in a second without the index."""
    unseen = set(names)
    for path in Path(lm_eval.tasks.__file__).parent.glob("**/*.yaml"):
        if not unseen:
            break
        text = path.read_bytes()
        unseen -= {name for name in unseen if name.encode() in text}
    return [name for name in names if name in unseen]


def unknown_task(name):
    return ConfigError(f"eval_tasks: {name!r} is not a task, group or tag of lm-eval {lm_eval_version()} "
                       f"(`lm_eval ls tasks` lists them), nor a task YAML file.")


def lm_eval_version():
    from importlib.metadata import version
    return version("lm_eval")


def quiet_lm_eval():
    """lm-eval without its own progress bars: its models' request bars follow their disable_tqdm (PipelineLM and
    QuietHFLM always pass true), but building a task's requests draws one bar per task and call (on every rank, in
    the loop), and lm-eval offers no switch for it."""
    lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)


class QuietHFLM(HFLM):
    """lm-eval's HFLM without its progress bars (evaluate_lm.py's console)."""

    def loglikelihood(self, requests, disable_tqdm=False):
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        return super().loglikelihood_rolling(requests, disable_tqdm=True)

    def generate_until(self, requests, disable_tqdm=False):
        return super().generate_until(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        # HFLM's loglikelihood_rolling asks for a bar per document's windows whatever its own disable_tqdm
        return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)


class PipelineLM(HFLM):
    """HFLM with the pipeline engine in place of the transformers model: HFLM's tokenization and request handling,
    each batch of (context, continuation) token lists scored by the engine (every rank calls it; a rank that reads no
    data passes reads_data=False). engine=None: nothing is scored (log-likelihoods 0), only counted: the start-up
    check of the requests. To lm-eval every rank is rank 0 of a world of one: the data-parallel split is ours."""

    def __init__(self, tokenizer, seq_length, engine=None, cfg=None, pad_id=0, reads_data=True):
        LM.__init__(self)  # not HFLM's, which loads a transformers model
        self.tokenizer, self._max_length = tokenizer, seq_length
        self.add_bos_token, self.custom_prefix_token_id, self.enable_thinking = None, None, None  # HFLM's defaults
        self.backend = "causal"
        self.batch_size_per_gpu = sys.maxsize  # loglikelihood_rolling: every window in one call
        self.engine, self.cfg, self.pad_id, self.reads_data = engine, cfg, pad_id, reads_data
        self.requests = self.tokens = self.truncated = 0  # rows scored, their tokens, rows cut to the length

    def loglikelihood(self, requests, disable_tqdm=False):
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        return super().loglikelihood_rolling(requests, disable_tqdm=True)

    def generate_until(self, requests, disable_tqdm=False):
        raise NotImplementedError("generation tasks are scored on the export (evaluate_lm.py), not in the loop")

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        """[(log-likelihood, is_greedy)] of each (strings, context tokens, continuation tokens), in order."""
        rows = [continuation_row(context, continuation, self.max_length) for _, context, continuation in requests]
        self.requests += len(rows)
        self.tokens += sum(len(row["input_ids"]) for row in rows)
        self.truncated += sum(len(context) + len(continuation) > self.max_length + 1
                              for _, context, continuation in requests)
        if self.engine is None:
            return [(0.0, False)] * len(rows)
        return [(log_likelihood, misses == 0) for log_likelihood, misses in self.score_rows(rows).tolist()]

    def score_rows(self, rows):
        """(rows, 2): each row's continuation log-likelihood and tokens off the top logit, through the engine."""
        with scoring_loss(self.engine.module, self.max_length):
            return score_examples(self.engine, rows if self.reads_data else None, len(rows), self.cfg, self.pad_id,
                                  width=2, desc="lm-eval")


def continuation_row(context, continuation, max_length):
    """One request as a row of at most max_length tokens whose labels (one wider: the last position predicts the
    continuation's last token) are the continuation's tokens: HFLM's (context + continuation)[-(max_length + 1):]."""
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens is longer than seq_length={max_length}")
    whole = (context + continuation)[-(max_length + 1):]
    return {"input_ids": whole[:-1], "labels": [IGNORE_INDEX] * (len(whole) - len(continuation)) + continuation}


@contextlib.contextmanager
def scoring_loss(module, seq_length):
    """The pipeline's loss_fn returning each row's continuation scores, the training one put back after."""
    training_loss = module.loss_fn
    module.loss_fn = ContinuationScores(training_loss.parallel, training_loss.chunk_tokens, training_loss.context,
                                        seq_length, training_loss.logit_cap,
                                        multi_token=getattr(training_loss, "mtp_scale", 0.0) > 0)
    try:
        yield
    finally:
        module.loss_fn = training_loss


class LmEvalTasks:
    """The run's eval_tasks, loaded and checked before training; scored through the engine on every rank."""

    def __init__(self, cfg, tokenizer, log=print, quiet=True):
        """quiet: lm-eval's INFO lines and progress bars off (log_level=debug keeps them)."""
        if tokenizer is None:
            raise ConfigError("eval_tasks needs the model's tokenizer (lm-eval's tasks are text): set "
                              "tokenizer_name_or_path to its directory.")
        if quiet:
            logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines, on every rank
            quiet_lm_eval()
        self.tokenizer, self.seq_length = tokenizer, cfg.seq_length
        self.tasks = load_tasks([EvalTask.from_entry(entry) for entry in cfg.eval_tasks], cfg.output_dir)
        for task, task_dict in self.tasks:  # every request built and tokenized once: errors and truncation now
            counter = PipelineLM(tokenizer, cfg.seq_length)
            try:
                run_task(counter, task, task_dict)
            except ValueError as error:  # a continuation longer than seq_length (HFLM asserts)
                raise ConfigError(f"eval_tasks: {task.spec}: {error}; raise seq_length, or drop the task.") from None
            if counter.truncated:
                log(f"eval_tasks: {task.spec}: {counter.truncated} of {counter.requests} requests are longer than "
                    f"seq_length={cfg.seq_length} + 1 tokens; their contexts are cut from the left, as lm-eval's HFLM "
                    f"with max_length={cfg.seq_length} does (raise seq_length to score them whole)")

    def evaluate(self, engine, cfg, pad_id, reads_data):
        """({task/metric: value}, lm-eval's samples by task); every rank calls it and gets the same."""
        lm = PipelineLM(self.tokenizer, self.seq_length, engine, cfg, pad_id, reads_data)
        metrics, samples = {}, {}
        for task, task_dict in self.tasks:
            results = run_task(lm, task, task_dict)
            metrics.update(task_metrics(results))
            samples.update(results["samples"])
        return metrics, samples

    def score(self, engine, cfg, pad_id, reads_data, step):
        """evaluate's metrics; rank 0 writes them and the samples beside metrics.jsonl (write_results)."""
        metrics, samples = self.evaluate(engine, cfg, pad_id, reads_data)
        if torch.distributed.get_rank() == 0:
            write_results(cfg.output_dir, step, "pipeline", metrics, samples)
        return metrics


def run_task(lm, task, task_dict):
    """lm-eval's evaluation of one eval_tasks entry (a task or group) with its limit; no bootstrap (stderr)."""
    return lm_eval_evaluate(lm, task_dict, limit=task.limit, bootstrap_iters=0, log_samples=True)


def task_metrics(results):
    """{"lm_eval/TASK/METRIC": value} of lm-eval's results: every number but the standard errors; METRIC is
    lm-eval's name less its ",none" filter (another filter's name stays, after a slash)."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            metrics[f"lm_eval/{task}/{name}"] = float(value)
    return metrics


def write_results(output_dir, step, source, metrics, samples):
    """Append {"step", "source", metrics} to output_dir/lm_eval.jsonl and write each task's samples to
    lm_eval_samples/global_stepN-SOURCE/TASK.jsonl (whole, or not at all). One writer: rank 0 or the export command."""
    sample_dir = os.path.join(output_dir, SAMPLES_DIR, f"global_step{step}-{source}")
    os.makedirs(sample_dir, exist_ok=True)
    for task, task_samples in samples.items():
        write_text_atomic(os.path.join(sample_dir, f"{task}.jsonl"), "".join(
            json.dumps(sample_record(sample), default=to_python) + "\n" for sample in task_samples))
    with open(os.path.join(output_dir, LM_EVAL_FILE), "a") as f:
        f.write(json.dumps({"step": step, "source": source, **metrics}, default=to_python) + "\n")
    plot_lm_eval(os.path.join(output_dir, LM_EVAL_FILE), os.path.join(output_dir, LM_EVAL_PLOT_FILE))


def sample_record(sample):
    """One document's requests and what came back: lm-eval's sample less the document and hashes."""
    return {"doc_id": sample["doc_id"], "target": str(sample["target"]), "arguments": sample["arguments"],
            "resps": sample["resps"], **{metric: sample[metric] for metric in sample["metrics"]}}


def to_python(value):
    """json.dumps's fallback for the numpy and torch scalars lm-eval's results hold."""
    return value.item() if hasattr(value, "item") else str(value)
