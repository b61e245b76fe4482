"""Rank processes forked from one that has imported torch, DeepSpeed, transformers and Hydra already.

Why: those imports are ~3 s of every rank's start, and the suite starts a few hundred ranks on 2 cores. A rank is a
real process all the same (its own pid, signals, exit code, gloo connections): multiprocessing's forkserver, which
imports `tests.zygote_imports` once, forks it, and the child runs the script as `python SCRIPT ARGS` would, with the
rank's environment, working directory, stdout/stderr files and the interpreter's exit (atexit handlers, a SystemExit's
code, an uncaught exception's traceback and exit code 1). Only CPU ranks come from here: the zygote imported DeepSpeed
with DS_ACCELERATOR=cpu.
"""
import atexit
import ctypes
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONTEXT = None
# Besides ranks (`python -u SCRIPT ARGS`), what a starter forks from itself: DeepSpeed's runner and its per-node
# launcher (which its ranks and the supervisor recognise by its command line: show_command_line).
FORKED_MODULES = ("deepspeed.launcher.runner", "deepspeed.launcher.launch")
# The processes that fork these and `python [-u] SCRIPT` children (ranks, the supervisor's commands) from themselves,
# started fresh (tests/launcher_site) or forked here.
STARTERS = ("deepspeed.launcher.runner", "deepspeed.launcher.launch", "torch.distributed.run", "supervise.py")


def in_zygote_child():
    """Whether this process was forked from the zygote, or from a process that was: the libraries are imported here
    already, so its own workers and child interpreters fork from it too (tests/distributed.py spawn, bench/common.py
    PythonProcess), not from a second zygote."""
    return "tests.zygote_imports" in sys.modules


def context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["tests.zygote_imports"])
    return _CONTEXT


class ForkedProcess:
    """A process forked from the zygote, with the Popen methods tests/launch.py's run_processes uses."""

    def __init__(self, argv, env, out_path, err_path):
        self.process = context().Process(target=run_script, args=(argv, env, out_path, err_path))
        self.process.start()

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def kill(self):
        if self.process.exitcode is None:
            self.process.kill()


def run_script(argv, env, out_path=None, err_path=None):
    """`python ARGV` in this forked process: argv a script and its arguments, ["-c", code, arguments...] or ["-m",
    module, arguments...]; its stdout and stderr appended to out_path and err_path, or where they are
    (tests/launcher_site/sitecustomize.py). A starter (STARTERS) forks its launchers and ranks in turn."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # a fresh interpreter's torch would take its thread count from it
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out_path), (2, err_path)) if out_path else ():
        file = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    # Unbuffered, as PYTHONUNBUFFERED=1 makes a fresh interpreter: a killed rank's lines are on disk already.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    if (argv[1] if argv[0] == "-m" else os.path.basename(argv[0])) in STARTERS:
        fork_python_children()
    # a fresh interpreter's path: the script's directory (the working directory's for -c and -m), then PYTHONPATH's
    first = ROOT if argv[0] in ("-c", "-m") else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:0] = [first, *(path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path)]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = list(argv[1:])
            sys.modules.pop(argv[1], None)  # imported already (the runner): run as __main__ only, as `python -m` does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()


def run_as_interpreter(argv, env, out_path=None, err_path=None):
    """run_script as a forked process's whole life: `python ARGV`'s exit code, a SystemExit's or 1 after an uncaught
    exception's traceback, once its threads that are not daemons have ended (as multiprocessing ends the zygote's)."""
    try:
        run_script(argv, env, out_path, err_path)
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        threading._shutdown()


class ForkedChild(subprocess.Popen):
    """subprocess.Popen that forks `python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS` (a FORKED_MODULES one),
    a command without pipes, cwd, preexec_fn or process group (the launchers' and the supervisor's), from this process,
    which has imported the libraries; any other command starts as usual. The child is still this process's own
    (pid, signals, exit code, reaping), in a new session where asked, with a fresh interpreter's signal handlers, and
    runs the command as `python` would (run_as_interpreter)."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        pipes, new_session, process_group = rest[3:9], rest[14], rest[15]
        argv = forkable_argv(args)
        if not (argv and preexec_fn is None and cwd is None and env is not None and set(pipes) == {-1}
                and process_group == -1):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)
        self.pid = os.fork()
        self._child_created = True
        if self.pid == 0:
            if new_session:
                os.setsid()
            for signum in signal.valid_signals():  # not the parent's Python handlers (a launcher's SIGTERM's)
                if callable(signal.getsignal(signum)):
                    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            show_command_line(args)
            os._exit(run_as_interpreter(argv, env))


def show_command_line(args):
    """args written over this forked process's command line (the zygote's, as long: args as far as they fit), as
    setproctitle does: what /proc/PID/cmdline shows, where DeepSpeed's ranks (resilience/preemption.py) and the
    supervisor (resilience/supervisor.py) recognise DeepSpeed's launcher."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): the 48th and 49th fields)
    ctypes.memmove(start, "\0".join(map(str, args)).encode()[:end - start - 1].ljust(end - start, b"\0"),
                   end - start)


def forkable_argv(args):
    """A command's arguments after `python [-u]` where ForkedChild forks it, else None."""
    if not isinstance(args, (list, tuple)) or list(args[:1]) != [sys.executable]:
        return None
    argv = list(args[2:] if list(args[1:2]) == ["-u"] else args[1:])
    if argv and (not argv[0].startswith("-") or (argv[0] == "-m" and argv[1:2] and argv[1] in FORKED_MODULES)):
        return argv
    return None


def fork_python_children():
    """From now on, this process forks its launchers and ranks (ForkedChild): DeepSpeed's runner, launcher and the
    supervisor call subprocess.Popen; torchrun's handler imported it."""
    subprocess.Popen = ForkedChild
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    subprocess_handler.Popen = ForkedChild
