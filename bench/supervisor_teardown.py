"""How soon the supervisor ends an attempt after a rank is killed, with many ranks on a node: N stand-in ranks under
DeepSpeed's own launcher, under a stand-in of its runner (each rank records its start, and on SIGTERM records its end,
as a rank does, and exits after --rank-exit-seconds, a rank's own way out), one SIGKILLed; prints the seconds from the
kill to the supervisor's wait_for_attempt returning, alternating this tree's resilience/supervisor.py with the one of
--against (a commit).

  python bench/supervisor_teardown.py [--ranks 8] [--rounds 3] [--against COMMIT]
"""
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from resilience import supervisor  # noqa: E402
from resilience.rank_records import RankRecord, read_records  # noqa: E402

SETTLE_SECONDS = 1  # between every rank's start record and the kill: the supervisor is looking by then


def stand_in_rank(output_dir, exit_seconds):
    record = RankRecord(output_dir, int(os.environ["RANK"]))

    def ended(signum, frame):  # once, as the trainer's thread reads its first SIGTERM (the launcher's may follow)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(exit_seconds)
        record.end(128 + signum, "ended by its launcher after another rank exited", follows_another=True)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, ended)
    while True:
        time.sleep(1)



def seconds_to_end(supervisor, ranks, exit_seconds):
    output_dir = tempfile.mkdtemp(prefix="teardown-")
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    attempt, started = supervisor.Supervisor([], output_dir, 0, 0, 0), time.time()
    attempt.process = subprocess.Popen(  # the runner's stand-in, which starts the launcher
        [sys.executable, os.path.abspath(__file__), "--runner", sys.executable, "-u", "-m", "deepspeed.launcher.launch",
         f"--world_info={world}", "--master_addr=127.0.0.1", "--master_port=29500", os.path.abspath(__file__),
         "--stand-in-rank", output_dir, str(exit_seconds)], env=dict(os.environ))
    while len(read_records(output_dir, since=started)) < ranks:
        time.sleep(0.05)
    victim = read_records(output_dir, since=started)[ranks // 2]["pid"]
    killed = []

    def kill():
        time.sleep(SETTLE_SECONDS)
        killed.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)
    threading.Thread(target=kill).start()
    code = attempt.wait_for_attempt(started)
    ended = time.monotonic() - killed[0]
    attempt.process.wait()
    assert code == 256 - signal.SIGKILL, code
    return ended


def main():
    if sys.argv[1:2] == ["--runner"]:  # DeepSpeed's runner, which the supervisor starts: its launcher's exit code
        sys.exit(subprocess.call(sys.argv[2:], env=dict(os.environ)))
    if "--stand-in-rank" in sys.argv:  # as DeepSpeed's launcher starts it: after --local_rank=N
        at = sys.argv.index("--stand-in-rank")
        return stand_in_rank(sys.argv[at + 1], float(sys.argv[at + 2]))
    from common import bench_parser, in_rounds, machine_note, module_at, parse_args  # torch: not in the stand-ins
    from tests.rank_zygote import fork_python_children, in_zygote_child
    if in_zygote_child():  # the smoke run: the launcher and its stand-in ranks fork from here (tests/launcher_site)
        fork_python_children()
    parser = bench_parser(__doc__)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank-exit-seconds", type=float, default=0.02)
    parser.add_argument("--against", default=None, help="a commit whose resilience/supervisor.py to alternate with")
    args = parse_args(parser, ranks=2, rounds=1)
    variants = {"this tree": supervisor}
    if args.against:
        variants[args.against] = module_at(args.against, "resilience/supervisor.py")
    seconds = in_rounds({name: lambda m=module: round(seconds_to_end(m, args.ranks, args.rank_exit_seconds), 3)
                         for name, module in variants.items()}, args.rounds)
    print(json.dumps({"machine": machine_note(), "ranks": args.ranks, "rank_exit_seconds": args.rank_exit_seconds,
                      "kill_to_attempt_end_s": seconds}, indent=1))


if __name__ == "__main__":
    main()
