"""Rank processes forked from one that has imported torch, DeepSpeed, transformers and Hydra already.

Why: those imports are ~3 s of every rank's start, and the suite starts a few hundred ranks on 2 cores. A rank is a
real process all the same (its own pid, signals, exit code, gloo connections): multiprocessing's forkserver, which
imports `tests.zygote_imports` once, forks it, and the child runs the script as `python SCRIPT ARGS` would, with the
rank's environment, working directory, stdout/stderr files and the interpreter's exit (atexit handlers, a SystemExit's
code, an uncaught exception's traceback and exit code 1). Only CPU ranks come from here: the zygote imported DeepSpeed
with DS_ACCELERATOR=cpu.
"""
import atexit
import io
import multiprocessing
import os
import runpy
import sys
import threading
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONTEXT = None


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
    """`python ARGV` in this forked process: argv a script and its arguments, or ["-c", code, arguments...]; its
    stdout and stderr appended to out_path and err_path, or where they are (tests/launcher_site/sitecustomize.py)."""
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
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[:0] = ["-c", *argv[2:]], [ROOT]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv, sys.path[:0] = list(argv), [os.path.dirname(os.path.abspath(argv[0]))]
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
