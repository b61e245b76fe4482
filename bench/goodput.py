"""Goodput under faults: a supervised run (supervise.py over DeepSpeed's runner, 2 pipeline stages, fp32, the tiny
LLaMA) of N steps with faults injected at random steps, against the same run without faults.

Faults, in step order (each fires once: its restart goes past it): SIGKILL of a rank, SIGKILL of a rank right after it
wrote its part of a checkpoint (before it is complete), SIGSTOP of a rank (the hang watchdog of its peer ends the
attempt), and one rank slowed (FAULT_SLOW_SECONDS more per forward) from a step to the end. Prints the wall-clock
goodput (fault-free time / faulty time), and per failing fault the time to detect it (the fault to the supervisor's
restart line: the supervisor seeing the failed rank and ending the attempt, after the watchdog's limit for the
SIGSTOP), to restart (that line to the first step after it) and to replay the steps since the last checkpoint; checks
that the final weights equal the fault-free run's, bit for bit. And the target's goodput: the fault-free time over
(the fault-free time + per failing fault: its detection bound, 2 x the fault-free median step time after its limit
(the watchdog's for the SIGSTOP, none for a kill), its restart and its replay as measured (at most save_steps steps);
the slowed rank's own injected delay, which no recovery removes: it is not ended). And what the faulty run took beyond
the fault-free run and those figures (unaccounted): whether a run meets the target is decided there.

With --rounds N, N fault-free and faulty runs alternate, and each faulty run is also set against the median
fault-free run (their first start-ups differ by seconds, more than the faults' own figures from their allowance).

  python bench/goodput.py [--steps 24] [--save-steps 4] [--seed 0] [--rounds 1] [--faults sigkill ...] [--work-dir DIR]
"""
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

from common import bench_parser, demo_model, machine_note, parse_args, timed_lines  # noqa: E402

import torch  # noqa: E402

from checkpoints.files import read_latest  # noqa: E402
from tests.launch import trainer_command  # noqa: E402

SLOW_SECONDS = "0.2"  # the slowed rank's extra time per forward
WATCHDOG = {"hang_watchdog.min_step_seconds": 10, "hang_watchdog.startup_seconds": 300}
FAULTS = ("sigkill", "kill_during_save", "sigstop", "slow")


def run_overrides(work_dir, smoke):
    """The tiny LLaMA the tests train, converted: the trainer's overrides for it."""
    root = demo_model(os.path.join(work_dir, "model"), train_lines=300 if smoke else 3000)
    return {"model_name_or_path": os.path.join(root, "ds"), "train_file": os.path.join(root, "train.txt"),
            "eval_file": "null", "data.cache_dir": os.path.join(root, "data_cache"), "seq_length": 64,
            "micro_batch_size": 2}


def fault_plan(steps, save_steps, seed):
    """[(kind, rank, step)] in step order, each past the previous one's restart point."""
    rng = random.Random(seed)
    span = steps // 4
    kill = rng.randrange(2, span)
    save = save_steps * rng.randrange(span // save_steps + 1, 2 * span // save_steps + 1)
    stop = rng.randrange(save + 2, 3 * span)
    slow = rng.randrange(3 * span, steps)
    return [("sigkill", 1, kill), ("kill_during_save", 1, save), ("sigstop", 1, stop), ("slow", 1, slow)]


def step_times(lines):
    """[(time, step)] of every step rank 0 logged, in order (a restart logs its replayed steps again)."""
    found = []
    for at, line in lines:
        match = re.search(r"\bstep (\d+)/\d+ \| loss ", line)  # the console's short record (cluster/console.py)
        if match:
            found.append((at, int(match.group(1))))
    return found


def median_step_seconds(lines):
    """The median time between rank 0's consecutive step lines (the first step's start-up left out)."""
    times = [at for at, _ in step_times(lines)]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def fault_timings(lines, plan, save_steps):
    """Per failing fault: seconds to detect, to restart (first step after), to replay up to the step it hit."""
    # a rank's progress bar may precede the supervisor's line on the stderr they share
    steps, restarts = step_times(lines), [at for at, line in lines if "supervise: restart" in line]
    timings = []
    for kind, _, step in plan:
        fired = next((at for at, line in lines if f"FAULT {kind} AT" in line), None)
        if fired is None or kind == "slow":
            continue
        restart = next(at for at in restarts if at > fired)
        first = next((at, s) for at, s in steps if at > restart)
        reached = step - 1 if kind != "kill_during_save" else step  # the last step done before the fault
        replayed = next(at for at, s in steps if at > restart and s == reached) if reached >= first[1] else first[0]
        timings.append({"fault": kind, "step": step, "detect_s": restart - fired, "restart_s": first[0] - restart,
                        "replay_s": replayed - first[0], "replayed_steps": max(0, reached - (first[1] - 1))})
    return timings


def phases(lines, total):
    """(seconds to the first step's line, seconds after the last step's line): a run's start-up and its end."""
    times = [at for at, _ in step_times(lines)]
    return times[0], total - times[-1]


def unaccounted(free, faulty, timings, slow_s):
    """What the faulty run took beyond the fault-free run and its faults' detection, restart, replay and slowed
    forwards, in three parts: its first start-up's difference from the fault-free run's, its end's, and the steps
    between (redone saves, the first steps after a restart). Goodput meets its target when these and each fault's
    detection beyond its bound add up to at most 0."""
    (free_start, free_end), (faulty_start, faulty_end) = (phases(r["lines"], r["seconds"]) for r in (free, faulty))
    accounted = sum(t["detect_s"] + t["restart_s"] + t["replay_s"] for t in timings) + slow_s
    steps = faulty["seconds"] - free["seconds"] - accounted - (faulty_start - free_start) - (faulty_end - free_end)
    return {"start_up_s": round(faulty_start - free_start, 3), "end_s": round(faulty_end - free_end, 3),
            "steps_s": round(steps, 3),
            "detection_past_bound_s": round(sum(t["detect_s"] - t["detect_bound_s"] for t in timings), 3)}


def final_weights_equal(a, b):
    """Whether the last checkpoints of runs a and b hold the same weights, bit for bit."""
    tag_a, tag_b = (os.path.join(run, read_latest(run)) for run in (a, b))
    for name in sorted(os.listdir(tag_a)):
        if name.startswith("layer_") and name.endswith("-model_states.pt"):
            x, y = (torch.load(os.path.join(tag, name), weights_only=True) for tag in (tag_a, tag_b))
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
    return True


def supervised_run(name, run, env, work_dir):
    """One supervised run: {"seconds", "lines", "out"}; its timestamped lines in NAME.log (the faults' timelines)."""
    out = os.path.join(work_dir, name)
    overrides = [f"{k}={v}" for k, v in {**run, "output_dir": out, "overwrite_output_dir": "true"}.items()]
    command, environment = trainer_command(2, overrides, "tiny", None, os.path.join("tests", "fault_injection.py"), env)
    started = time.time()
    code, lines = timed_lines(["supervise.py", "--backoff-seconds", "0", "--", *command], environment)
    seconds = time.time() - started
    with open(f"{out}.log", "w") as f:
        f.writelines(f"{at:9.3f} {line}\n" for at, line in lines)
    if code:
        sys.exit(f"the {name} run failed ({code}):\n" + "\n".join(line for _, line in lines[-40:]))
    return {"seconds": seconds, "lines": lines, "out": out}


def faulty_round(free, faulty, plan, run, args):
    """One faulty run against a fault-free one: goodput, the target's, each fault's figures, what is unaccounted."""
    timings = fault_timings(faulty["lines"], plan, args.save_steps)
    step = median_step_seconds(free["lines"])
    limits = {"sigstop": WATCHDOG["hang_watchdog.min_step_seconds"]}  # 10 x the step time is below it
    for timing in timings:
        timing["detect_bound_s"] = limits.get(timing["fault"], 0) + 2 * step
    slowed = sum(args.steps + 1 - s for kind, _, s in plan if kind == "slow") * run["gradient_accumulation_steps"]
    slow_s = slowed * float(SLOW_SECONDS)
    allowed = sum(t["detect_bound_s"] + t["restart_s"] + t["replay_s"] for t in timings) + slow_s
    target = free["seconds"] / (free["seconds"] + allowed)
    return {"fault_free_s": round(free["seconds"], 1), "faulty_s": round(faulty["seconds"], 1),
            "goodput": round(free["seconds"] / faulty["seconds"], 3), "target_goodput": round(target, 3),
            "target_met": free["seconds"] / faulty["seconds"] >= target, "step_s": round(step, 4),
            "slowed_forwards_s": slow_s, "per_fault": timings,
            "unaccounted": unaccounted(free, faulty, timings, slow_s),
            "restarts": [line[line.index("supervise:"):] for _, line in faulty["lines"] if "supervise:" in line],
            "final_weights_equal": final_weights_equal(free["out"], faulty["out"])}


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="fault-free and faulty runs alternated this many times")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=FAULTS, help="the faults to inject")
    parser.add_argument("--work-dir", default=None)
    args = parse_args(parser, steps=12, faults=["sigkill"])
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="goodput-")
    run = {**run_overrides(work_dir, args.smoke), "num_stages": 2, "gradient_accumulation_steps": 2,
           "max_steps": args.steps, "save_steps": args.save_steps, "save_total_limit": 3, "logging_steps": 1,
           **WATCHDOG}
    plan = [fault for fault in fault_plan(args.steps, args.save_steps, args.seed) if fault[0] in args.faults]
    pairs = []
    for round_ in range(args.rounds):
        once = os.path.join(work_dir, f"once{round_}")  # each fault fires once per round
        os.makedirs(once, exist_ok=True)
        faults = {"FAULT": ",".join(f"{k}:{r}:{s}" for k, r, s in plan), "FAULT_ONCE_DIR": once,
                  "FAULT_SLOW_SECONDS": SLOW_SECONDS}
        pairs.append((supervised_run(f"fault-free{round_}", run, {"FAULT": "slow:1:1000000"}, work_dir),
                      supervised_run(f"faults{round_}", run, faults, work_dir)))
    rounds = [faulty_round(free, faulty, plan, run, args) for free, faulty in pairs]
    summary = {"machine": machine_note(), "steps": args.steps, "save_steps": args.save_steps, "faults": plan,
               "rounds": rounds}
    if args.rounds > 1:  # each faulty run against the median fault-free run: one start-up's luck does not decide
        median_free = statistics.median_low([free["seconds"] for free, _ in pairs])
        free = next(free for free, _ in pairs if free["seconds"] == median_free)
        summary["against_the_median_fault_free_run"] = [
            {k: v for k, v in faulty_round(free, faulty, plan, run, args).items()
             if k in ("fault_free_s", "faulty_s", "goodput", "target_goodput", "target_met")} for _, faulty in pairs]
    print(json.dumps(summary, indent=1))
    if args.smoke and not args.work_dir:
        shutil.rmtree(work_dir)


if __name__ == "__main__":
    main()
