"""`pytest --cpu-durations=N`: the N tests that took the most CPU time (user + system, setup and teardown included),
with the processes they started: what the suite costs on a shared or slower host, where wall-clock durations mislead.

A test's processes count once they have exited and been waited for: subprocesses by this process, ranks forked from
the rank zygote (tests/rank_zygote.py) by the zygote, whose /proc counters are read here. Under pytest-xdist each
worker measures its tests (the reports carry their CPU seconds to the controller) and its whole session, which the
controller adds to its own."""
import multiprocessing.forkserver
import os
from collections import defaultdict

import pytest

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_zygote_seconds = {}  # zygote pid: its CPU seconds and its waited-for children's, when last read
_test_seconds = defaultdict(float)  # node id: CPU seconds of its phases reported so far
_worker_seconds = {}  # xdist worker id: its whole session's CPU seconds, when it finished
PHASE_START = pytest.StashKey[float]()


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that took the most CPU time, their processes included (0: all)")


def zygote_cpu_seconds():
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            _zygote_seconds[pid] = sum(map(int, fields[11:15])) / TICKS_PER_SECOND  # utime stime cutime cstime
        except OSError:  # gone: its last reading stands
            pass
    return sum(_zygote_seconds.values())


def cpu_seconds(children=True):
    times = os.times()
    own = times.user + times.system
    return own + times.children_user + times.children_system + zygote_cpu_seconds() if children else own


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    if item.config.getoption("cpu_durations") is not None:
        item.stash[PHASE_START] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item):
    report = (yield).get_result()
    if PHASE_START in item.stash:  # the phase's CPU seconds, on the report that ends it (sent on by an xdist worker)
        now = cpu_seconds()
        report.cpu_seconds, item.stash[PHASE_START] = now - item.stash[PHASE_START], now


def pytest_runtest_logreport(report):
    if hasattr(report, "cpu_seconds"):
        _test_seconds[report.nodeid] += report.cpu_seconds


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown
def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its session's CPU, for the controller
        session.config.workeroutput["cpu_seconds"] = cpu_seconds()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node):
    _worker_seconds[node.gateway.id] = node.workeroutput.get("cpu_seconds", 0.0)


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("cpu_durations")
    if count is None:
        return
    # an xdist controller runs no test: its own CPU and its workers' (whose children it may not have waited for)
    session = cpu_seconds(children=False) + sum(_worker_seconds.values()) if _worker_seconds else cpu_seconds()
    workers = f" ({len(_worker_seconds)} workers)" if _worker_seconds else ""
    terminalreporter.write_sep("=", f"{'all' if count == 0 else count} largest CPU durations; whole session: "
                                    f"{session:.1f} CPU s{workers}")
    for nodeid, seconds in sorted(_test_seconds.items(), key=lambda entry: -entry[1])[:count or None]:
        terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
