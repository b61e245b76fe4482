"""The trainer as a user runs it against transformers' own training loop, end to end, and where its step time goes.

For a workload (a LLaMA shape with random weights, fp32, one thread per process, m micro-batches per step), in
interleaved rounds (reversed every other round, so that the machine's drift falls on all alike):
- transformers: transformers' LlamaForCausalLM with torch's AdamW, forward and backward per micro-batch (bench/
  layer_overhead.py's loop), one process alone, and two processes at once (what two cores deliver);
- the trainer: `deepspeed --num_gpus N trainer_pipe.py ... profile=true` on 1 stage, and on 2 stages under each
  pipeline schedule (1f1b, zero_bubble, interleaved_1f1b with virtual_stages=2, zbv), its step time from the
  profile (the first step left out, as for the loop's warm-up step), its losses against 2-stage 1F1B's, and (for
  the chunked schedules) the stage plan's layers per rank; "2 stages zbv" runs the trainer's default zbv_times=auto
  (the V order made for the times the trainer measures in step 2), "2 stages zbv equal" the order made for
  F = B = W (zbv_times=null), "2 stages zbv measured" the order made for the F, B and W CPU times per stage
  measured in the latest "2 stages zbv" run (zbv_times set by hand, as profile=true's user would).
With --at-once a round's trainer runs run at the same time, each in its own copy of the model and data, so that
a shared host's load falls on all alike (their CPU seconds are then the comparison). Prints each round's ratios
(1 stage ÷ one loop, 2 stages ÷ two loops at once) and their spread, then, from the last round's profiles
(engines/profiling.py), milliseconds per step on each stage: each engine instruction, the engine's own work between
them, and the loop's work between steps; and each stage's compute (F + B + W) against the start-up
plan's FLOPs (planner/stage_costs.py), which `partition: balanced` (the default) evens out.
Then the same ratios in CPU seconds of each process's training thread, which a shared host's load changes far less
than wall-clock time: a loop's step, the 1-stage trainer's step, and for 2 stages the step the schedule takes
(schedules/orders.py simulate, on the order the trainer runs) from each stage's F, B and W CPU seconds (a chunked
schedule's F, B and W summed over its rank's chunks, which the simulation shares out evenly), with everything else
the stage's thread did in the step (optimizer, engine, loop, the CPU side of transfers) added as if nothing
overlapped it.

  python bench/trainer_profile.py [--workload small|small-even|smollm2] [--rounds 3] [--steps 6] [--partition P]
                                  [--zbv-partition P] [--at-once]
                                  [--contenders "one loop" "1 stage" ...] [--set KEY=VALUE ...]
                                  [--micro-batches 8]
  python bench/trainer_profile.py --workload smollm2 --matmul-share   # the 1-stage ceiling, from transformers' loop
"""
import concurrent.futures
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, launch_training, machine_note, parse_args, spawn  # noqa: E402

from schedules.orders import rank_orders  # noqa: E402
from schedules.simulator import simulate  # noqa: E402
from schedules.zbv_order import ZBV_TIMES_SPREAD, configured_zbv_durations  # noqa: E402

SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024)
WORKLOADS = {  # the shapes of issue 31's table; smollm2 is SmolLM2-135M's published config
    "small": (SMALL, 256, 4),
    # small with 7 decoder layers: its LM head and loss do one decoder layer's work, so 4 | 3 + head splits evenly,
    # as bench/pipeline_efficiency.py's model does by construction
    "small-even": (dict(SMALL, num_hidden_layers=7), 256, 4),
    "smollm2": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                     tie_word_embeddings=True, rope_theta=100000.0), 256, 2),
    # the smoke size of the scripts that take a workload (--smoke)
    "tiny": (dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64), 32, 2),
}
CONTENDERS = ["one loop", "1 stage", "two loops", "2 stages 1f1b", "2 stages zero_bubble",
              "2 stages interleaved_1f1b", "2 stages zbv", "2 stages zbv equal", "2 stages zbv measured"]
SMOKE_CONTENDERS = ["two loops", "2 stages zbv", "2 stages zbv measured"]
VIRTUAL_STAGES = 2  # interleaved_1f1b's chunks per rank
TRAINER_RUNS = {"1 stage": (1, "1f1b"), "2 stages 1f1b": (2, "1f1b"), "2 stages zero_bubble": (2, "zero_bubble"),
                "2 stages interleaved_1f1b": (2, "interleaved_1f1b"), "2 stages zbv": (2, "zbv"),
                "2 stages zbv equal": (2, "zbv"), "2 stages zbv measured": (2, "zbv")}
# each 2-stage run's tokens/s ÷ another's: the loops', and the schedule it improves on
RATIOS = [("1 stage", "one loop"), *((name, "two loops") for name in TRAINER_RUNS if name.startswith("2")),
          ("2 stages zero_bubble", "2 stages 1f1b"), ("2 stages interleaved_1f1b", "2 stages 1f1b"),
          ("2 stages zbv", "2 stages zero_bubble"), ("2 stages zbv", "2 stages 1f1b"),
          ("2 stages zbv", "2 stages zbv equal"), ("2 stages zbv measured", "2 stages zero_bubble"),
          ("2 stages zbv measured", "2 stages zbv")]


def make_model(work, fields, seq_length, micro_batch, micro_batches, steps):
    """The model converted for the trainer, and enough pre-tokenized rows of seq_length tokens for its steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from checkpoints.hf_to_ds import convert_hf_to_ds
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(os.path.join(work, "hf"))
    convert_hf_to_ds(os.path.join(work, "hf"), os.path.join(work, "ds"))
    generator = torch.Generator().manual_seed(0)
    with open(os.path.join(work, "train.jsonl"), "w") as f:
        for _ in range((steps + 1) * micro_batches * micro_batch):
            ids = torch.randint(3, fields["vocab_size"], (seq_length,), generator=generator).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")


def transformers_step(rank, fields, seq_length, micro_batch, micro_batches):
    """One training step of transformers' loop (bench/layer_overhead.py's), each process on its own batches."""
    from transformers import LlamaConfig

    from layer_overhead import transformers_step as loop_step
    return loop_step(LlamaConfig(**fields), seq_length, micro_batch, micro_batches, seed=rank)


def transformers_loop(rank, fields, seq_length, micro_batch, micro_batches, steps):
    """transformers' loop for 1 + steps steps: the wall-clock and CPU seconds of each step after the first."""
    step = transformers_step(rank, fields, seq_length, micro_batch, micro_batches)
    seconds, cpu_seconds = [], []
    for _ in range(steps + 1):
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.thread_time() - start_cpu)
    return {"seconds": seconds[1:], "cpu_seconds": cpu_seconds[1:]}


MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def matmul_share(rank, fields, seq_length, micro_batch, micro_batches):
    """Where one step of transformers' loop spends its time (torch.profiler, after a warm-up step): matrix
    products and attention kernels, which any exact implementation runs too, the optimizer, and the rest. Prints
    the most an implementation running the same products and attention at the same speed, and nothing else, could
    gain: 1 / their share (issue 31's 1-stage target is 1.10x)."""
    from torch.profiler import ProfilerActivity, profile

    step = transformers_step(rank, fields, seq_length, micro_batch, micro_batches)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kinds = {"matrix products": sum(e.self_cpu_time_total for e in events if e.key in MATRIX_PRODUCTS),
             "attention kernels": sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key),
             "optimizer": sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#"))}
    kinds["the rest"] = total - sum(kinds.values())
    print(f"transformers' loop, one step ({wall:.1f} s, m = {micro_batches}), time by kind: "
          + ", ".join(f"{k} {v / 1e6:.2f} s ({v / total:.1%})" for k, v in kinds.items()))
    unavoidable = (kinds["matrix products"] + kinds["attention kernels"]) / total
    print(f"the same products and attention at the same speed, and nothing else: at most {1 / unavoidable:.3f}x "
          "transformers' loop")


def run_trainer(work, name, seq_length, micro_batch, micro_batches, steps, partition, extra_overrides):
    """One trainer_pipe.py run with profile=true; returns {stage: profile} (engines/profiling.py's files), its
    losses per step (metrics.jsonl), its stage plan's layers per stage (the plan's table from its output) and,
    under zbv_times=auto, the times the trainer made its V order for (its log line), else None."""
    num_stages, schedule = TRAINER_RUNS[name]
    out = os.path.join(work, "run")
    shutil.rmtree(out, ignore_errors=True)
    overrides = [f"model_name_or_path={os.path.join(work, 'ds')}", f"train_file={os.path.join(work, 'train.jsonl')}",
                 "eval_file=null", f"output_dir={out}", "data.format=pretokenized", f"seq_length={seq_length}",
                 f"micro_batch_size={micro_batch}", f"gradient_accumulation_steps={micro_batches}",
                 f"num_stages={num_stages}", f"pipeline_schedule={schedule}", "precision=fp32", "zero_stage=0",
                 f"max_steps={steps + 1}", "logging_steps=1", "save_steps=0", "save_total_limit=1",
                 "lr_scheduler=constant", "warmup_steps=1", "profile=true", "export_hf=false",
                 f"data.cache_dir={os.path.join(work, 'cache')}", *([f"partition={partition}"] if partition else []),
                 *([f"virtual_stages={VIRTUAL_STAGES}"] if schedule == "interleaved_1f1b" else []),
                 *(["zbv_times=null"] if name == "2 stages zbv equal" else []), *extra_overrides]
    result, _, _ = launch_training(num_stages, overrides, env={"OMP_NUM_THREADS": "1"})
    profiles = [json.load(open(os.path.join(out, "profile", n))) for n in sorted(os.listdir(os.path.join(out, "profile")))]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [record["loss"] for record in map(json.loads, f) if record.get("loss") is not None]
    output = result.stdout + result.stderr
    return {p["stage"]: p for p in profiles}, losses, stage_plan(output), auto_zbv_times(output)


def auto_zbv_times(output):
    """zbv_times=auto's measured times per stage from the trainer's log line (engines/chunked_engine.py), or None."""
    line = next((line for line in output.splitlines() if line.startswith("zbv_times=auto:")), None)
    if line is None:
        return None
    cells = line.split(" step ", 1)[1].split(";")[0].split(", ")
    return [[int(t) for t in cell.split()[-1].split("/")] for cell in cells]


def stage_plan(output):
    """The stage plan's rows (planner/stage_costs.py format_stage_plan: stage, layers, decoders, ..., memory in GiB)
    from a run's output, as "stage 0: layers 0-2+8-10 (3 decoders)"."""
    rows = [line.split() for line in output.splitlines() if "GiB" in line]
    return "; ".join(dict.fromkeys(f"stage {fields[0]}: layers {fields[1]} ({fields[2]} decoders)" for fields in rows
                                   if len(fields) == 7 and fields[0].isdigit() and fields[2].isdigit()))


def step_seconds(profiles):
    """A pipeline step ends when its slowest stage's does; the last step carries the final checkpoint: left out."""
    steps = zip(*(p["step_seconds"][:-1] for p in profiles.values()))
    return [max(step) for step in steps]


FORWARD = ("ForwardPass", "LoadMicroBatch", "ChunkForwardPass")  # a chunk's forward loads its micro-batch itself
INPUT_BACKWARD = ("BackwardPass", "BackwardInputPass", "ChunkBackwardPass")  # unsplit (1f1b, interleaved): B + W
WEIGHT_BACKWARD = ("BackwardWeightPass",)


def cpu_step_seconds(profiles, schedule, micro_batches, zbv_times=None):
    """The CPU seconds of a step: one stage's training thread; for several stages simulated_cpu_step's."""
    if len(profiles) == 1:
        (profile,) = profiles.values()
        return statistics.mean(profile["step_cpu_seconds"][:-1])
    return sum(simulated_cpu_step(profiles, schedule, micro_batches, zbv_times)[1:])


def measured_zbv_times(profiles, micro_batches):
    """zbv_times from a run's profiles: each stage's [F, B, W] CPU ms per micro-batch, each raised to 1 /
    ZBV_TIMES_SPREAD of the longest as the trainer's zbv_times=auto does (a small chunk's W can take a tenth of its F,
    which zbv_times refuses), and to at least 1 ms (zbv_times takes positive whole numbers here)."""
    times, _, _ = simulated_cpu_step(profiles, "zbv", micro_batches)
    milliseconds = [[1e3 * stage_times[kind] for kind in "FBW"] for stage_times in times]
    floor = max(1, math.ceil(max(map(max, milliseconds)) / ZBV_TIMES_SPREAD))
    return [[max(floor, round(t)) for t in stage_ms] for stage_ms in milliseconds]


def simulated_cpu_step(profiles, schedule, micro_batches, zbv_times=None):
    """(each stage's {"F", "B", "W"} CPU seconds per micro-batch (a chunked schedule's over all its rank's chunks,
    which simulate shares out evenly), the schedule's order (the one the trainer runs: zbv's for zbv_times, or for
    F = B = W) simulated from them, the most CPU any stage's thread spent on anything else in the step (optimizer,
    engine, loop, transfers), counted as if nothing overlapped it). The final checkpoint's step is left out."""
    def per_step(profile, names):
        return sum(profile["instructions_cpu"].get(n, 0.0) for n in names) / len(profile["step_seconds"])
    stage_profiles = [p for _, p in sorted(profiles.items())]
    times = [{"F": per_step(p, FORWARD) / micro_batches, "B": per_step(p, INPUT_BACKWARD) / micro_batches,
              "W": per_step(p, WEIGHT_BACKWARD) / micro_batches} for p in stage_profiles]
    rest = max(statistics.mean(p["step_cpu_seconds"][:-1]) - micro_batches * sum(t.values())
               for t, p in zip(times, stage_profiles))
    virtual_stages = VIRTUAL_STAGES if schedule == "interleaved_1f1b" else 1
    orders = rank_orders(schedule, len(profiles), micro_batches, virtual_stages,
                         zbv_times=configured_zbv_durations(zbv_times))
    done = simulate(len(profiles), micro_batches, times, schedule, virtual_stages=virtual_stages, orders=orders)
    return times, max(end for _, end in done.values()), rest


def print_simulation(name, profiles, schedule, micro_batches, zbv_times=None):
    """The CPU-second simulation of a multi-stage run: F, B, W per micro-batch on each stage, the compute of all
    stages, the simulated schedule and its idle share (bubble and imbalance: 1 - compute / (stages x schedule))."""
    times, schedule_seconds, rest = simulated_cpu_step(profiles, schedule, micro_batches, zbv_times)
    compute = micro_batches * sum(sum(t.values()) for t in times)
    print(f"  {name}: CPU ms per micro-batch F/B/W " + ", ".join(
        f"stage {stage} {1e3 * t['F']:.0f}/{1e3 * t['B']:.0f}/{1e3 * t['W']:.0f}" for stage, t in enumerate(times))
        + f"; compute of all stages {1e3 * compute:.0f} ms, schedule {1e3 * schedule_seconds:.0f} ms (idle "
        f"{1 - compute / (len(times) * schedule_seconds):.1%}), + rest {1e3 * rest:.0f} ms")
    # What keeps the step from its bound: the partition's granularity (the same compute spread evenly over the
    # stages) and the rest, which no schedule overlaps (the optimizer step waits for every stage's gradients: the
    # clipping norm, the tied weights' sum)
    even = [{kind: statistics.mean(t[kind] for t in times) for kind in "FBW"}] * len(times)
    virtual_stages = VIRTUAL_STAGES if schedule == "interleaved_1f1b" else 1
    even_seconds = max(end for _, end in simulate(len(times), micro_batches, even, schedule,
                                                  virtual_stages=virtual_stages).values())
    share = [compute / (len(times) * seconds) for seconds in (schedule_seconds, schedule_seconds + rest)]
    bound = micro_batches / (micro_batches + len(times) - 1)
    print(f"  {name}: step on stages of even compute ÷ this step {even_seconds / schedule_seconds:.3f}, with the rest "
          f"{even_seconds / (schedule_seconds + rest):.3f}; compute ÷ (stages x step) ÷ the 1F1B bound {bound:.3f}: "
          f"{share[0] / bound:.3f}, with the rest {share[1] / bound:.3f}")


def transformers_seconds(fields, seq_length, micro_batch, micro_batches, steps, processes):
    """Per process, {"seconds": [...], "cpu_seconds": [...]} of its timed steps."""
    return spawn(transformers_loop, processes, fields, seq_length, micro_batch, micro_batches, steps)


def tokens_per_second(tokens, seconds):
    return tokens * len(seconds) / sum(seconds)


def print_ratios(kind, rates, contenders, micro_batches):
    """Each trainer run's tokens/s ÷ its transformers contender's (and a schedule's ÷ the one it improves on), over
    the rounds and each round's, and for 2 stages ÷ the loops ÷ the 1F1B bound m / (m + p - 1) too."""
    bound = micro_batches / (micro_batches + 1)
    for name, base in RATIOS:
        if name not in contenders or base not in contenders:
            continue
        ratios = [a / b for a, b in zip(rates[name], rates[base])]
        ratio = sum(rates[name]) / sum(rates[base])
        print(f"{kind}{name} ÷ {base}: {ratio:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"
              + (f", {ratio / bound:.3f} of the 1F1B bound {bound:.3f}" if base == "two loops" else ""))


def print_profile(name, profiles, cpu=False):
    """ms per step on each stage, wall-clock or (cpu) the training thread's CPU."""
    suffix = "_cpu" if cpu else ""
    print(f"{name}: {'CPU ' if cpu else ''}ms per step (mean over the profiled steps; the final checkpoint left out)")
    for stage, profile in sorted(profiles.items()):
        steps = len(profile["step_seconds"])
        instructions = {k: 1e3 * v / steps
                        for k, v in sorted(profile["instructions" + suffix].items(), key=lambda i: -i[1])}
        loop = {k: 1e3 * v / steps for k, v in profile["loop" + suffix].items()}
        engine_own = loop["train_batch"] - sum(instructions.values())
        step = 1e3 * statistics.mean(profile["step_cpu_seconds" if cpu else "step_seconds"][:-1])
        print(f"  stage {stage}: step {step:.0f} ms = " + ", ".join(f"{k} {v:.0f}" for k, v in instructions.items())
              + f", engine's own {engine_own:.0f}, " + ", ".join(f"{k} {v:.1f}" for k, v in loop.items()
                                                                    if k not in ("train_batch", "checkpoint")))


COMPUTE = ("ForwardPass", "BackwardPass", "BackwardInputPass", "BackwardWeightPass", "ChunkForwardPass",
           "ChunkBackwardPass")


def print_plan_check(name, profiles):
    """Each stage's compute time (F + B + W) against the start-up plan's FLOPs: the time each stage would take if the
    step's measured compute were shared out as the plan's FLOPs are."""
    measured = {stage: sum(p["instructions"].get(i, 0.0) for i in COMPUTE) / len(p["step_seconds"])
                for stage, p in profiles.items()}
    planned = {stage: p["planned_tflops_per_micro_batch"] for stage, p in profiles.items()}
    total_measured, total_planned = sum(measured.values()), sum(planned.values())
    cells = []
    for stage in sorted(profiles):
        predicted = total_measured * planned[stage] / total_planned
        cells.append(f"stage {stage} {1e3 * measured[stage]:.0f} ms vs plan {1e3 * predicted:.0f} ms "
                     f"({measured[stage] / predicted - 1:+.1%})")
    print(f"  {name}: compute per step against the plan's FLOPs: " + ", ".join(cells))


def print_losses_and_plans(losses, plans):
    """Each 2-stage run's largest loss difference from 2-stage 1F1B's (the last round's runs, same data, same
    seed), and its stage plan's layers per stage."""
    reference = losses.get("2 stages 1f1b")
    for name in losses:
        if name.startswith("2"):
            difference = (f"largest loss difference from 1F1B's over {len(reference)} steps "
                          f"{max(abs(a - b) for a, b in zip(losses[name], reference)):.3g}" if reference else "")
            print(f"{name}: {difference}; plan {plans[name]}")


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--micro-batches", type=int, default=8, help="m: micro-batches per step (every contender)")
    parser.add_argument("--partition", help="the trainer's partition (default: conf/base.yaml's)")
    parser.add_argument("--zbv-partition", help="the zbv runs' partition, e.g. [2,2,2,2] (decoder layers per chunk)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more Hydra overrides for every trainer run, e.g. compile=true")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS,
                        help="which runs (default: all; the ratios need each run's loop)")
    parser.add_argument("--at-once", action="store_true",
                        help="run a round's trainer runs at the same time (the same load on a shared host)")
    parser.add_argument("--matmul-share", action="store_true",
                        help="only profile transformers' loop: the share of its step in matrix products and attention")
    args = parse_args(parser, workload="tiny", rounds=1, steps=1, micro_batches=4, matmul_share=True,
                      contenders=SMOKE_CONTENDERS)
    if "2 stages zbv measured" in args.contenders and "2 stages zbv" not in args.contenders:
        parser.error('"2 stages zbv measured" takes its times from "2 stages zbv": name both')
    if args.at_once and "2 stages zbv measured" in args.contenders:
        parser.error('"2 stages zbv measured" takes its times from an earlier "2 stages zbv" run: not with --at-once')
    fields, seq_length, micro_batch = WORKLOADS[args.workload]
    if args.matmul_share:
        spawn(matmul_share, 1, fields, seq_length, micro_batch, args.micro_batches)
        print(machine_note())
        if not args.smoke:  # which runs it before the others
            return
    m = args.micro_batches
    tokens = m * micro_batch * seq_length
    with tempfile.TemporaryDirectory() as work:
        make_model(work, fields, seq_length, micro_batch, m, args.steps + 1)
        print(f"workload {args.workload}: {fields}, seq {seq_length}, micro-batch {micro_batch}, m = {m}, "
              f"fp32, 1 thread per process, {args.steps} timed steps per run, {args.rounds} rounds", flush=True)
        contenders = [name for name in CONTENDERS if name in args.contenders]
        rates = {name: [] for name in contenders}
        cpu_rates = {name: [] for name in contenders}  # tokens per CPU second of a step, as above
        profiles, losses, plans, zbv_times = {}, {}, {}, {}
        # --at-once: each trainer run in its own copy of the model and data, all of a round's at the same time
        works = {name: os.path.join(work, name.replace(" ", "_")) for name in contenders if name in TRAINER_RUNS}
        for name, run_work in works.items() if args.at_once else ():
            os.makedirs(run_work)
            make_model(run_work, fields, seq_length, micro_batch, m, args.steps + 1)

        def trainer(name):
            if name == "2 stages zbv measured":
                zbv_times[name] = measured_zbv_times(profiles["2 stages zbv"], m)
            extra = [*args.set, *([f"zbv_times={zbv_times[name]}".replace(" ", "")]
                                  if name == "2 stages zbv measured" else [])]
            return run_trainer(works[name] if args.at_once else work, name, seq_length, micro_batch, m, args.steps + 1,
                               args.zbv_partition if "zbv" in name and args.zbv_partition else args.partition, extra)

        for round_index in range(args.rounds):
            order = contenders[::1 if round_index % 2 == 0 else -1]
            if args.at_once:
                with concurrent.futures.ThreadPoolExecutor(len(works)) as pool:
                    at_once = dict(zip(works, pool.map(trainer, works)))
            for name in order:
                if name in TRAINER_RUNS:
                    profiles[name], losses[name], plans[name], auto_times = (
                        at_once[name] if args.at_once else trainer(name))
                    if auto_times:  # the order the trainer ran from step 3 on
                        zbv_times[name] = auto_times
                    rates[name].append(tokens_per_second(tokens, step_seconds(profiles[name])))
                    cpu_rates[name].append(tokens / cpu_step_seconds(profiles[name], TRAINER_RUNS[name][1], m,
                                                                     zbv_times.get(name)))
                else:
                    loops = transformers_seconds(fields, seq_length, micro_batch, m, args.steps,
                                                 1 if name == "one loop" else 2)
                    rates[name].append(sum(tokens_per_second(tokens, s["seconds"]) for s in loops))
                    cpu_rates[name].append(sum(tokens_per_second(tokens, s["cpu_seconds"]) for s in loops))
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {rates[n][-1]:.0f} tok/s ({cpu_rates[n][-1]:.0f} per "
                                                         f"CPU s)" for n in contenders), flush=True)
        for kind, measured in (("", rates), ("in CPU seconds, ", cpu_rates)):
            print_ratios(kind, measured, contenders, m)
        print_losses_and_plans(losses, plans)
        for cpu in (False, True):
            for name, stage_profiles in profiles.items():
                print_profile(name, stage_profiles, cpu)
        for name, stage_profiles in profiles.items():
            if len(stage_profiles) > 1:
                print_plan_check(name, stage_profiles)
                print_simulation(name, stage_profiles, TRAINER_RUNS[name][1], m, zbv_times.get(name))
        for name, times in zbv_times.items():
            print(f"{name}: zbv_times={times} (the last round's)")
    print(machine_note())


if __name__ == "__main__":
    main()
