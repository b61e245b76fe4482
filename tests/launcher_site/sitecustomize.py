"""Imported at start-up by every interpreter the CPU tests start (tests/launch.py puts this directory on PYTHONPATH);
it acts only in the launchers that start ranks, DeepSpeed's per-node launcher (python -u -m deepspeed.launcher.launch)
and torchrun's agent (python -m torch.distributed.run): there the launcher imports the libraries once
(tests/zygote_imports.py) and forks each `python -u SCRIPT ARGS` rank from itself, rather than starting it as a fresh
interpreter that imports them again (~7 CPU s a rank, 26 ranks a suite). Processes forked from the rank zygote that
start DeepSpeed's runner (supervise.py, tests/launch.py launch_trainer(launcher=True) and start_trainer) fork it
likewise, and it its launcher (~9.5 CPU s each: tests/rank_zygote.py STARTERS); a runner started fresh (the benches)
starts its launcher fresh, where this acts.

Each child is still the starter's own, started where and when the starter starts it (in a new session where torchrun
asks for one): its pid, parent, signals, stdout/stderr and exit code are a fresh process's, and the starter polls,
signals and reaps it as it would (tests/rank_zygote.py ForkedChild). It runs the script or module as `python -u`
would (tests/rank_zygote.py run_as_interpreter); only its /proc/PID/environ shows the starter's, as the environment
is set in the forked process, and its /proc/PID/cmdline its own command as far as the zygote's is long
(tests/rank_zygote.py show_command_line)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = sys.orig_argv
MODULE = ARGV[ARGV.index("-m") + 1] if "-m" in ARGV[:-1] else None
if MODULE in ("deepspeed.launcher.launch", "torch.distributed.run"):
    sys.path.insert(0, ROOT)
    import tests.zygote_imports  # noqa: E402,F401
    from tests.rank_zygote import fork_python_children  # noqa: E402
    fork_python_children()
