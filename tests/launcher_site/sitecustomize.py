"""Imported at start-up by every interpreter the CPU tests start (tests/launch.py puts this directory on PYTHONPATH);
it acts only in the launchers that start ranks, DeepSpeed's per-node launcher (python -u -m deepspeed.launcher.launch)
and torchrun's agent (python -m torch.distributed.run): there the launcher imports the libraries once
(tests/zygote_imports.py) and forks each `python -u SCRIPT ARGS` rank from itself, rather than starting it as a fresh
interpreter that imports them again (~7 CPU s a rank, 26 ranks a suite).

Each rank is still the launcher's own child, started where and when the launcher starts it (in a new session where
torchrun asks for one): its pid, parent, signals, stdout/stderr and exit code are a fresh rank's, and the launcher
polls, signals and reaps it as it would. It runs the script as `python -u` would (tests/rank_zygote.py
run_as_interpreter); only its /proc/PID/cmdline and environ show the launcher's, as the environment is set in the
forked process."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = sys.orig_argv


class ForkedRank(subprocess.Popen):
    """subprocess.Popen that forks `python -u SCRIPT ARGS` (a command without pipes, cwd, preexec_fn or process
    group: the launchers') from this process; any other command starts as usual."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        pipes, new_session, process_group = rest[3:9], rest[14], rest[15]
        if not (isinstance(args, (list, tuple)) and list(args[:2]) == [sys.executable, "-u"]
                and not args[2].startswith("-") and preexec_fn is None and cwd is None and env is not None
                and set(pipes) == {-1} and process_group == -1):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)
        self.pid = os.fork()
        self._child_created = True
        if self.pid == 0:
            if new_session:
                os.setsid()
            from tests.rank_zygote import run_as_interpreter
            os._exit(run_as_interpreter(list(args[2:]), env))


MODULE = ARGV[ARGV.index("-m") + 1] if "-m" in ARGV[:-1] else None
if MODULE in ("deepspeed.launcher.launch", "torch.distributed.run"):
    sys.path.insert(0, ROOT)
    import tests.zygote_imports  # noqa: E402,F401
    subprocess.Popen = ForkedRank  # DeepSpeed's launcher calls subprocess.Popen; torchrun's handler imported it:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler  # noqa: E402
    subprocess_handler.Popen = ForkedRank
