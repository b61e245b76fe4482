"""The GPU check's report (bash scripts/gpu_check.sh): after the checks in this directory, the versions, the GPUs and
one line per check: its name, PASS / FAIL / SKIP and its key figure (what a check records with
record_property("figure", ...), a failure's error line, a skip's reason)."""
import re
from importlib.metadata import version

import torch

RESULTS = {}  # check name: (outcome, figure), in the order the checks ran


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1].removeprefix("test_")
    if report.failed:  # the check itself, or a launch in a fixture it needs (setup), or its teardown
        RESULTS[name] = ("FAIL", failure_line(report))
    elif report.skipped:
        RESULTS[name] = ("SKIP", report.longrepr[2].removeprefix("Skipped: "))
    elif report.when == "call":
        RESULTS[name] = ("PASS", dict(report.user_properties).get("figure", ""))


def failure_line(report):
    """What went wrong, in one line: the last error line of the message (a launched process's own, at the end of the
    output that check_ok shows), else its first line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = (crash.message if crash else str(report.longrepr)).strip().splitlines()
    errors = [line for line in lines if re.search(r"Error|error:", line)]
    return (errors[-1] if errors else lines[0]).strip()[:160]


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    count = torch.cuda.device_count()
    gpus = (f"{count} x {', '.join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))}" if count
            else "no GPU")
    write("")
    write(f"GPU check: torch {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'}), deepspeed "
          f"{version('deepspeed')}, transformers {version('transformers')}; {gpus}")
    width = max(map(len, RESULTS), default=0)
    for name, (outcome, figure) in RESULTS.items():
        write(f"  {name:<{width}}  {outcome:<4}  {figure}")
    if not torch.cuda.is_available():
        write("no CUDA device found (torch.cuda.is_available() is false): every check skipped")
