"""Step time and bubble of each pipeline schedule from the F, B and W times of each stage.

F: a micro-batch's forward; B: its input-gradient backward (what the previous stage waits for); W: its
weight-gradient backward (under 1F1B and interleaved 1F1B a backward is B + W). Times are a stage's (all layers of
a rank); the chunk schedules split them evenly over a rank's chunks (interleaved_1f1b: --virtual-stages, zbv: 2).
The schedules are the ones the trainer runs (schedules/orders.py simulates their orders in time, transfers free),
so a measured F, B, W predicts a measured step; bench/pipeline_efficiency.py prints the prediction beside its
measurements.

  python bench/schedule_simulator.py --stages 2 --micro-batches 8 --times 0.030,0.032,0.025
  python bench/schedule_simulator.py --stages 2 --micro-batches 8 --times 0.03,0.03,0.02 0.03,0.04,0.02  # per stage
  python bench/schedule_simulator.py --overhead 0.05 ...   # seconds each step adds (optimizer, loads)
  python bench/schedule_simulator.py --max-waiting 0 1 ...  # zero_bubble with zero_bubble_max_waiting capped
  python bench/schedule_simulator.py [--config llama3_70b]  # a shipped config on paper (times from its FLOPs)
  python bench/schedule_simulator.py --table --times 1,1,1   # every schedule, p = 2, 4, 8 and m = p ... 64

bubble = 1 - (compute of all stages) / (stages x step): the fraction of the devices' time spent idle.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from schedules.orders import PIPELINE_SCHEDULES  # noqa: E402
from schedules.simulator import simulate  # noqa: E402

SMOKE_HELP = "the shipped config on paper with zero_bubble_max_waiting 0 too (tests/test_bench.py)"


def predict(stages, micro_batches, times, overhead=0.0, max_waiting=None, virtual_stages=2):
    """{schedule: (step seconds, bubble fraction)}; times: one {"F", "B", "W"} per stage (or one for all);
    max_waiting: zero_bubble's and zbv's cap on micro-batches waiting for W (None: none but the schedule's own);
    interleaved_1f1b with virtual_stages chunks per rank where m is a multiple of p (else left out)."""
    times = list(times) * stages if len(times) == 1 else list(times)
    if len(times) != stages:
        raise ValueError(f"{len(times)} stage times for {stages} stages: give one for all or one per stage.")
    work = sum(micro_batches * (t["F"] + t["B"] + t["W"]) for t in times)
    result = {}
    for schedule in PIPELINE_SCHEDULES:
        if schedule == "interleaved_1f1b" and micro_batches % stages:
            continue
        done = simulate(stages, micro_batches, times, schedule, max_waiting, virtual_stages)
        makespan = max(end for _, end in done.values())
        result[schedule] = (makespan + overhead, 1 - work / (stages * makespan))
    return result


def paper_times(config_name):
    """F, B, W per stage of conf/<config_name>.yaml (balanced partition, checkpointing as configured), in units of one
    decoder layer's forward: matmuls cost as much in B as in W; attention has no weights (all its backward is B);
    a checkpointed layer recomputes its forward in B; the LM head's input gradient is B, its weight gradient W."""
    from hydra import compose, initialize_config_dir

    from models.partition import DECODER, HEAD, decoder_counts_of_bounds, decoder_parameter_split, kind_layer
    from planner.stage_costs import LayerCosts
    from training.run_spec import plan_spec

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        spec = plan_spec(compose(config_name=config_name))
    cfg, config, workload = spec.cfg, spec.model_config, spec.workload
    layers = LayerCosts(config, workload)
    sharded, replicated = decoder_parameter_split(config, kind_layer(config, DECODER))  # the unit's own layer
    unit = layers.forward_flops[DECODER]
    matmul = (2 * workload.tokens * sharded + 2 * workload.residual_tokens * replicated) / unit
    attention = 1 - matmul
    recompute = 1 if workload.activation_checkpoint_interval else 0
    head = layers.forward_flops[HEAD] / unit
    counts = decoder_counts_of_bounds(spec.stage_bounds)
    times = []
    for stage, count in enumerate(counts):
        last = stage == cfg.num_stages - 1
        times.append({"F": count + (head if last else 0),
                      "B": count * (matmul + 2 * attention + recompute) + (head if last else 0),
                      "W": count * matmul + (head if last else 0)})
    return cfg.num_stages, cfg.gradient_accumulation_steps, times, counts


def print_prediction(stages, micro_batches, times, overhead=0.0, unit="s", caps=(None,), virtual_stages=2):
    """1F1B's step and bubble, zero_bubble's for each cap on micro-batches waiting for W, then interleaved 1F1B's
    (where m is a multiple of p) and ZB-V's."""
    uncapped = predict(stages, micro_batches, times, overhead, None, virtual_stages)
    lines = [("1f1b", uncapped["1f1b"])]
    lines += [("zero_bubble" if cap is None else f"zero_bubble max_waiting={cap}",
               predict(stages, micro_batches, times, overhead, cap)["zero_bubble"]) for cap in caps]
    if "interleaved_1f1b" in uncapped:
        lines.append((f"interleaved_1f1b v={virtual_stages}", uncapped["interleaved_1f1b"]))
    lines.append(("zbv", uncapped["zbv"]))
    for name, (step, bubble) in lines:
        print(f"p={stages} m={micro_batches:>3}  {name:<26} step {step:10.4f} {unit}  bubble {bubble:6.1%}")


def print_table(times, virtual_stages):
    """Each schedule's bubble for p = 2, 4, 8 and m = p, 2p, ... up to 64 (interleaving needs m a multiple of p)."""
    names = ["1f1b", "zero_bubble", "interleaved_1f1b", "zbv"]
    print(f"{'p':>2} {'m':>3}  " + "  ".join(f"{name:>16}" for name in names)
          + f"   (bubble; interleaved_1f1b v={virtual_stages})")
    for stages in (2, 4, 8):
        for micro_batches in sorted({stages, *range(stages, 65, stages), 64}):
            result = predict(stages, micro_batches, times, virtual_stages=virtual_stages)
            print(f"{stages:>2} {micro_batches:>3}  " + "  ".join(f"{result[name][1]:>16.1%}" for name in names))


def parse_cap(text):
    return None if text.lower() in ("none", "null") else int(text)


def parse_times(text):
    values = [float(v) for v in text.split(",")]
    if len(values) != 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not F,B,W (three non-negative seconds)")
    return dict(zip("FBW", values))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int)
    parser.add_argument("--micro-batches", type=int, nargs="+")
    parser.add_argument("--times", type=parse_times, nargs="+", help="F,B,W seconds: one for all stages or per stage")
    parser.add_argument("--overhead", type=float, default=0.0, help="seconds each step adds outside the schedule")
    parser.add_argument("--max-waiting", type=parse_cap, nargs="+", default=[None],
                        help="zero_bubble_max_waiting values to simulate (null: ZB-H1's)")
    parser.add_argument("--virtual-stages", type=int, default=2, help="interleaved_1f1b's chunks per rank")
    parser.add_argument("--table", action="store_true", help="every schedule's bubble, p = 2, 4, 8, m = p ... 64")
    parser.add_argument("--config", default="llama_65b", help="without --times: the shipped config on paper")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.max_waiting = [None, 0]
    if args.times is None and not args.table:
        stages, micro_batches, times, counts = paper_times(args.config)
        print(f"{args.config} on paper (conf/{args.config}.yaml: {stages} stages, {micro_batches} micro-batches, "
              f"decoder layers per stage {counts}); times in decoder-layer forwards; stage 0: F {times[0]['F']:.2f} "
              f"B {times[0]['B']:.2f} W {times[0]['W']:.2f}, last stage: F {times[-1]['F']:.2f} "
              f"B {times[-1]['B']:.2f} W {times[-1]['W']:.2f}")
        print_prediction(stages, micro_batches, times, unit="F", caps=args.max_waiting,
                         virtual_stages=args.virtual_stages)
        return
    if args.table:
        if args.times is None or len(args.times) != 1:
            parser.error("--table takes --times with one F,B,W for all stages")
        print_table(args.times, args.virtual_stages)
        return
    if args.stages is None or args.micro_batches is None:
        parser.error("--times needs --stages and --micro-batches")
    for m in args.micro_batches:
        print_prediction(args.stages, m, args.times, args.overhead, caps=args.max_waiting,
                         virtual_stages=args.virtual_stages)


if __name__ == "__main__":
    main()
