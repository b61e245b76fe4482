"""The console every rank writes to: one event a line, each line starting with what said it.

A run's console is read by a person at a terminal, or later in a log file (a Slurm log, a pipe). On a terminal
rank 0 draws a progress bar for training and one for an evaluation while it runs; a line said while a bar is drawn
goes above the bar (tqdm's write, from the thread that draws it), and a line from another thread or process, which
cannot know where the bar is, first clears the bar's line, so no line is ever glued to a bar. When the output is not
a terminal no bar is drawn at all and every line is one event. Other libraries' progress bars, DeepSpeed's own log
lines and Python's two-line warnings stay off the console unless the run asks for them (log_level=debug)."""
import contextlib
import io
import logging
import os
import sys
import threading
import warnings

from tqdm import tqdm

LOG_LEVELS = ("info", "debug")  # debug: every library's own lines and bars too
CLEAR_LINE = "\r\033[K"  # back to the line's start and clear it: where rank 0's bar may be


def say(line, stream=None):
    """Write line (one event; a multi-line table stays whole) to stream (stdout by default) in one write."""
    stream = shown(stream or sys.stdout)
    if ProgressBar.drawn and threading.current_thread() is threading.main_thread():
        tqdm.write(line, file=stream)  # the bar cleared, the line written, the bar drawn again below it
        return
    stream.write(f"{CLEAR_LINE if is_terminal(stream) else ''}{line}\n")
    stream.flush()


def is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        return False


def draws_bars():
    """Whether this process draws progress bars: global rank 0 (every rank before a launcher sets RANK), on a
    terminal."""
    return int(os.environ.get("RANK", "0")) == 0 and is_terminal(sys.stderr)


class ProgressBar(tqdm):
    """A tqdm bar drawn on stderr by rank 0 on a terminal only (elsewhere it draws nothing); say() writes above it."""
    drawn = 0  # bars this process draws now

    def __init__(self, total, desc, initial=0, leave=True):
        super().__init__(total=total, initial=initial, desc=desc, leave=leave, dynamic_ncols=True,
                         disable=not draws_bars(), file=shown(sys.stderr))
        self.counted = not self.disable
        ProgressBar.drawn += self.counted

    def close(self):
        if getattr(self, "counted", False):
            self.counted = False
            ProgressBar.drawn -= 1
        super().close()


class HiddenOutput(io.TextIOBase):
    """A stream that drops what a library prints, standing in for `shown`, where say() still writes."""

    def __init__(self, shown_stream):
        self.shown = shown_stream

    def writable(self):
        return True

    def write(self, text):
        return len(text)


def shown(stream):
    """The stream a line reaches the console on: stream itself, or the one a HiddenOutput stands in for."""
    return getattr(stream, "shown", stream)


@contextlib.contextmanager
def library_output(log_level):
    """What a library prints to stdout inside the block (DeepSpeed's PipelineModule prints its seed and topology
    from rank 0), dropped unless log_level=debug; say() reaches the console meanwhile."""
    if log_level == "debug":
        yield
        return
    with contextlib.redirect_stdout(HiddenOutput(sys.stdout)):
        yield


def quiet_libraries(log_level):
    """Unless log_level=debug: no progress bars of datasets (a split's generation, a map) or transformers (loading
    weights), DeepSpeed's log lines below errors, and each Python warning in one line that starts with where it was
    raised (Python writes the source line under it). lm-eval's bars are switched off where it is called
    (evaluation/lm_eval_tasks.py quiet_lm_eval)."""
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if log_level == "debug":
        deepspeed_logger.setLevel(logging.INFO)
        return
    deepspeed_logger.setLevel(logging.ERROR)
    import datasets
    import transformers
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.showwarning = one_line_warning


def one_line_warning(message, category, filename, lineno, file=None, line=None):
    say(f"{filename}:{lineno}: {category.__name__}: {str(message).strip()}", file or sys.stderr)
