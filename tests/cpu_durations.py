"""`pytest --cpu-durations=N`: the N tests that took the most CPU time (user + system, setup and teardown included),
with the processes they started: what the suite costs on a shared or slower host, where wall-clock durations mislead.

A test's processes count once they have exited and been waited for: subprocesses by this process, ranks forked from
the rank zygote (tests/rank_zygote.py) by the zygote, whose /proc counters are read here."""
import multiprocessing.forkserver
import os

import pytest

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_zygote_seconds = {}  # zygote pid: its CPU seconds and its waited-for children's, when last read
CPU_DURATIONS = pytest.StashKey[list]()


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


def cpu_seconds():
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system + zygote_cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    if item.config.getoption("cpu_durations") is None:
        yield
        return
    start = cpu_seconds()
    yield
    item.config.stash.setdefault(CPU_DURATIONS, []).append((cpu_seconds() - start, item.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("cpu_durations")
    if count is None:
        return
    durations = sorted(config.stash.get(CPU_DURATIONS, []), reverse=True)
    terminalreporter.write_sep("=", f"{'all' if count == 0 else count} largest CPU durations; whole session: "
                                    f"{cpu_seconds():.1f} CPU s")
    for seconds, nodeid in durations[:count or None]:
        terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
