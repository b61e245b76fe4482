"""The console: one event a line. On a terminal a line said while rank 0's progress bar is drawn lands above the bar,
whether rank 0's main thread says it or another thread or process does; in a pipe a 2-stage run's console, through
DeepSpeed's launcher as the demo launches it, holds no bar, one short line per logged step (the whole record in
metrics.jsonl), and every warning line starts with what said it."""
import io
import json
import re
import sys
import threading

import pytest

from cluster import console
from cluster.console import ProgressBar, say
from tests.launch import demo_overrides, lm_eval_overrides, start_trainer
from training.metrics import record_line

FAULT_SCRIPT = "tests/fault_injection.py"
BAR = re.compile(r"\d+%\|")  # tqdm's bar: its percentage, then the bar
RECORD = re.compile(r"^step \d+/\d+ \| ")
SOURCE = re.compile(r"^[\w./ -]+?: ")  # what said the line: trainer_pipe, hang watchdog, straggler, a file's path


class Terminal(io.StringIO):
    def isatty(self):
        return True


def screen(text):
    """The lines a terminal shows for text: a carriage return goes back to the line's start, ESC[K clears the rest
    of the line, ESC[A moves up one line (tqdm's)."""
    rows, row, column = [[]], 0, 0
    for token in re.findall(r"\x1b\[K|\x1b\[A|\x1b\[[0-9;]*[A-Za-z]|\r|\n|[^\x1b\r\n]", text):
        if token == "\r":
            column = 0
        elif token == "\n":
            row, column = row + 1, 0
            rows += [[]] * (row == len(rows))
        elif token == "\x1b[K":
            del rows[row][column:]
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        elif not token.startswith("\x1b"):
            rows[row] = rows[row][:column] + [token] + rows[row][column + 1:]
            column += 1
    return ["".join(r).rstrip() for r in rows]


def on_terminal(monkeypatch):
    """stdout and stderr one terminal, this process rank 0 (set in the test itself: pytest's capture sets the
    streams again after the fixtures)."""
    stream = Terminal()
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("RANK", "0")
    return stream


def test_a_line_said_while_the_bar_is_drawn_is_a_line_of_its_own_above_the_bar(monkeypatch):
    terminal = on_terminal(monkeypatch)
    bar = ProgressBar(4, "train")
    bar.update(1)
    say("step 1/4 | loss 2.5")  # the main thread, as the loop logs
    bar.update(1)
    other = threading.Thread(target=say, args=("straggler: rank 1 (stage 1) computed 2.00s",))
    other.start()  # the watchdog's or the lease's thread; another rank's process writes the same way
    other.join()
    bar.update(1)
    bar.close()
    shown = screen(terminal.getvalue())
    assert "step 1/4 | loss 2.5" in shown and "straggler: rank 1 (stage 1) computed 2.00s" in shown, shown
    bars = [line for line in shown if line.startswith("train:")]
    assert len(bars) == 1 and "3/4" in bars[0] and shown.index(bars[0]) == len([l for l in shown if l]) - 1, shown


def test_no_bar_is_drawn_where_the_output_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setenv("RANK", "0")
    with ProgressBar(4, "train") as bar:
        bar.update(4)
    assert sys.stderr.getvalue() == "" and ProgressBar.drawn == 0


def test_only_rank_0_draws_a_bar(monkeypatch):
    on_terminal(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    assert not console.draws_bars()
    monkeypatch.setenv("RANK", "0")
    assert console.draws_bars()


def test_the_console_line_of_a_record():
    record = {"step": 20, "loss": 2.46312, "lr": 0.00199, "grad_norm": 0.8123, "tokens_per_sec": 10310.4,
              "tflops_per_device": 0.02, "samples_per_sec": 70.1, "elapsed_s": 2.2, "slowest_rank": 1,
              "straggler_ranks": [1]}
    assert record_line(record, 60) == ("step 20/60 | loss 2.463 | lr 0.00199 | grad_norm 0.812 | tokens/s 10,310 | "
                                       "stragglers rank 1")
    assert record_line({"step": 20, "eval_loss": 2.513, "eval_ppl": 12.3456}, 60) == \
        "step 20/60 | eval_loss 2.513 | eval_ppl 12.35"
    assert record_line({"step": 20, "lm_eval/demo_cloze/acc": 0.55}, 60) == "step 20/60 | demo_cloze/acc 0.55"
    assert record_line({"step": 4, "eval_loss": 2.5, "eval_examples": 500}, 0) == \
        "step 4 | eval_loss 2.5 | eval_examples 500"
    assert record_line({"step": 3, "loss": None, "lr": 1e-3, "grad_norm": None, "tokens_per_sec": 30.0,
                        "mfu": 0.397, "skipped_steps": 2}, 6) == \
        "step 3/6 | lr 0.001 | tokens/s 30 | mfu 39.7% | skipped steps 2"


def test_python_warnings_are_one_line_that_starts_with_their_source(monkeypatch):
    terminal = on_terminal(monkeypatch)
    monkeypatch.setattr("warnings.showwarning", console.one_line_warning)
    import warnings
    warnings.warn_explicit("old name", FutureWarning, "/lib/thing.py", 12)
    assert screen(terminal.getvalue()) == ["/lib/thing.py:12: FutureWarning: old name", ""]


@pytest.mark.slow
def test_a_two_stage_runs_console_in_a_pipe_is_one_event_a_line(demo_model, demo_tasks, tmp_path):
    """Through DeepSpeed's launcher (quiet, as the demo runs it), 2 stages, evaluation and lm-eval's tasks (whose
    datasets' and lm-eval's own bars stay off), a straggler (rank 1's forwards slowed), a step with nothing to learn
    and a background save whose writer is killed: every line of the one pipe its ranks share is one event."""
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, num_stages=2, gradient_accumulation_steps=2, max_steps=6,
                               logging_steps=2, eval_steps=3, save_steps=2, async_save="true", warmup_steps=1,
                               **{"hang_watchdog.min_step_seconds": 5}, **lm_eval_overrides(demo_tasks, 4))
    runner = start_trainer(2, overrides, script=FAULT_SCRIPT, runner_flags=["--quiet"],
                           env={"FAULT": "slow:1:1,unlabelled:0:3,kill_writer:1:4", "FAULT_SLOW_SECONDS": "0.3"})
    text = runner.stdout.read()
    assert runner.wait(timeout=300) == 0, text[-3000:]
    lines = text.splitlines()
    assert "\r" not in text and not any(BAR.search(line) for line in lines), text[-3000:]  # no bar at all
    records = [line for line in lines if RECORD.match(line)]
    assert all(line.count("step ") == 1 and "{" not in line for line in records), records  # one record a line
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    training = [record for record in logged if "loss" in record]
    assert [record["step"] for record in training] == [2, 4, 6]
    assert [int(re.match(r"step (\d+)/", line).group(1)) for line in records if " | lr " in line] == [2, 4, 6], \
        records  # one line per logged step, its key figures only
    assert all("samples_per_sec" in record and "samples_per_sec" not in text for record in training)
    assert [line for line in lines if " | eval_loss " in line] and [line for line in lines if "demo_cloze/acc" in line]
    warnings = [line for line in lines if "warning" in line.lower()]
    assert any(line.startswith("trainer_pipe: warning: async_save: the background write of ") for line in warnings), \
        text[-3000:]
    assert all(SOURCE.match(line) and not line.lower().startswith("warning") for line in warnings), warnings
    assert any(line.startswith("straggler: ") for line in lines), text[-3000:]
    assert "step 3: the global batch has no labelled token (every label is -100): no update" in lines
    # DeepSpeed's own start-up lines and other libraries' bars are not asked for (log_level=debug shows them)
    assert not [line for line in lines if "[INFO]" in line or "[WARNING]" in line or "Generating" in line or
                line.startswith(("SEED_LAYERS", "Using topology"))], text[-3000:]
