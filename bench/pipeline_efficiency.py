"""Pipeline efficiency: p stages against what p cores deliver, for each pipeline schedule (1F1B, zero_bubble),
next to the 1F1B bound m / (m + p - 1) and the schedule simulator's prediction.

For p stages (one process each, one thread each; default p = 2) and m micro-batches per step (default 4, 8, 16),
measured in one run of p processes:
- cores: every process trains its own copy of the whole model with the trainer's engine at one stage (nothing
  ties the copies together), all at once: what p cores deliver without a pipeline; their tokens/s summed;
- pipeline: tokens/s of the trainer's p-stage engine (training/loop.py build_engine) under each schedule;
- cores in lockstep: the same copies, each waiting for all the others after every forward and every backward of a
  micro-batch, as a pipeline's stages wait for each other's activations and gradients: what coupling the cores
  costs with no schedule at all (this virtual machine slows one core or the other by 10-30% for a second or two at
  a time; a free copy loses only its own time, a pipeline or a lockstep runs at the slower core's pace);
- all of them alternate step by step for --rounds rounds, after --warm-up-rounds untimed ones, so that the machine's
  drift (this virtual machine's speed moves by 10-15% between steps and over minutes) falls on all alike, in
  reverse order every other round, so that no step always runs right after the same other one; each
  throughput is the rounds' tokens over their summed seconds, and the per-round ratios' range is printed beside it;
- ratio = pipeline / cores; 1F1B's bound is m / (m + p - 1); efficiency = ratio / bound; lockstep = cores in
  lockstep / cores, and each pipeline's ratio to the cores in lockstep beside its own;
- simulated: bench/schedule_simulator.py's step from the F, B, W times measured per stage in the same rounds
  (ForwardPass with its batch loading, BackwardInputPass or BackwardPass, BackwardWeightPass; a BackwardPass is
  B + W: 1F1B's, and zero_bubble's on the first stage) plus the optimizer's time, as a ratio beside the measured
  one; and again with those times scaled to add up to the copies' F + B for the same layers: the schedule's own
  ratio, without the stages computing slower than the copies (the gap between measured and simulated is the
  rest: per-operation variation that one stage waits out for the other, transfers, the engine).
Timing runs with glibc keeping freed memory for reuse (large mmap and trim thresholds), as a GPU's caching
allocator does: with glibc's defaults many large tensors are fresh mappings whose pages the kernel zeroes, which
here costs up to a third of a step, and more under the schedule that keeps more tensors alive at once.
While it runs, idle cores poll instead of halting (idle_cores_polling; --idle-halt keeps the machine's
default): a GPU that waited in a receive computes on at full speed, a vCPU of this virtual machine that
halted did not (20 one-thread matmuls right after a 300 ms sleep took 1.007-1.105x, mean 1.049x, their time back to
back over 6 runs; 0.988-1.031x, mean 1.007x, with the cores polling).
Peak RSS per stage comes from separate fresh processes per schedule and m, with a small fixed mmap threshold
(bench/memory_plan_check.py's) so that RSS follows the live tensors, over one step after a warm-up: the peak until
the last W (the schedule's part: activations and gradients; the optimizer's temporaries can hide it in the peak of
the whole step) and over the whole step, each with its rise over the RSS before the step.
Then where each stage's time goes: compute, optimizer (gradient reduction, clipping, step), send, receive (a
receive waits for the peer: bubble, imbalance and transfer), batch loading and the engine's own overhead.

The model (MODEL, SEQ_LENGTH, MICRO_BATCH) is split so that stages do equal work; --hidden-size scales its width
(heads, MLP and vocabulary with it, so that the LM head keeps the cost of about one decoder layer).

  python bench/pipeline_efficiency.py [--rounds 8] [--micro-batches 4 8 16] [--schedules 1f1b zero_bubble]
  python bench/pipeline_efficiency.py --schedules 1f1b zero_bubble zero_bubble:0   # :c = zero_bubble_max_waiting
"""
import argparse
import contextlib
import os
import statistics
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (FIXED_MMAP_THRESHOLD, bench_parser, environment, in_rounds, machine_note,  # noqa: E402
                    parse_args, peak_rss_bytes, random_micro_batches, reset_peak_rss, rss_bytes, run_config, spawn,
                    timed)
from schedule_simulator import predict  # noqa: E402

from deepspeed_internals.access import (instruction_handlers, replace_instruction_handlers,  # noqa: E402
                                        skip_data_parallel_reductions)
from engines.profiling import add_to, time_instructions  # noqa: E402
from schedules.orders import PIPELINE_SCHEDULES  # noqa: E402

# Wide enough that matmuls dominate, as in real LLaMA shapes: B and W then cost about the same (at hidden 512
# element-wise work in B made it 1.2-1.8x W, at hidden 256 up to 2.5x); the vocabulary sized so that the LM head
# with its loss costs about one decoder layer, and the stages [embedding + 4 layers | 3 layers + head] do equal work.
MODEL = dict(vocab_size=12288, hidden_size=1024, intermediate_size=2752, num_hidden_layers=7, num_attention_heads=16,
             num_key_value_heads=16, max_position_embeddings=1024)
SEQ_LENGTH, MICRO_BATCH = 128, 2
# Decoder layers per stage: the LM head (with norm and loss) on the last stage counts as one decoder layer.
PARTITIONS = {1: [7], 2: [4, 3], 4: [2, 2, 2, 1]}
CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**31), "MALLOC_TRIM_THRESHOLD_": str(2**31)}
CATEGORIES = {"ForwardPass": "compute", "BackwardPass": "compute", "BackwardInputPass": "compute",
              "BackwardWeightPass": "compute",
              "OptimizerStep": "optimizer", "ReduceGrads": "optimizer", "ReduceTiedGrads": "optimizer",
              "SendActivation": "send", "SendGrad": "send", "RecvActivation": "receive", "RecvGrad": "receive",
              "LoadMicroBatch": "load"}


def model_config(hidden_size):
    from transformers import LlamaConfig
    scale = hidden_size / MODEL["hidden_size"]
    return LlamaConfig(**dict(MODEL, hidden_size=hidden_size, vocab_size=round(MODEL["vocab_size"] * scale),
                              intermediate_size=round(MODEL["intermediate_size"] * scale),
                              num_attention_heads=round(MODEL["num_attention_heads"] * scale),
                              num_key_value_heads=round(MODEL["num_key_value_heads"] * scale)))


def schedule_and_cap(name):
    """'zero_bubble:1' -> ('zero_bubble', 1): a schedule, and zero_bubble's cap on micro-batches waiting for W."""
    schedule, _, cap = name.partition(":")
    if schedule not in PIPELINE_SCHEDULES or (cap and (schedule != "zero_bubble" or not cap.isdigit())):
        raise argparse.ArgumentTypeError(f"'{name}' is not 1f1b, zero_bubble or zero_bubble:<max waiting>")
    return schedule, int(cap) if cap else None


def checked_schedule(name):
    """--schedules' argument type: the name itself, once schedule_and_cap accepts it."""
    schedule_and_cap(name)
    return name


def build_engine(config, num_stages, micro_batches, name, checkpoint_interval=0):
    """The trainer's engine (training/loop.py) for this model, fp32, one step of m micro-batches."""
    from training.loop import build_engine as trainer_engine
    import torch.distributed as dist

    from training.run_spec import plan_spec
    schedule, cap = schedule_and_cap(name)
    cfg = run_config([f"num_stages={num_stages}", "precision=fp32", "zero_stage=0", f"seq_length={SEQ_LENGTH}",
                      f"micro_batch_size={MICRO_BATCH}", f"gradient_accumulation_steps={micro_batches}",
                      f"partition={PARTITIONS[num_stages]}", "lr_scheduler=constant",
                      f"pipeline_schedule={schedule}", f"zero_bubble_max_waiting={'null' if cap is None else cap}",
                      f"activation_checkpoint_interval={checkpoint_interval}"])
    spec = plan_spec(cfg, dist.get_world_size(), config)
    return trainer_engine(spec, total_steps=10**6, layer_loader=None)[0]


def in_lockstep(engine):
    """A train_batch of `engine` whose every ForwardPass and BackwardPass ends at a barrier of all processes (the
    engine's handlers as they are now, before any timer wraps them)."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    def then_barrier(handler):
        def handled(self, *args, **kwargs):
            handler(self, *args, **kwargs)
            dist.barrier()
        return handled
    now = instruction_handlers(engine)
    handlers = {**now, **{instruction: then_barrier(now[instruction]) for instruction in (ForwardPass, BackwardPass)}}

    def step(batches):
        own = instruction_handlers(engine)
        replace_instruction_handlers(engine, handlers)
        try:
            engine.train_batch(batches)
        finally:
            replace_instruction_handlers(engine, own)
    return step


@contextlib.contextmanager
def idle_cores_polling():
    """Hold Linux's CPU latency request at 0 µs while inside (/dev/cpu_dma_latency, as cyclictest and tuned's
    latency-performance profile do): an idle core polls instead of halting. Yields whether the request holds (it
    needs root)."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        os.write(fd, struct.pack("i", 0))
        yield True
    finally:
        os.close(fd)


def pin_to_core(rank):
    """Each process keeps one core, as each stage keeps its GPU: a stage that sleeps in a receive would otherwise
    wake on whichever core is free, with a cold cache."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def timing_worker(rank, num_stages, micro_batches, rounds, warm_up_rounds, schedules, hidden_size,
                  checkpoint_interval):
    """Alternate, after warm-up rounds: a step of every process's own one-stage copy (all at once), the same in
    lockstep, then a step of the pipeline under each schedule; every step starts at a barrier."""
    import torch.distributed as dist

    from cluster.distributed import init_distributed

    pin_to_core(rank)
    init_distributed(timeout_minutes=30)
    config = model_config(hidden_size)
    engines = {schedule: build_engine(config, num_stages, micro_batches, schedule, checkpoint_interval)
               for schedule in schedules}
    replica = build_engine(config, 1, micro_batches, "1f1b", checkpoint_interval)
    # Every process trains its own copy: no gradient and no loss all-reduce ties the copies' steps together.
    skip_data_parallel_reductions(replica)
    batches = random_micro_batches(config.vocab_size, SEQ_LENGTH, MICRO_BATCH, seed=rank)
    lockstep = in_lockstep(replica)
    steps = {"cores": lambda: replica.train_batch(batches), "lockstep": lambda: lockstep(batches)}
    steps.update({name: (lambda engine=engine: engine.train_batch(batches)) for name, engine in engines.items()})
    for _ in range(warm_up_rounds):
        for step in steps.values():
            step()
    spent = {schedule: {} for schedule in {**engines, "cores": replica}}
    for schedule, engine in {**engines, "cores": replica}.items():
        time_instructions(engine, add_to(spent[schedule]))

    def started_together(step):
        dist.barrier()
        return timed(step)
    seconds = in_rounds({name: lambda step=step: started_together(step) for name, step in steps.items()}, rounds)
    dist.destroy_process_group()
    return {"stage": engines[schedules[0]].stage_id, "seconds": seconds,
            "spent": {s: {k: v / rounds for k, v in spent[s].items()} for s in spent}}


def memory_worker(rank, num_stages, micro_batches, schedule, hidden_size, checkpoint_interval):
    """Peak RSS until the last W and over one step after a warm-up, and the RSS before it."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.schedule import ReduceTiedGrads

    from cluster.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    config = model_config(hidden_size)
    engine = build_engine(config, num_stages, micro_batches, schedule, checkpoint_interval)
    batches = random_micro_batches(config.vocab_size, SEQ_LENGTH, MICRO_BATCH, seed=rank)
    engine.train_batch(batches)
    schedule_peaks = record_peak_before(engine, ReduceTiedGrads)
    dist.barrier()
    reset_peak_rss()
    start = rss_bytes()
    engine.train_batch(batches)
    peak = peak_rss_bytes()
    dist.barrier()  # a stage that tears down gloo while its peer still steps aborts it (seen with 1F1B)
    dist.destroy_process_group()
    return {"stage": engine.stage_id, "peak": peak, "schedule_peak": schedule_peaks[-1], "start": start}


def record_peak_before(engine, instruction):
    """[peak RSS so far] appended each time the engine is about to run `instruction`."""
    peaks, handler = [], instruction_handlers(engine)[instruction]

    def recorded(self, *args, **kwargs):
        peaks.append(peak_rss_bytes())
        handler(self, *args, **kwargs)
    replace_instruction_handlers(engine, {**instruction_handlers(engine), instruction: recorded})
    return peaks


def run_workers(worker, num_stages, env, *args):
    """worker in num_stages fresh processes with env set; [result per stage]."""
    with environment(env):  # read by each spawned interpreter's malloc at start-up
        ranks = spawn(worker, num_stages, *args)
    return sorted(ranks, key=lambda r: r["stage"])


def stage_times(ranks, schedule, m):
    """F (with its batch loading), B and W seconds per micro-batch of each stage, and the optimizer's own time per
    step: the least over stages, as the others' includes waiting at the clipping all-reduce for the last stage to
    finish its backward (already in the simulated schedule)."""
    times = []
    for rank in ranks:
        spent = rank["spent"][schedule]
        backward = spent.get("BackwardPass", 0.0) + spent.get("BackwardInputPass", 0.0)
        times.append({"F": (spent.get("ForwardPass", 0.0) + spent.get("LoadMicroBatch", 0.0)) / m,
                      "B": backward / m, "W": spent.get("BackwardWeightPass", 0.0) / m})
    optimizer = min(sum(v for k, v in rank["spent"][schedule].items() if CATEGORIES.get(k) == "optimizer")
                    for rank in ranks)
    return times, optimizer


def throughputs(ranks, name, tokens):
    """Tokens/s over all rounds of the free copies (summed) and of `name`: the pipeline under a schedule (a step ends
    when its last stage's does) or the copies in lockstep (summed); and each round's ratio of the two."""
    rounds = len(ranks[0]["seconds"]["cores"])
    cores = sum(tokens * rounds / sum(rank["seconds"]["cores"]) for rank in ranks)
    if name == "lockstep":
        steps = [tokens / sum(tokens / rank["seconds"][name][i] for rank in ranks) for i in range(rounds)]
    else:
        steps = [max(rank["seconds"][name][i] for rank in ranks) for i in range(rounds)]
    per_round = [tokens / steps[i] / sum(tokens / rank["seconds"]["cores"][i] for rank in ranks)
                 for i in range(rounds)]
    return cores, tokens * rounds / sum(steps), per_round


def copy_times(ranks, m):
    """F and B (W 0: one fused backward) per micro-batch of the one-stage engine's copy on the first rank."""
    return stage_times(ranks[:1], "cores", m)[0][0]


def at_copies_speed(times, copy):
    """The stages' F, B, W scaled by one factor so that they add up to the copy's F + B for the same layers: what
    the stages would take computing as fast as the copies do."""
    scale = sum(copy.values()) / sum(sum(t.values()) for t in times)
    return [{kind: scale * seconds for kind, seconds in t.items()} for t in times]


def report(num_stages, m, ranks, schedules):
    tokens = m * MICRO_BATCH * SEQ_LENGTH
    bound = m / (m + num_stages - 1)
    copy = copy_times(ranks, m)
    cores, lockstep, per_round = throughputs(ranks, "lockstep", tokens)
    print(f"p={num_stages} m={m:>2} {'lockstep':<13} cores {cores:>5.0f} tok/s  in lockstep {lockstep:>5.0f} tok/s  "
          f"ratio {lockstep / cores:.3f} (rounds {min(per_round):.3f}-{max(per_round):.3f}): the free copies "
          f"waiting for each other after every forward and backward", flush=True)
    for schedule in schedules:
        cores, pipeline, per_round = throughputs(ranks, schedule, tokens)
        times, optimizer = stage_times(ranks, schedule, m)
        kind, cap = schedule_and_cap(schedule)
        simulated = predict(num_stages, m, times, optimizer, cap)[kind][0]
        schedule_alone = predict(num_stages, m, at_copies_speed(times, copy), optimizer, cap)[kind][0]
        ratio, step = pipeline / cores, tokens / pipeline
        print(f"p={num_stages} m={m:>2} {schedule:<13} cores {cores:>5.0f} tok/s  pipeline {pipeline:>5.0f} tok/s  "
              f"ratio {ratio:.3f} (rounds {min(per_round):.3f}-{max(per_round):.3f}; to the cores in lockstep "
              f"{pipeline / lockstep:.3f})  simulated {tokens / simulated / cores:.3f} "
              f"(step {step:.3f} s, simulated {simulated:.3f} s, {100 * (simulated / step - 1):+.1f}%; "
              f"at the copies' compute speed {tokens / schedule_alone / cores:.3f})  "
              f"1F1B bound {bound:.3f}  efficiency vs bound {ratio / bound:.3f}", flush=True)


def print_details(num_stages, m, ranks, schedules):
    names = ["compute", "optimizer", "send", "receive", "load"]
    for schedule in schedules:
        times, optimizer = stage_times(ranks, schedule, m)
        print(f"  {schedule}, m={m}, per micro-batch: " + "; ".join(
            f"stage {s}: F {1e3 * t['F']:.1f} B {1e3 * t['B']:.1f} W {1e3 * t['W']:.1f} ms"
            for s, t in enumerate(times)) + f"; optimizer {1e3 * optimizer:.0f} ms/step")
        for rank in ranks:
            wall = statistics.mean(rank["seconds"][schedule])
            spent = {}
            for name, seconds in rank["spent"][schedule].items():
                spent[CATEGORIES.get(name, "other")] = spent.get(CATEGORIES.get(name, "other"), 0.0) + seconds
            engine = wall - sum(spent.values())
            print(f"    stage {rank['stage']} time: " + "  ".join(
                f"{name} {100 * spent.get(name, 0) / wall:.1f}%" for name in names + ["other"] if name in spent
                or name != "other") + f"  engine {100 * engine / wall:.1f}%")
    one_stage = copy_times(ranks, m)
    for schedule in schedules:
        summed = sum(sum(t.values()) for t in stage_times(ranks, schedule, m)[0])
        print(f"    {schedule}: the stages' F + B + W per micro-batch, summed, is "
              f"{summed / sum(one_stage.values()):.3f}x "
              f"the one-stage engine's F + B ({1e3 * one_stage['F']:.1f} + {1e3 * one_stage['B']:.1f} ms) for the "
              f"same layers")
    print(f"    the 1F1B bubble alone idles each stage {100 * (num_stages - 1) / (m + num_stages - 1):.1f}% of a step")


def print_memory(num_stages, m, memory):
    for key, what in (("schedule_peak", "until the last W"), ("peak", "over the step")):
        for schedule, ranks in memory.items():
            print(f"  peak RSS {what}, m={m:>2} {schedule:<12} " + "  ".join(
                f"stage {r['stage']}: {r[key] / 2**20:.0f} MiB (+{(r[key] - r['start']) / 2**20:.0f})"
                for r in ranks))
        for schedule in (s for s in memory if s != "1f1b" and "1f1b" in memory):
            print(f"    {schedule} / 1f1b: " + "  ".join(
                f"stage {a['stage']} {a[key] / b[key]:.3f} (rise {(a[key] - a['start']) / (b[key] - b['start']):.3f})"
                for a, b in zip(memory[schedule], memory["1f1b"])))


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2, choices=sorted(PARTITIONS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zero_bubble"], type=checked_schedule,
                        help="1f1b, zero_bubble, or zero_bubble:<c> with zero_bubble_max_waiting=c")
    parser.add_argument("--hidden-size", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--warm-up-rounds", type=int, default=2,
                        help="untimed rounds first: a round after one still spent up to 1.3 s per step in page faults "
                             "as the engines' memory settled")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    parser.add_argument("--no-timing", action="store_true", help="only the peak-RSS runs")
    parser.add_argument("--idle-halt", action="store_true",
                        help="let idle cores halt, the machine's default (by default they poll while this runs)")
    args = parse_args(parser, rounds=1, micro_batches=[2], hidden_size=64, warm_up_rounds=0, idle_halt=True)
    config = model_config(args.hidden_size)
    with contextlib.nullcontext(False) if args.idle_halt else idle_cores_polling() as polling:
        idle = ("poll (/dev/cpu_dma_latency held at 0)" if polling else
                "halt" + ("" if args.idle_halt else " (/dev/cpu_dma_latency cannot be opened)"))
        print(f"model: hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
              f"{config.num_hidden_layers} layers, vocabulary {config.vocab_size}; seq_length {SEQ_LENGTH}, "
              f"micro-batch {MICRO_BATCH}, fp32, one thread per process; {args.rounds} interleaved rounds after "
              f"{args.warm_up_rounds} warm-up rounds; activation checkpointing every "
              f"{args.activation_checkpoint_interval} layers (0: off); idle cores {idle}")
        for m in args.micro_batches:
            if not args.no_timing:
                ranks = run_workers(timing_worker, args.stages, CACHING_MALLOC, args.stages, m, args.rounds,
                                    args.warm_up_rounds, args.schedules, args.hidden_size,
                                    args.activation_checkpoint_interval)
                report(args.stages, m, ranks, args.schedules)
                print_details(args.stages, m, ranks, args.schedules)
            if not args.no_memory:
                memory = {schedule: run_workers(memory_worker, args.stages,
                                                FIXED_MMAP_THRESHOLD, args.stages, m,
                                                schedule, args.hidden_size, args.activation_checkpoint_interval)
                          for schedule in args.schedules}
                print_memory(args.stages, m, memory)
    print(machine_note())


if __name__ == "__main__":
    main()
