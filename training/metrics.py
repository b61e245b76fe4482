"""Run logging on rank 0: each record in full as one JSON line of metrics.jsonl and in DeepSpeed's monitors
(TensorBoard, W&B, CSV), in a short human form as one line of the console (below a progress bar on a terminal) and,
at the end, a PNG of the training and evaluation loss."""
import csv
import io
import json
import math
import os
import time
import uuid

import torch
import torch.distributed as dist

from checkpoints.files import write_text_atomic
from cluster.console import ProgressBar, say
from errors import ConfigError
from evaluation.lm_eval_log import LM_EVAL_FILE
from deepspeed_internals.registry import MonitorMaster, WandbMonitor, get_monitor_config

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
WANDB_RUN_ID_FILE = "wandb_run_id"  # the W&B run a resumed run goes on in
# Dense bf16/fp16 tensor-core peak TFLOP/s (no sparsity) from the vendors' data sheets, by a substring of
# torch.cuda.get_device_name(); the first match wins, so longer names come first.
PEAK_TFLOPS_16BIT = (("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("B200", 2250),
                     ("A100", 312), ("L40S", 362), ("L40", 181), ("L4", 121))


def device_peak_tflops(configured, precision):
    """One device's peak TFLOP/s: the peak_tflops key, else this GPU's bf16/fp16 entry in PEAK_TFLOPS_16BIT, else
    None (fp32, a CPU, an unlisted GPU: no mfu is logged)."""
    if configured:
        return float(configured)
    if precision == "fp32" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS_16BIT if key in name), None)


def compute_throughput(tokens_per_sec, flops_per_token, devices, peak_tflops):
    """Model TFLOP/s per device (models/partition.py's training_flops_per_token x tokens/s / devices) and, with a
    known peak, model FLOPs utilisation."""
    tflops = flops_per_token * tokens_per_sec / devices / 1e12
    return {"tflops_per_device": tflops, **({"mfu": tflops / peak_tflops} if peak_tflops else {})}


class MetricsWindow:
    """The steps since the last log record: how many, their tokens and model FLOPs, the losses of those that
    updated the weights and how many had no labelled token; and, over the whole run, the steps a non-finite loss
    skipped (nan_policy=skip)."""

    def __init__(self):
        self.run_started = time.time()
        self.skipped = 0
        self.reset()

    def reset(self):
        self.started = time.time()
        self.steps = self.tokens = self.flops = self.unlabelled = 0
        self.losses = []

    def add_step(self, tokens, flops_per_token, loss):
        """A step of `tokens` tokens; loss None: it had nothing to learn."""
        self.steps += 1
        self.tokens += tokens
        self.flops += tokens * flops_per_token
        if loss is None:
            self.unlabelled += 1
        elif math.isfinite(loss):
            self.losses.append(loss)
        else:
            self.skipped += 1

    def mean_loss(self):
        """The mean loss of the window's steps: None where every step had nothing to learn, NaN where every step
        that had was skipped."""
        if self.losses:
            return sum(self.losses) / len(self.losses)
        return None if self.unlabelled == self.steps else float("nan")

    def elapsed(self):
        return time.time() - self.started

    def run_elapsed(self):
        return time.time() - self.run_started


class RunLogger:
    def __init__(self, output_dir, monitors, total_steps, start_step, replays_after=None):
        """replays_after: the step training starts after; the records of later steps, which a restart from an
        earlier checkpoint logs again, are dropped from metrics.jsonl, lm_eval.jsonl (the run's own scores) and the
        CSV monitor's files and hidden in TensorBoard first, so each step appears once; a resumed run (replays_after
        past 0) goes on in the same W&B run, from the step after the last one it logged there. Either way a last line
        of metrics.jsonl or lm_eval.jsonl cut short by a stop mid-append is dropped (whole_records)."""
        self.enabled = dist.get_rank() == 0
        self.output_dir = output_dir
        config = get_monitor_config(monitors)
        self.wandb, self.wandb_logged_through = None, replays_after or 0
        if config.wandb.enabled and self.enabled:
            os.environ.setdefault("WANDB_MODE", "offline")  # no network on many clusters' compute nodes
            os.environ.setdefault("WANDB_RUN_ID", wandb_run_id(output_dir, resumed=bool(replays_after)))
            os.environ.setdefault("WANDB_RESUME", "allow")  # wandb's own: the run with that id goes on
        # Every rank constructs it (it checks the rank itself); only rank 0 writes. TensorBoard and W&B are written
        # here instead: DeepSpeed's monitor cannot pass SummaryWriter's purge_step, nor leave out a W&B run's steps.
        self.monitor = MonitorMaster(get_monitor_config({k: v for k, v in monitors.items()
                                                         if k not in ("tensorboard", "wandb")}))
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        dropped = drop_records_after(os.path.join(output_dir, METRICS_FILE), replays_after)
        drop_records_after(os.path.join(output_dir, LM_EVAL_FILE), replays_after, source="pipeline")
        if replays_after is not None:
            self.wandb_logged_through = max(dropped, default=replays_after)  # every monitor got each record
            if self.monitor.csv_monitor is not None:
                # its files keep their header: the monitor writes one into a file it has not written this run
                self.monitor.csv_monitor.filenames = drop_csv_rows_after(self.monitor.csv_monitor.log_dir,
                                                                         replays_after)
        if config.wandb.enabled:
            self.wandb = WandbMonitor(config.wandb)
        tensorboard = config.tensorboard
        self.tensorboard = None
        if tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: TensorBoard hides the events from that step on in the earlier event files (a replay logs them)
            self.tensorboard = SummaryWriter(os.path.join(tensorboard.output_path, tensorboard.job_name),
                                             purge_step=None if replays_after is None else replays_after + 1)
        self.file = open(os.path.join(output_dir, METRICS_FILE), "a")
        self.total_steps = total_steps
        self.bar = ProgressBar(total_steps, "train", initial=start_step)

    def log(self, record):
        """Write one record: {"step": N, name: value, ...}."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        events = [(f"Train/{k}", v, step) for k, v in record.items() if k != "step" and isinstance(v, (int, float))]
        self.monitor.write_events(events)
        if self.wandb is not None and step > self.wandb_logged_through:  # W&B keeps a step's first values
            self.wandb.write_events(events)
        if self.tensorboard is not None:
            for event in events:
                self.tensorboard.add_scalar(*event)
            self.tensorboard.flush()
        if record.get("loss") is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4g}", refresh=False)
        say(record_line(record, self.total_steps))

    def advance(self, steps=1):
        if self.enabled:
            self.bar.update(steps)

    def close(self):
        if not self.enabled:
            return
        self.bar.close()
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        plot_losses(os.path.join(self.output_dir, METRICS_FILE), os.path.join(self.output_dir, PLOT_FILE))


# What the console shows of a training record, as (key, label, format); an evaluation record shows all its figures.
TRAINING_SHOWN = (("loss", "loss", ".4g"), ("lr", "lr", ".3g"), ("grad_norm", "grad_norm", ".3g"),
                  ("rewards/accuracies", "rewards/accuracies", ".3g"), ("rewards/margins", "rewards/margins", ".3g"),
                  ("aux_loss", "aux_loss", ".4g"), ("tokens_per_sec", "tokens/s", ",.0f"), ("mfu", "mfu", ".1%"),
                  ("skipped_steps", "skipped steps", "d"))


def record_line(record, total_steps):
    """A record as the console shows it, `step N/T | name value | ...`: of a training record the figures a person
    follows (loss, learning rate, gradient norm, the preference and router losses, throughput), of an evaluation's
    every figure (lm-eval's without their lm_eval/ prefix); metrics.jsonl holds the whole record."""
    step = f"step {record['step']}/{total_steps}" if total_steps else f"step {record['step']}"
    if "loss" in record:
        shown = [(label, record[key], spec) for key, label, spec in TRAINING_SHOWN if record.get(key) is not None]
        stragglers = ([f"rank {r}" for r in record.get("straggler_ranks", [])]
                      + [f"stage {s}" for s in record.get("straggler_stages", [])])
        if stragglers:
            shown.append(("stragglers", ", ".join(map(str, stragglers)), "s"))
    else:
        shown = [(key.removeprefix("lm_eval/"), value, ".4g") for key, value in record.items()
                 if key != "step" and value is not None]
    return " | ".join([step] + [f"{label} {format_value(value, spec)}" for label, value, spec in shown])


def format_value(value, spec):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and spec not in ("d", ",.0f"):
        return str(value)
    return format(value, spec)


def drop_records_after(path, step, source=None):
    """Rewrite the JSON-lines file at path (atomically) without its records of steps after `step` (of that
    `source` only, when given: lm_eval.jsonl keeps the scores of exports, which a restart does not log again; None:
    none), and without a last line cut short (whole_records); the steps dropped."""
    if not os.path.isfile(path):
        return []
    records, repaired = whole_records(path)
    logged_again = [step is not None and record["step"] > step and record.get("source") == source
                    for _, record in records]
    dropped = sorted({record["step"] for (_, record), again in zip(records, logged_again) if again})
    if dropped or repaired:
        write_text_atomic(path, "".join(line for (line, _), again in zip(records, logged_again) if not again))
    if dropped:
        say(f"{path}: dropped the records of step(s) {', '.join(map(str, dropped))}, which this run logs again "
            f"(it starts after step {step})")
    return dropped


def whole_records(path):
    """([(line, record)] of a JSON-lines log this run appends to, whether it needs rewriting). A last line that is
    not a whole record was cut short by a run that stopped mid-append (a node lost): it is dropped, in one line; a
    last record without its newline gets one, so that the next append starts a line of its own. A bad line before
    the last is no interrupted append: a ConfigError naming it."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records, repaired = [], False
    for number, line in enumerate(lines, 1):
        try:
            records.append((line if line.endswith("\n") else line + "\n", json.loads(line)))
            repaired = repaired or not line.endswith("\n")
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ConfigError(f"{path}: line {number} is not a JSON record ({error}); fix or remove it") from None
            say(f"{path}: dropped its last line, a record cut short when the run writing it stopped mid-append: "
                f"{line.strip()[:60]!r}")
            repaired = True
    return records, repaired


def drop_csv_rows_after(directory, step):
    """Rewrite each of DeepSpeed's CSV monitor files in directory (step, value rows under a header) atomically
    without its rows of steps after `step`; their names without .csv."""
    names = sorted(name[:-len(".csv")] for name in os.listdir(directory) if name.endswith(".csv"))
    for name in names:
        path = os.path.join(directory, f"{name}.csv")
        with open(path, newline="") as f:
            header, *rows = list(csv.reader(f))
        kept = [row for row in rows if int(row[0]) <= step]
        if len(kept) < len(rows):
            text = io.StringIO()
            csv.writer(text).writerows([header, *kept])
            write_text_atomic(path, text.getvalue())
    return names


def wandb_run_id(output_dir, resumed):
    """The W&B run id of the run in output_dir (output_dir/wandb_run_id): a resumed run's is the one its start
    wrote, a new run's is new."""
    path = os.path.join(output_dir, WANDB_RUN_ID_FILE)
    if resumed and os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:16]
    os.makedirs(output_dir, exist_ok=True)
    write_text_atomic(path, run_id)
    return run_id


def plot_losses(metrics_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
